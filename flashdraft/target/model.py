"""Target adapters: a local Hugging Face causal LM (Qwen3, Qwen3.5/3.6 hybrids, Llama; Qwen3-Next,
Nemotron-H's Mamba-2 hybrids and MLA targets through `qwen3_next`, `mamba` and `mla` of this wing) or
the built-in `tiny` target, with context features, incremental forward and exact rollback.

Context features are the outputs of decoder layers `target_layer_ids`, that is
`hidden_states[l + 1]` of `output_hidden_states` (index 0 is the embedding output); they
are captured with forward hooks so the other layers' outputs are never kept.

Rollback after partial acceptance (section 6 of the reference doc): attention layers crop
their KV cache; linear-attention layers (Gated DeltaNet, Mamba-2) cannot be cut back, so before each
forward their conv and recurrent states are copied, the inputs of each linear layer are
captured during the forward, and rollback restores the copy and re-runs only those linear
layers over the accepted prefix. That recomputes the recurrence exactly and costs far less
than re-running the whole target (see `benchmarks/rollback.py`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashdraft.errors import FlashdraftError
from flashdraft.safe_load import HF_LOCAL, hf_load_error
from flashdraft.target.layer_kinds import (
    RECURRENT,
    decoder_of,
    read_logit_transform,
    read_support,
    support_of_model,
)
from flashdraft.target.linear_attention import BlockRecord, install_short_block_path, state_after
from flashdraft.target.mamba import is_mamba, mamba_backend, recurrent_mixer
from flashdraft.target.mla import align_mla_heads
from flashdraft.target.quantisation import (
    Quantisation,
    identity_of,
    is_quantisation_parameter,
    quantisation_config_of,
    quantisation_of,
)
from flashdraft.target.quantisation import (
    load_error as quantised_load_error,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub: targets are local directories
# transformers warns on every process that fla is absent; flashdraft reports the backend itself
logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)

TINY_DIR = Path(__file__).parents[1] / "assets" / "tiny"


def _route_linear_attention_by_device(modeling_module) -> None:
    """With fla installed (the `gpu` extra), transformers binds Gated DeltaNet to fla's triton
    kernels whatever the device, and they fail on CPU tensors ("0 active drivers"). Route CPU
    calls to the torch fallback and leave CUDA calls to fla; done once per modeling module."""
    if find_spec("fla") is None:
        return
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        kernel = getattr(modeling_module, name, None)
        if kernel is None or getattr(kernel, "_flashdraft_routed", False):
            continue
        torch_fn = inspect.unwrap(kernel)

        @functools.wraps(kernel)  # __wrapped__ = kernel, so inspect.unwrap still reaches torch_fn
        def routed(query, *args, _kernel=kernel, _torch_fn=torch_fn, **kwargs):
            return (_kernel if query.is_cuda else _torch_fn)(query, *args, **kwargs)

        routed._flashdraft_routed = True
        setattr(modeling_module, name, routed)


# Attention kernels for decoding on CUDA, in order of preference. cuDNN's is left out: torch >= 2.10 prefers it on
# sm90, and it builds an execution graph for every new key length, which decoding presents at every step (the
# target's full-attention layers, the drafter's calls); flash attention takes any length without a build, the
# memory-efficient kernel takes masks flash does not, and the math kernel anything left.
DECODING_ATTENTION = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def decoding_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """The attention kernels decoding runs with on `device`: `DECODING_ATTENTION`, in that order, on CUDA; nothing
    changes on other devices (the CPU has no cuDNN kernel)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(DECODING_ATTENTION), set_priority=True)


def resolve_target_path(name_or_path: str | Path) -> Path:
    path = TINY_DIR if str(name_or_path) == "tiny" else Path(name_or_path)
    if not (path / "config.json").is_file():
        if str(name_or_path) == "tiny":
            raise FlashdraftError(f"{path}: the built-in tiny target is missing; run scripts/train_tiny_target.py")
        raise FlashdraftError(
            f"{path}: not a local model directory (no config.json); --target-model takes a local Hugging Face "
            f"directory or the word 'tiny' (nothing is downloaded)"
        )
    return path


# -- identity and small facts, shared with `flashdraft.target.weights.TargetHead` --------------

SAMPLES_PER_TENSOR = 1024  # the fingerprint hashes about this many strided values of each tensor


def sample_stride(numel: int) -> int:
    return max(1, numel // SAMPLES_PER_TENSOR)


def strided_sample(t: torch.Tensor) -> torch.Tensor:
    """flat[::stride] of a tensor as the model holds it, as fp32 on the CPU."""
    flat = t.detach().reshape(-1)
    return flat[:: sample_stride(flat.numel())].float().cpu()


def fingerprint_of(config, tokenizer, samples, quantised: str = "") -> str:
    """Hash of the text config, the vocabulary and (state dict name, strided sample) pairs in
    sorted name order: what identifies a target, however and wherever it was loaded. `quantised`: a quantised
    target's scheme (`quantisation.identity_of` its config); its scales are then left out, being in its weights."""
    h = hashlib.sha256()
    # where and in which dtype the target was loaded must not change its identity (nor whether a quantised one's
    # weights are compressed, on disk, or decompressed, in memory: its scheme is hashed instead)
    config = {
        k: v
        for k, v in config.to_dict().items()
        if k not in ("_name_or_path", "dtype", "torch_dtype", "transformers_version", "quantization_config")
    }
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(quantised.encode())
    h.update(str(sorted(tokenizer.get_vocab().items())).encode())
    for name, sample in samples:
        if ".experts." in name:
            # routed experts: transformers 5 fuses them on load (experts.gate_up_proj) while checkpoints store
            # them per expert, so neither side can name them as the other does; the router and the rest identify
            continue
        if quantised and is_quantisation_parameter(name):
            continue  # scales and zero points: the dequantised weights they make are hashed (quantisation.py)
        h.update(name.encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def stop_token_ids_of(generation_config, config, tokenizer) -> list[int]:
    """EOS ids from the generation config, else the model config, else the tokenizer."""
    eos = generation_config.eos_token_id if generation_config else None
    eos = eos if eos is not None else config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def pick_mask_token(target: TargetModel) -> int:
    """The tokenizer's mask token, else its pad token, else an unused special token."""
    tok = target.tokenizer
    for attr in ("mask_token_id", "pad_token_id"):
        token_id = getattr(tok, attr, None)
        if token_id is not None and token_id not in target.stop_token_ids:
            return int(token_id)
    for token, token_id in sorted(tok.get_added_vocab().items(), key=lambda kv: kv[1]):
        if token_id not in target.stop_token_ids and ("unused" in token or "reserved" in token):
            return int(token_id)
    raise FlashdraftError(
        f"{target.path}: the tokenizer has no mask, pad or unused special token; give --mask-token-id"
    )


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise FlashdraftError(
            f"target_layer_ids {layer_ids}: {bad} outside the target's {num_layers} layers "
            f"(0..{num_layers - 1}); the drafter was made for another target"
        )


def norm_multiplier(norm_class: str, weight: torch.Tensor) -> torch.Tensor:
    """What an RMS norm multiplies by, in fp32: Qwen3.5's and Qwen3-Next's norms store (weight - 1) and
    compute x * (1 + weight) (their gated norms excepted); the others store the weight itself."""
    weight = weight.detach().float()
    zero_centred = norm_class.startswith(("Qwen3_5", "Qwen3Next")) and not norm_class.endswith("Gated")
    return weight + 1.0 if zero_centred else weight


def final_norm_of(decoder: nn.Module) -> nn.Module | None:
    """The decoder's final norm: `norm`, or Nemotron-H's `norm_f`; None if it has neither."""
    return getattr(decoder, "norm", None) or getattr(decoder, "norm_f", None)


@dataclass
class TargetCache:
    """The target's cache plus what rollback needs from the last forward."""

    kv: object  # transformers DynamicCache (attention KV and linear-attention states)
    length: int = 0  # tokens whose state is in the cache
    last_forward_tokens: int = 0  # new tokens of the last forward (re-fed pending tokens excluded)
    last_pending: int = 0  # pending tokens the last forward re-fed first
    last_input_ids: torch.Tensor | None = None  # [N, last_pending + last_forward_tokens]
    pending: torch.Tensor | None = None  # [N, P] accepted tokens to re-feed before the next input (deferred mode)
    linear_snapshot: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    linear_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    linear_blocks: dict[int, BlockRecord] = field(default_factory=dict)  # short-block forwards' records


@dataclass
class TargetOutput:
    """A forward's outputs. Logits are computed from `hidden` when first read, and `logits_at`
    computes only some rows: decoding reads the last row of a prefill (the LM head over every row of a long prompt
    would be [T, V] logits), greedy verification the block's rows."""

    hidden: torch.Tensor | None  # [N, T, hidden] after the final norm
    context_features: torch.Tensor | None  # [N, T, len(layer_ids) * hidden]
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None
    _logits: torch.Tensor | None = None

    @property
    def logits(self) -> torch.Tensor:  # [N, T, vocab]
        if self._logits is None:
            self._logits = self.lm_head(self.hidden)
        return self._logits

    def logits_at(self, start: int, end: int) -> torch.Tensor:  # [N, end - start, vocab]
        return self._logits[:, start:end] if self._logits is not None else self.lm_head(self.hidden[:, start:end])


def _crop(layer, drop: int) -> None:
    """Drop the last `drop` tokens of an attention layer's cache. A sliding-window layer that records its past
    (`new_cache`) is cut back to its window too, even when nothing is dropped; below its window it is cropped as a
    full layer (whose crop(0) would empty it)."""
    window = getattr(layer, "sliding_window", None)
    if window is not None and getattr(layer, "record_past", False) and layer.get_seq_length() >= window:
        layer.crop(-drop)
    elif drop > 0:
        layer.crop(-drop)


class TargetModel:
    """A frozen causal LM seen through what DFlash needs of it."""

    def __init__(self, model: nn.Module, tokenizer, path: Path) -> None:
        where = str(path) if path is not None else "the target"
        self.support = support_of_model(model, where)
        self.model = model.eval().requires_grad_(False)
        align_mla_heads(self.model)
        self.tokenizer = tokenizer
        self.path = path
        self.config = model.config.get_text_config()
        self.decoder = decoder_of(model)
        # what the causal LM does to its LM head's output (a scale, a soft cap), read by running it once
        self.logit_transform_name, self._logit_transform = read_logit_transform(self.model, self.decoder, where)
        self.layers: nn.ModuleList = self.decoder.layers
        self.layer_types: list[str] = list(
            getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        )
        # layers whose recurrent states are copied and recomputed; hybrid ones crop their KV beside (layer_kinds.py)
        self.linear_layers = [i for i, k in enumerate(self.support.layer_kinds) if k in RECURRENT]
        self.hybrid_layers = [i for i, k in enumerate(self.support.layer_kinds) if k == "mamba2+attention"]
        self._context_layer_ids: list[int] = []
        # "recompute" takes short blocks' linear states from their records (no re-run): on CPU it beat
        # "deferred" (re-feeding the accepted tokens) from 2 accepted tokens on (benchmarks/rollback.py)
        self.rollback_mode = "recompute"
        self._captured: dict[int, torch.Tensor] = {}
        self._capture_cache: TargetCache | None = None
        for i, layer in enumerate(self.layers):
            layer.register_forward_hook(self._layer_output_hook(i))
        # Gated DeltaNet's `linear_attn` or Mamba-2's `mixer`
        self.linear_mixers = {i: recurrent_mixer(self.layers[i], i) for i in self.linear_layers}
        for i, mixer in self.linear_mixers.items():
            mixer.register_forward_pre_hook(self._linear_input_hook(i), with_kwargs=True)
        if self.linear_layers:
            _route_linear_attention_by_device(sys.modules[type(self.linear_mixers[self.linear_layers[0]]).__module__])
        if self.linear_backend == "torch":  # without fla kernels, short blocks take the direct solve
            for mixer in self.linear_mixers.values():
                if not is_mamba(mixer):
                    install_short_block_path(mixer)

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def load(
        cls, name_or_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> TargetModel:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars would bury flashdraft's own output
        path = resolve_target_path(name_or_path)
        quantisation = None
        try:
            config = AutoConfig.from_pretrained(path, **HF_LOCAL)
            read_support(config, str(path))  # before the weights load
            quantisation = quantisation_config_of(config)
            tokenizer = AutoTokenizer.from_pretrained(path, **HF_LOCAL)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **HF_LOCAL).to(device)
        except (OSError, ValueError, KeyError) as e:
            if quantisation is not None:
                raise quantised_load_error(path, quantisation, e) from None
            raise hf_load_error(path, "the target model", e) from None
        except (ImportError, RuntimeError, NotImplementedError, TypeError, AttributeError) as e:
            if quantisation is None:
                raise
            # a scheme whose package or kernels this machine lacks: one line naming it, not transformers' traceback
            raise quantised_load_error(path, quantisation, e) from None
        target = cls(model, tokenizer, path)
        if quantisation is not None:
            target._probe_quantised_forward(quantisation)
        return target

    def _probe_quantised_forward(self, quantisation: dict) -> None:
        """One token through a quantised target: a scheme whose kernels do not run on this device (vLLM's and
        transformers' fp32 CPU paths lack some) fails here in one line rather than in the middle of a command."""
        try:
            with torch.no_grad():
                out = self.decoder(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device))
                self.lm_head(out.last_hidden_state)
        except Exception as e:  # any kernel failure: reported with the scheme named
            raise quantised_load_error(self.path, quantisation, e) from None

    @functools.cached_property
    def quantisation(self) -> Quantisation:
        """The target's quantisation (scheme, quantised layers, LM head dtype), read from its config and files."""
        return quantisation_of(self.model.config, self.path, self.model)

    # -- facts -----------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def context_length(self) -> int | None:
        """Positions the target was built for (max_position_embeddings); None if it does not say."""
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def linear_backend(self) -> str:
        """Which linear-layer implementation runs: Gated DeltaNet's fla kernels (GPU) or torch fallback; Mamba-2's
        mamba-ssm kernels or torch path (`flashdraft.target.mamba`)."""
        if not self.is_hybrid:
            return "none"
        if is_mamba(self.linear_mixers[self.linear_layers[0]]):
            return mamba_backend(self.device.type)
        return "fla" if find_spec("fla") is not None and self.device.type == "cuda" else "torch"

    @property
    def stop_token_ids(self) -> list[int]:
        return stop_token_ids_of(self.model.generation_config, self.config, self.tokenizer)

    def fingerprint(self) -> str:
        """A cheap hash of config, tokenizer and weights (a strided sample of every tensor);
        `flashdraft.target.weights.TargetHead` computes the same value from the files alone."""
        samples = ((name, strided_sample(t)) for name, t in sorted(self.model.state_dict().items()))
        return fingerprint_of(self.config, self.tokenizer, samples, identity_of(self.model.config))

    # -- frozen pieces borrowed by the drafter ----------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits: its LM head, then the scaling or capping its causal LM applies."""
        return self._logit_transform(self.lm_head(hidden))

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.model.get_output_embeddings().weight

    def final_norm_weight(self) -> torch.Tensor | None:
        """The multiplier of the target's final norm (fp32, [hidden]); None if it has none."""
        norm = final_norm_of(self.decoder)
        weight = getattr(norm, "weight", None)
        return None if weight is None else norm_multiplier(type(norm).__name__, weight)

    # -- context features ----------------------------------------------------------------

    def set_context_layers(self, layer_ids: list[int]) -> None:
        check_layer_ids(layer_ids, self.num_layers)
        self._context_layer_ids = list(layer_ids)

    def _layer_output_hook(self, index: int):
        def hook(module, args, output):
            if index in self._context_layer_ids:
                self._captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def _linear_input_hook(self, index: int):
        def hook(module, args, kwargs):
            module.last_block = None  # set again by a short-block forward
            if self._capture_cache is not None:
                x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                self._capture_cache.linear_inputs[index] = x

        return hook

    # -- forward, cache, rollback --------------------------------------------------------

    def new_cache(self) -> TargetCache:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicSlidingWindowLayer

        kv = DynamicCache(config=self.config)
        for layer in getattr(kv, "layers", []):
            # a sliding-window layer keeps only its window: past it, a rejected block could not be cropped back. Told
            # to record, it keeps every state until the next crop (`_crop`), which cuts the block and the excess
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()
        return TargetCache(kv=kv)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: TargetCache | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
    ) -> TargetOutput:
        """Run the target on input_ids [N, T] after the cache's tokens, appending to the cache.

        Returns logits [N, T, V] and the context features [N, T, n * H] of the set layers. `position_ids` [N, T] and
        a prepared `attention_mask` (additive, per layer kind or one): a draft tree's depths and ancestor-only mask
        (`flashdraft.decoding.tree`); None: the next positions, causal.
        """
        num_pending = 0
        if cache is not None and cache.pending is not None:  # deferred rollback: re-feed accepted tokens first
            num_pending = cache.pending.shape[1]
            input_ids = torch.cat([cache.pending, input_ids], dim=1)
            cache.pending = None
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        if cache is not None:
            positions = positions + cache.length
            self._snapshot_linear_states(cache)
        if position_ids is not None:
            positions = position_ids
        self._captured = {}
        self._capture_cache = cache
        try:
            out = self.decoder(  # the LM head runs when logits are read (TargetOutput)
                input_ids=input_ids,
                position_ids=positions.expand(input_ids.shape[0], -1),
                attention_mask=attention_mask,
                past_key_values=cache.kv if cache is not None else None,
                use_cache=cache is not None,
            )
        finally:
            self._capture_cache = None
        if cache is not None:
            cache.length += input_ids.shape[1]
            cache.last_forward_tokens = input_ids.shape[1] - num_pending
            cache.last_pending, cache.last_input_ids = num_pending, input_ids
            blocks = {i: getattr(mixer, "last_block", None) for i, mixer in self.linear_mixers.items()}
            cache.linear_blocks = {i: b for i, b in blocks.items() if b is not None}
        features = None
        if self._context_layer_ids:
            features = torch.cat([self._captured[i] for i in self._context_layer_ids], dim=-1)[:, num_pending:]
        self._captured = {}
        return TargetOutput(out.last_hidden_state[:, num_pending:], features, self.target_logits)

    def _snapshot_linear_states(self, cache: TargetCache) -> None:
        cache.linear_snapshot = {}
        cache.linear_inputs = {}
        layers = getattr(cache.kv, "layers", [])
        for i in self.linear_layers:
            if i < len(layers) and layers[i].has_previous_state.get(0):
                layer = layers[i]
                cache.linear_snapshot[i] = (layer.conv_states[0].clone(), layer.recurrent_states[0].clone())

    @torch.no_grad()
    def rollback(self, cache: TargetCache, keep: int) -> None:
        """Keep only the first `keep` tokens of the last forward in the cache (exactly).

        Attention layers crop their KV. Linear-attention states go back to their copy from
        before the forward and then, by `rollback_mode`: "recompute" re-runs only the linear
        layers' token mixers over the kept tokens now; "deferred" crops everything back and
        re-feeds the kept tokens at the front of the next forward (one call instead of two,
        which is cheaper where per-call overhead dominates, as on CPU); a forward that began
        with re-fed tokens is rolled back the "recompute" way, so re-fed tokens never pile up.
        """
        from transformers.cache_utils import DynamicLayer

        drop = cache.last_forward_tokens - keep
        if drop < 0 or keep < 0:
            raise ValueError(f"rollback keep={keep} outside the last forward's {cache.last_forward_tokens} tokens")
        if drop == 0:
            for layer in getattr(cache.kv, "layers", []):
                _crop(layer, 0)  # sliding-window layers back to their window
            return
        if self.linear_layers and len(cache.linear_snapshot) != len(self.linear_layers):
            raise RuntimeError("rollback of linear-attention states needs a cached forward before this one")
        # Deferring twice in a row would re-feed the tokens deferred last time again, and so on
        # until a block is accepted whole: the re-fed prefix, and each verification, would grow
        # with every partially accepted step. So a forward that re-fed deferred tokens is rolled
        # back by recomputing, which commits them for good.
        if self.linear_layers and self.rollback_mode == "deferred" and cache.last_pending == 0:
            total = cache.last_forward_tokens
            for i, layer in enumerate(cache.kv.layers):
                if i in self.linear_layers:
                    conv, recurrent = cache.linear_snapshot[i]
                    layer.conv_states[0].copy_(conv)
                    layer.recurrent_states[0].copy_(recurrent)
                    if i in self.hybrid_layers:
                        DynamicLayer.crop(layer, -total)
                else:
                    _crop(layer, total)
            cache.pending = cache.last_input_ids[:, :keep]
            cache.length -= total
            cache.last_forward_tokens = 0
            cache.linear_inputs, cache.linear_blocks = {}, {}
            return
        for i, layer in enumerate(cache.kv.layers):
            if i not in self.linear_layers:
                _crop(layer, drop)
            elif i in self.hybrid_layers:  # the attention beside a Mamba-2 mixer: its KV alone cropped here
                DynamicLayer.crop(layer, -drop)
        if self.linear_layers:
            kept = cache.last_pending + keep  # re-fed deferred tokens come first in the captured inputs
            for i in self.linear_layers:
                layer, record = cache.kv.layers[i], cache.linear_blocks.get(i)
                conv, recurrent = cache.linear_snapshot[i]  # the states before the forward
                if kept > 0 and record is not None:  # a short-block forward: its record gives the prefix's states
                    conv, recurrent = state_after(record, recurrent, kept)
                layer.conv_states[0].copy_(conv)
                layer.recurrent_states[0].copy_(recurrent)
                if kept > 0 and record is None:
                    # re-run only this layer's token mixer over the accepted prefix
                    self.linear_mixers[i](hidden_states=cache.linear_inputs[i][:, :kept], cache_params=cache.kv)
        cache.length -= drop
        cache.last_forward_tokens, cache.last_pending = keep, 0
        cache.linear_inputs, cache.linear_blocks = {}, {}
