"""flashdraft from Python: the functions the CLI commands are built on.

    target = Target.from_pretrained("tiny")            # or a local Hugging Face directory
    drafter = Drafter.from_pretrained("tiny-drafter")  # a name, drafter directory, run or .pt
    out = drafter.generate(target, prompt_ids, max_new_tokens=64)   # ids + acceptance lengths
    summary = evaluate_drafter(drafter, target, prompts="builtin:code:heldout")  # eval --json's dict
    run = train_drafter(TrainConfig(max_steps=100), "tiny", "run", completions="train.json")

Each is a thin layer over the module that does the work (`flashdraft.target.model`,
`flashdraft.drafter.run_dir`, `flashdraft.decoding.generate`, `flashdraft.evaluation.run`, `flashdraft.train.run`,
`flashdraft.data`): the same checks, the same errors (`FlashdraftError`, one line naming the
file or field), the same figures as the command line.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.decoding.generate import (
    GenerationResult,
    SpeculativeConfig,
    autoregressive_generate,
    speculative_generate,
)
from flashdraft.decoding.proposers import DraftLimit
from flashdraft.decoding.serving_rules import (
    NO_FILTERS,
    SamplingParams,
    greedy_in_effect_note,
    request_filters,
    resolve_filters,
)
from flashdraft.decoding.serving_rules import serving_rule as _serving_rule
from flashdraft.drafter.checkpoint import check_drafter_matches_target
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.drafter.run_dir import LoadedDrafter, load_any_drafter
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.records import Log, quiet
from flashdraft.target.model import TargetModel
from flashdraft.train.config import TrainConfig

# the public names are flashdraft.__all__ (the package re-exports them from here)

Prompt = str | list[int]


def _warn_greedy_in_effect(temperature: float, filters) -> None:
    note = greedy_in_effect_note(temperature, filters)
    if note:
        warnings.warn(note.removeprefix("warning: "), stacklevel=3)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def _encode(target: TargetModel, prompt: Prompt) -> list[int]:
    # a string as `flashdraft speculate --prompt` takes it: the tokenizer's ids, no chat template
    return list(target.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)


class Target(TargetModel):
    """A frozen target LM as DFlash sees it (a `flashdraft.target.model.TargetModel`): its tokenizer
    (`.tokenizer`), its layers' hidden states and its cache with rollback."""

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> Target:
        """Load "tiny" (the built-in target) or a local Hugging Face model directory (nothing is
        downloaded), whole, on `device` in `dtype`."""
        return cls.load(name_or_path, device=device, dtype=dtype)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string through the target's tokenizer (no chat template), ids
        as they are."""
        return _encode(self, prompt)

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        use_generation_config: bool = True,
    ) -> GenerationResult:
        """Plain decoding, one token per forward (greedy at temperature 0): what speculative
        decoding must reproduce. Only the new tokens are returned (`.output_ids`). At
        temperature > 0 the target's p is filtered by `top_k`, `top_p`, `min_p` (each None: the
        target's generation_config.json value, as the servers apply it, unless
        `use_generation_config` is off)."""
        filters = NO_FILTERS
        if temperature > 0:
            filters = resolve_filters(self.path, top_k, top_p, min_p, use_generation_config)
            _warn_greedy_in_effect(temperature, filters)
        return autoregressive_generate(
            self,
            self.encode(prompt),
            max_new_tokens,
            sampling=SamplingParams(temperature=temperature, filters=filters),
            generator=_generator(seed, self.device),
        )


@dataclass
class Drafter(LoadedDrafter):
    """A DFlash drafter and where it came from: `.model` (the `torch.nn.Module`), `.config`
    (`flashdraft.drafter.config.DrafterConfig`), `.path` (what was read), `.form` ("drafter
    directory", "training run", "training checkpoint" or "state dict") and `.assumed` (what a
    bare state dict could not tell, in words)."""

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        target: TargetModel | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        block_size: int | None = None,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        verify: bool = True,
    ) -> Drafter:
        """Load a drafter from any form `flashdraft eval --checkpoint` takes: a shipped name
        ("tiny-drafter"), a drafter directory (this project's or a public one), a training run
        (its newest complete checkpoint), one checkpoint of it, or a bare `.pt`/`.safetensors`
        state dict (which needs `target`, and takes block_size, target_layer_ids and
        mask_token_id where it cannot tell them). Strict: a missing or misshaped tensor is an
        error, never a random weight. `verify`: check a checkpoint's sha256 sums."""
        loaded = load_any_drafter(
            name_or_path,
            target,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            device=device,
            dtype=dtype,
            verify=verify,
        )
        if target is not None:
            check_drafter_matches_target(loaded.drafter.config, target, str(loaded.path))
        return cls(**{f.name: getattr(loaded, f.name) for f in dataclasses.fields(LoadedDrafter)})

    @property
    def model(self) -> DFlashDrafter:
        """The drafter module (`flashdraft.drafter.model.DFlashDrafter`)."""
        return self.drafter

    @property
    def config(self):
        """The drafter's `flashdraft.drafter.config.DrafterConfig` (as config.json says)."""
        return self.drafter.config

    def check_fits(self, target: TargetModel) -> None:
        """Refuse a target this drafter was not made for, or one on another device or dtype."""
        check_drafter_matches_target(self.config, target, str(self.path))
        p = next(self.drafter.parameters())
        if (p.device, p.dtype) != (target.device, target.dtype):
            raise FlashdraftError(
                f"{self.path}: the drafter is on {p.device} in {p.dtype}, the target on {target.device} in "
                f"{target.dtype}; expected both alike (Drafter.from_pretrained(..., device=, dtype=))"
            )

    def generate(
        self,
        target: TargetModel,
        prompt: Prompt,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        block_size: int | None = None,
        seed: int | None = None,
        serving_rule: str | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        use_generation_config: bool = True,
        num_speculative_tokens: int | None = None,
        adaptive_threshold: float | None = None,
        confidence_threshold: float | None = None,
        compile: bool | None = None,
    ) -> GenerationResult:
        """Speculative decoding of `prompt` (a string or token ids) with this drafter and
        `target`: `.output_ids` (new tokens only; greedy equals `target.generate`, sampling keeps
        the target's distribution), `.acceptance_lengths` (tokens committed per step), `.tau`,
        `.expected_lengths`, and the seconds spent drafting and verifying. `block_size`: default
        the drafter's. The rest as eval's flags: at temperature > 0, `serving_rule` (a name of
        `flashdraft.decoding.serving_rules.RULES`; default vLLM's) decides how drafts are drawn and
        verified, and `top_k`, `top_p`, `min_p` filter the target's p as that rule's server does
        (each None: the target's generation_config.json value unless `use_generation_config` is
        off; one the server does not apply, given, is refused); `num_speculative_tokens`,
        `adaptive_threshold` and `confidence_threshold` verify fewer drafts per step; `compile` verifies on the
        target's static cache compiled once (None: where it pays; the result's `compiles`, `recompiles` and
        `graph_breaks` say what torch.compile did). More than 8 parameters
        because this is the public API's one call, taking `flashdraft eval`'s flags by name (keyword-only)."""
        self.check_fits(target)
        rule = _serving_rule(serving_rule)
        filters, _ = request_filters(
            target.path,
            temperature,
            top_k,
            top_p=top_p,
            min_p=min_p,
            rule=rule,
            use_generation_config=use_generation_config,
        )
        _warn_greedy_in_effect(temperature, filters)
        limits = (num_speculative_tokens, adaptive_threshold, confidence_threshold)
        limit = DraftLimit(*limits) if any(v is not None for v in limits) else None
        return speculative_generate(
            target,
            self.drafter,
            _encode(target, prompt),
            max_new_tokens,
            sampling=SamplingParams(temperature=temperature, filters=filters),
            speculative=SpeculativeConfig(block_size=block_size, limit=limit, rule=rule, compile=compile),
            generator=_generator(seed, target.device),
        )


def _default_device_dtype(device: str | None, dtype: torch.dtype | None) -> tuple[str, torch.dtype]:
    """cuda when available, else cpu; bf16 on GPU, fp32 on CPU (as every command)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, dtype or (torch.bfloat16 if torch.device(device).type != "cpu" else torch.float32)


def evaluate_drafter(
    drafter: str | Path | Drafter,
    target: str | Path | TargetModel,
    *,
    hybrid: bool = False,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    log: Log = quiet,
    **options: Any,
) -> dict[str, Any]:
    """τ of a drafter, offline or online: the dict `flashdraft eval --json` writes (`tau`,
    `histogram`, `position_acceptance`, `per_prompt`, online `speedup` and `lossless`, ...).

    `drafter`: a `Drafter`, anything `Drafter.from_pretrained` takes, or "ngram" (the n-gram
    baseline); `hybrid`: the drafter together with the n-gram lookup (`eval --drafter hybrid`).
    `target`: a loaded `Target` (its device and dtype are used), or its name or directory:
    then it is loaded as the evaluation needs it (offline from a cache: its head only).
    `options`: the fields of `evaluation.run.EvalConfig` (`EvalConfig.option_names()`, eval's options): one of
    cached_hidden_states, completions or prompts (with num_prompts); online,
    check_consistency, reference, max_blocks, max_new_tokens, block_size, temperature,
    num_speculative_tokens, adaptive_threshold, seed, ... `log`: where eval's lines go
    (`print` to see them)."""
    from flashdraft.evaluation.config import EvalConfig
    from flashdraft.evaluation.run import run_eval

    loaded_target = target if isinstance(target, TargetModel) else None
    if loaded_target is not None:
        found = (torch.device(device) if device else loaded_target.device, dtype or loaded_target.dtype)
        if found != (loaded_target.device, loaded_target.dtype):
            raise FlashdraftError(
                f"device {found[0]}, dtype {found[1]}: the target given is on {loaded_target.device} in "
                f"{loaded_target.dtype}; expected no device/dtype with a loaded target, or the same"
            )
        device, dtype = str(loaded_target.device), loaded_target.dtype
    device, dtype = _default_device_dtype(device, dtype)
    loaded_drafter = drafter if isinstance(drafter, Drafter) else None
    if loaded_drafter is not None and loaded_target is not None:
        loaded_drafter.check_fits(loaded_target)
    ngram = loaded_drafter is None and str(drafter) == "ngram"
    cfg = EvalConfig(
        None if ngram else str(loaded_drafter.path if loaded_drafter else drafter),
        str(loaded_target.path if loaded_target else target),
        proposer="hybrid" if hybrid else "ngram" if ngram else "dflash",
        device=device,
        dtype=dtype,
        **options,
    )
    return run_eval(cfg, log, target=loaded_target, given=loaded_drafter)


def train_drafter(config: TrainConfig, target_model: str | Path, out: str | Path, **options: Any) -> Path:
    """Train a drafter with `config` (a `TrainConfig`: the fields of `flashdraft train
    --config`) into the run directory `out`; returns its newest complete checkpoint (load it
    with `Drafter.from_pretrained`). The target is named, not passed: training loads it itself,
    only its head when it trains from a cache, on each rank's device under torchrun.

    `options`, as train's flags: cached_hidden_states (offline) or completions (online), init,
    draft_layers, block_size, mask_token_id, target_layer_ids, eval_cached_hidden_states,
    eval_completions, resume, report_to, allow_foreign, device, verify, target_dtype,
    draft_vocab_size, engine_feed (a `flashdraft.train.engine_feed.EngineFeedConfig`: with completions, the
    serving engine computes the states, `train --engine vllm`). `config` itself is left as it was (the run fills
    in a copy)."""
    from flashdraft.train.run import TrainRun, run_training

    return run_training(dataclasses.replace(config), TrainRun(target_model=str(target_model), out=str(out), **options))


def generate_completions(target_model: str | Path, prompts: str, out: str | Path, **options: Any) -> Path:
    """The target's own completions of a prompt set, written to `out` (`flashdraft generate`;
    a re-run resumes it). `prompts`: a .jsonl/.parquet file, a dataset directory or
    builtin:code[:heldout]; `options`, as generate's flags: num_prompts, max_new_tokens,
    temperature, seed, batch_size, backend, base_url, chat_template, chat_template_kwargs (a dict, e.g.
    {"enable_thinking": False}), enable_thinking, device, ..."""
    from flashdraft.data.generate import GenerateConfig, run_generate

    return run_generate(GenerateConfig(target_model=str(target_model), prompts=prompts, out=str(out), **options))


def cache_hidden_states(target_model: str | Path, completions: str | Path, out: str | Path, **options: Any) -> Path:
    """Cache the target's context features of a completions file in `out` (`flashdraft
    cache`; a re-run resumes it). `options`, as cache's flags: layers or draft_config,
    num_prompts, dtype, with_target_logits, records_per_shard, device, target_dtype, ..."""
    from flashdraft.data.cache_run import CacheConfig, run_cache

    config = CacheConfig(target_model=str(target_model), completions=str(completions), out=str(out), **options)
    if config.engine == "vllm":  # captured by the serving engine, verified against the target
        from flashdraft.data.engine_capture import run_engine_cache

        return run_engine_cache(config)
    return run_cache(config)
