"""Hidden states captured by the serving engine (vLLM's `extract_hidden_states`), checked against the target
before they are cached.

Captures from engines have been wrong in the field while their shapes were right: all-zero states from hybrid
targets, a layer off by one (DFlash's `target_layer_ids` l is vLLM's aux id l + 1, EAGLE's count differs), fewer
states than tokens under prefix caching. So every captured sample is checked for its length, token ids, finite and
non-zero states; a known-answer probe (a fixed token sequence) and a share of the samples (`--verify-share`) are
recomputed by the transformers forward, per layer and position (cosine, max abs error, relative error, and which of
layers l - 1, l, l + 1 the states match best); any failure refuses the cache in one line naming sample and layer.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from flashdraft.data.cache import (
    CAPTURE_DIR,
    DEFAULT_TOLERANCE,
    DTYPE_NAMES,
    LOCK,
    CacheSpec,
    CapturedFeatures,
    build_cache,
    check_new_cache_directory,
    relative_error,
)
from flashdraft.data.cache_run import CacheConfig, resolve_layer_ids
from flashdraft.data.completions import CompletionRecord
from flashdraft.errors import FlashdraftError
from flashdraft.serving.engine import SCRIPTS, engine_env, engine_info, engine_python, last_error_line
from flashdraft.target.image_files import refuse_engine_images
from flashdraft.target.model import TargetModel, resolve_target_path

VERIFY_SHARE = 0.05  # default share of samples recomputed by transformers (at least one), besides the probe
PROBE = "known-answer-probe"  # the probe's name among the captured sequences
PROBE_TOKENS = 48


def aux_layer_ids(layer_ids: list[int]) -> list[int]:
    """vLLM's aux hidden-state ids for DFlash layer ids: aux id k is transformers' hidden_states[k], the output of
    decoder layer k - 1, so layer l is aux id l + 1."""
    return [layer + 1 for layer in layer_ids]


def probe_tokens(vocab_size: int, n: int = PROBE_TOKENS) -> list[int]:
    """The known-answer probe: a fixed pseudo-random token sequence, the same in every run."""
    rng = random.Random(1234)
    return [rng.randrange(vocab_size) for _ in range(n)]


@dataclass(frozen=True)
class EngineSettings:
    """How the engine captures: what the cache records and `doctor` shows."""

    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = False  # vLLM #44485: fewer states than tokens under prefix caching
    enable_chunked_prefill: bool | None = None  # None: the engine's default


def run_capture(
    python: Path,
    target: TargetModel,
    layer_ids: list[int],
    sequences: dict[str, list[int]],
    directory: Path,
    settings: EngineSettings,
    log=print,
) -> dict[str, Any]:
    """Capture `sequences` (name -> token ids) with the engine into `directory` (one file per sequence; files of
    an earlier, interrupted run are kept); returns what the engine reports of itself and its settings."""
    directory.mkdir(parents=True, exist_ok=True)
    job = {
        "model": str(resolve_target_path(target.path)),
        "aux_layer_ids": aux_layer_ids(layer_ids),
        "dtype": DTYPE_NAMES[target.dtype],
        "out_dir": str(directory),
        "seed": 0,
        "sequences": [{"name": name, "token_ids": ids} for name, ids in sequences.items()],
        **asdict(settings),
    }
    (directory / "job.json").write_text(json.dumps(job))
    log_path = directory / "engine.log"
    log(
        f"capturing {len(sequences)} sequences with {engine_info(python).describe()} ({python}): aux layer ids "
        f"{job['aux_layer_ids']} for target layers {layer_ids}, {job['dtype']}; log {log_path}"
    )
    with open(log_path, "w") as out:
        command = [str(python), str(SCRIPTS / "flashdraft_vllm_capture.py"), str(directory / "job.json")]
        done = subprocess.run(
            command, env=engine_env(python), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    if done.returncode != 0:
        raise FlashdraftError(
            f"the engine's capture failed (exit {done.returncode}): {last_error_line(log_path)} (log: {log_path})"
        )
    return json.loads((directory / "engine.json").read_text())


def load_captured(directory: Path, name: str) -> tuple[torch.Tensor, list[int]]:
    """A captured sequence: states [n_tokens, n_layers, H] and the token ids the engine saw."""
    path = directory / f"{name}.safetensors"
    if not path.is_file():
        raise FlashdraftError(f"{path}: the engine wrote no states for sample {name}")
    data = load_file(path)
    if "hidden_states" not in data or "token_ids" not in data:
        raise FlashdraftError(f"{path}: expected tensors hidden_states and token_ids, found {sorted(data)}")
    return data["hidden_states"], data["token_ids"].tolist()


def check_sample(
    name: str, tokens: list[int], states: torch.Tensor, engine_tokens: list[int], layer_ids: list[int], hidden: int
) -> None:
    """What every captured sample must be: one state per token, for every layer, of the tokens sent, finite and
    not all zero."""
    if states.dim() != 3 or states.shape[1:] != (len(layer_ids), hidden):
        expected = f"[{len(tokens)}, {len(layer_ids)}, {hidden}]"
        raise FlashdraftError(
            f"sample {name}: captured states have shape {list(states.shape)}, expected {expected} "
            f"(tokens, layers {layer_ids}, hidden)"
        )
    if states.shape[0] != len(tokens):
        raise FlashdraftError(
            f"sample {name}: {states.shape[0]} captured states for {len(tokens)} tokens (short "
            f"states: prefix caching? vLLM #44485); expected one per token"
        )
    if engine_tokens != tokens:
        k = next(i for i, (a, b) in enumerate(zip(engine_tokens, tokens, strict=False)) if a != b)
        raise FlashdraftError(f"sample {name}: the engine's token ids differ from the sample's at position {k}")
    for j, layer in enumerate(layer_ids):
        layer_states = states[:, j]
        if not torch.isfinite(layer_states).all():
            raise FlashdraftError(f"sample {name} layer {layer}: captured states are NaN/Inf")
        if not layer_states.any():
            raise FlashdraftError(
                f"sample {name} layer {layer}: captured states are all zero (the engine did not "
                f"fill them: vLLM #46301 on hybrid targets); refusing to cache them"
            )
        zero_rows = (~layer_states.any(dim=-1)).nonzero()
        if len(zero_rows):
            raise FlashdraftError(
                f"sample {name} layer {layer}: {len(zero_rows)} of {len(tokens)} positions hold "
                f"all-zero states (first: position {int(zero_rows[0])})"
            )


def verify_picks(num_samples: int, share: float, seed: int = 0) -> list[int]:
    """The samples recomputed by the target: `share` of them (at least one), drawn by `seed`."""
    count = min(num_samples, max(1, round(share * num_samples)))
    return sorted(random.Random(seed).sample(range(num_samples), count))


@dataclass
class LayerMatch:
    """One captured layer against the target's own forward."""

    sample: str
    layer: int
    cosine_min: float  # over positions
    max_abs_error: float
    relative_error: float
    best_layer: int  # of l - 1, l, l + 1: the layer whose transformers states the capture is nearest
    best_error: float  # the relative error to that layer


@torch.no_grad()
def compare_with_target(
    target: TargetModel, name: str, tokens: list[int], states: torch.Tensor, layer_ids: list[int]
) -> list[LayerMatch]:
    """Each captured layer against transformers' hidden_states[l + 1] (and its neighbours, for the best match)."""
    ids = torch.tensor([tokens], device=target.device)
    fresh = target.model(input_ids=ids, output_hidden_states=True).hidden_states  # L + 1 x [1, T, H]
    matches = []
    for j, layer in enumerate(layer_ids):
        got = states[:, j].float()
        errors = {
            k: relative_error(got, fresh[k + 1][0].float().cpu())
            for k in (layer - 1, layer, layer + 1)
            if 0 <= k + 1 < len(fresh)
        }
        want = fresh[layer + 1][0].float().cpu()
        cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        matches.append(
            LayerMatch(
                name,
                layer,
                float(cosine.min()),
                float((got - want).abs().max()),
                errors[layer],
                min(errors, key=errors.get),
                min(errors.values()),
            )
        )
    return matches


def refuse_mismatch(matches: list[LayerMatch], tolerance: float) -> None:
    """A layer whose states are not the target's within `tolerance` is refused: as off by one when a neighbouring
    layer's are, else with its figures."""
    for m in matches:
        if m.relative_error <= tolerance:
            continue
        if m.best_layer != m.layer and m.best_error <= tolerance:
            raise FlashdraftError(
                f"sample {m.sample} layer {m.layer}: the captured states are layer {m.best_layer}'s "
                f"(hidden_states[{m.best_layer + 1}], not [{m.layer + 1}]): a layer off by one; "
                f"relative error to layer {m.layer} {m.relative_error:.2e}"
            )
        raise FlashdraftError(
            f"sample {m.sample} layer {m.layer}: captured states differ from the target's forward "
            f"(relative error {m.relative_error:.2e} > {tolerance:.0e}, min cosine "
            f"{m.cosine_min:.4f}, max abs error {m.max_abs_error:.2e})"
        )


def verify_capture(
    target: TargetModel,
    records: list[CompletionRecord],
    directory: Path,
    layer_ids: list[int],
    verify_share: float,
    seed: int = 0,
    log=print,
) -> dict[str, Any]:
    """Every sample checked (`check_sample`); the probe and a `verify_share` of the samples recomputed by the
    target (`compare_with_target`). Returns the verification's figures for the cache's manifest."""
    for r in records:
        states, engine_tokens = load_captured(directory, r.id)
        check_sample(r.id, r.prompt_ids + r.completion_ids, states, engine_tokens, layer_ids, target.hidden_size)
    picks = verify_picks(len(records), verify_share, seed)
    count = len(picks)
    samples = [(PROBE, probe_tokens(target.vocab_size))]
    samples += [(records[i].id, records[i].prompt_ids + records[i].completion_ids) for i in picks]
    tolerance = DEFAULT_TOLERANCE[DTYPE_NAMES[target.dtype]]  # the dtype's rounding alone, as `doctor` allows
    matches = []
    for name, tokens in samples:
        states, engine_tokens = load_captured(directory, name)
        check_sample(name, tokens, states, engine_tokens, layer_ids, target.hidden_size)
        found = compare_with_target(target, name, tokens, states, layer_ids)
        refuse_mismatch(found, tolerance)
        matches += found
    worst = max(matches, key=lambda m: m.relative_error)
    log(
        f"verified the capture: {len(records)} samples checked (length, token ids, finite, non-zero); the probe and "
        f"{count} samples recomputed by transformers: worst relative error {worst.relative_error:.2e} (sample "
        f"{worst.sample} layer {worst.layer}; tolerance {tolerance:.0e}), min cosine "
        f"{min(m.cosine_min for m in matches):.6f}"
    )
    return {
        "samples_checked": len(records),
        "verify_share": verify_share,
        "samples_recomputed": [n for n, _ in samples],
        "tolerance": tolerance,
        "worst_relative_error": worst.relative_error,
        "min_cosine": min(m.cosine_min for m in matches),
        "max_abs_error": max(m.max_abs_error for m in matches),
    }


def capture_features(
    target: TargetModel,
    records: list[CompletionRecord],
    out: Path,
    layer_ids: list[int],
    python: str | None,
    settings: EngineSettings,
    verify_share: float,
    log=print,
) -> tuple[Any, dict[str, Any]]:
    """Capture and verify every record's states with the engine; returns a `features_of(record)` for the cache
    builder ([T, len(layer_ids) * H], as `TargetModel.forward`'s context features) and the engine's record."""
    if not 0 <= verify_share <= 1:
        raise FlashdraftError(f"--verify-share {verify_share}: expected a share in [0, 1]")
    refuse_engine_images(records, "cache --engine vllm")  # before the engine starts: it is sent token ids only
    py = engine_python(python)
    directory = out / CAPTURE_DIR
    sequences = {PROBE: probe_tokens(target.vocab_size)} | {r.id: r.prompt_ids + r.completion_ids for r in records}
    engine = run_capture(py, target, layer_ids, sequences=sequences, directory=directory, settings=settings, log=log)
    verified = verify_capture(target, records, directory, layer_ids, verify_share, log=log)
    info = engine_info(py)
    record = {
        "engine": info.distribution,
        "version": info.version,
        "dtype": DTYPE_NAMES[target.dtype],
        "aux_layer_ids": aux_layer_ids(layer_ids),
        "tensor_parallel_size": settings.tensor_parallel_size,
        "prefix_caching": settings.enable_prefix_caching,
        "chunked_prefill": settings.enable_chunked_prefill,
        "connector": engine.get("connector"),
        "verification": verified,
    }

    def features_of(r: CompletionRecord) -> torch.Tensor:
        states, _ = load_captured(directory, r.id)
        return states.reshape(states.shape[0], -1)  # [T, n_layers * H]: layer blocks side by side

    return features_of, record


def remove_capture(out: Path) -> None:
    shutil.rmtree(out / CAPTURE_DIR, ignore_errors=True)


def run_engine_cache(config: CacheConfig, log=print) -> Path:
    """`flashdraft cache --engine vllm`: the same verified cache as `flashdraft cache`, its states captured by the
    engine and checked against the target (which is loaded for that, on the CPU unless a GPU is free)."""
    from flashdraft.data.completions import load_completions
    from flashdraft.distributed import load_dtype
    from flashdraft.files import OutputLock

    c = config
    if c.with_target_logits:
        raise FlashdraftError(
            f"--with-target-logits {c.with_target_logits} with --engine: the engine captures hidden "
            f"states only; cache the logits without --engine (the transformers forward)"
        )
    settings = EngineSettings(c.tensor_parallel_size, c.enable_prefix_caching)
    check_new_cache_directory(Path(c.out))  # before the engine writes its states into it
    lock = OutputLock(Path(c.out) / LOCK, Path(c.out), "flashdraft cache")
    try:
        # the verifying forward runs beside the engine's memory, not in it: on the CPU unless told otherwise
        dev = torch.device(c.device or "cpu")
        target = TargetModel.load(c.target_model, dev, load_dtype(dev, c.target_dtype))
        layer_ids = resolve_layer_ids(target, c.layers, c.draft_config)
        loaded = load_completions(c.completions, target, allow_foreign=c.allow_foreign)
        records = loaded.records[: c.num_prompts] if c.num_prompts is not None else loaded.records
        features_of, engine = capture_features(
            target,
            records,
            Path(c.out),
            layer_ids=layer_ids,
            python=c.engine_python,
            settings=settings,
            verify_share=c.verify_share,
            log=log,
        )
        spec = CacheSpec(layer_ids, c.dtype, c.records_per_shard, 0, c.num_prompts)
        captured = CapturedFeatures(features_of, engine)
        directory = build_cache(target, loaded, c.out, spec, force=c.force, captured=captured, verbose=c.verbose)
        remove_capture(Path(c.out))
    finally:
        lock.release()
    return directory
