"""`flashdraft parity`: do the linear-attention backends give the same hidden states?

Hybrid targets (Qwen3.5/3.6: Gated DeltaNet + gated full attention) run their linear
layers through fla kernels on GPU or a torch fallback, chunked or recurrent; drafters are
trained on features from one and served with another (failure mode 5 of the reference
doc). This runs the target over real prompts once per available backend and compares
every requested layer's output token by token (cosine similarity), against the backend
that serves by default (fla where it runs, else torch chunked).

A backend is forced by replacing the two module-level functions the GatedDeltaNet forward
calls (`torch_chunk_gated_delta_rule` for prompts, `torch_recurrent_gated_delta_rule` for
single-token steps) for the duration of a forward. Mamba-2 targets (Nemotron-H) compare mamba-ssm's
kernels where they run, transformers' chunked torch scan, and its recurrence one token at a time
(`flashdraft.target.mamba`).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.util import find_spec

import torch

from flashdraft.errors import FlashdraftError
from flashdraft.target.mamba import (
    MAMBA_BACKENDS,
    features_token_by_token,
    is_mamba,
    mamba_unavailable_reason,
    torch_mamba_path,
)
from flashdraft.target.model import TargetModel

BACKENDS = ("fla", "torch_chunk", "torch_recurrent")
CHUNK, RECURRENT = "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"


def _has_mamba(target: TargetModel) -> bool:
    return is_mamba(target.linear_mixers[target.linear_layers[0]])


def backends_of(target: TargetModel) -> tuple[str, ...]:
    """The backends of the target's linear layers: Gated DeltaNet's, or Mamba-2's (Nemotron-H)."""
    return MAMBA_BACKENDS if _has_mamba(target) else BACKENDS


def unavailable_reason(target: TargetModel, backend: str) -> str | None:
    """Why `backend` cannot run for this target here, or None if it can."""
    if backend == "mamba_ssm":
        return mamba_unavailable_reason(target.device.type, backend)
    if backend == "fla":
        if find_spec("fla") is None:
            return "fla is not installed"
        if target.device.type != "cuda":
            return f"fla needs a CUDA device (the target is on {target.device.type})"
    return None


def _mixer_module(target: TargetModel):
    """The modeling module whose functions the target's linear layers (Gated DeltaNet, Mamba-2) call."""
    return sys.modules[type(target.linear_mixers[target.linear_layers[0]]).__module__]


def _accepting(fn):
    """Call fn with only the keyword arguments it declares (as transformers' own wrapper does)."""
    params = {name for name, p in inspect.signature(fn).parameters.items() if p.kind is not p.VAR_KEYWORD}

    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


@contextmanager
def force_backend(target: TargetModel, backend: str) -> Iterator[None]:
    """Run the target's linear-attention layers with `backend` inside the block."""
    if backend not in backends_of(target):
        raise FlashdraftError(f"backend {backend!r}: expected one of {', '.join(backends_of(target))}")
    reason = unavailable_reason(target, backend)
    if reason:
        raise FlashdraftError(f"backend {backend}: {reason}")
    module = _mixer_module(target)
    if _has_mamba(target):  # mamba-ssm: the kernels transformers bound; torch: its functions (recurrent: per token)
        with torch_mamba_path(module) if backend != "mamba_ssm" else contextlib.nullcontext():
            yield
        return
    saved = {name: getattr(module, name) for name in (CHUNK, RECURRENT)}
    # the module-level names may be wrapped (fla or a hub kernel behind a torch fallback);
    # unwrapping reaches the plain torch function
    torch_chunk, torch_recurrent = inspect.unwrap(saved[CHUNK]), inspect.unwrap(saved[RECURRENT])
    if backend == "torch_chunk":
        chunk, recurrent = torch_chunk, torch_recurrent
    elif backend == "torch_recurrent":
        chunk, recurrent = torch_recurrent, torch_recurrent  # prompts too, one token at a time
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        chunk, recurrent = _accepting(chunk_gated_delta_rule), _accepting(fused_recurrent_gated_delta_rule)
    setattr(module, CHUNK, chunk)
    setattr(module, RECURRENT, recurrent)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


@dataclass
class ParityResult:
    reference: str | None
    layer_ids: list[int]
    min_cosine: dict[str, list[float]] = field(default_factory=dict)  # backend -> per layer, vs reference
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why it could not run
    threshold: float = 0.9999

    @property
    def passed(self) -> bool:
        return all(c >= self.threshold for cosines in self.min_cosine.values() for c in cosines)


def _features(target: TargetModel, ids: torch.Tensor) -> torch.Tensor:  # [N, T, n * H]
    return target.forward(ids).context_features


@torch.no_grad()
def run_parity(
    target: TargetModel, prompts: list[list[int]], layer_ids: list[int] | None = None, threshold: float = 0.9999
) -> ParityResult:
    """Compare every available backend with the default one over `prompts` (token ids),
    layer by layer; min_cosine holds the smallest per-token cosine similarity per layer."""
    layer_ids = list(range(target.num_layers)) if layer_ids is None else list(layer_ids)
    if not target.is_hybrid:
        return ParityResult(None, layer_ids, threshold=threshold)
    runnable = [b for b in backends_of(target) if unavailable_reason(target, b) is None]
    result = ParityResult(runnable[0], layer_ids, threshold=threshold)
    result.skipped = {b: unavailable_reason(target, b) for b in backends_of(target) if b not in runnable}
    # Mamba-2 has no torch function that runs a prompt recurrently: its recurrent backend steps through a cache
    token_by_token = _has_mamba(target)
    target.set_context_layers(layer_ids)
    features: dict[str, list[torch.Tensor]] = {}
    for backend in runnable:
        with force_backend(target, backend):
            run = features_token_by_token if token_by_token and backend == "torch_recurrent" else _features
            features[backend] = [run(target, torch.tensor([ids], device=target.device))[0].float() for ids in prompts]
    h = target.hidden_size
    for backend in runnable[1:]:
        cosines = []
        for j in range(len(layer_ids)):
            block = slice(j * h, (j + 1) * h)
            cosines.append(
                min(
                    float(torch.nn.functional.cosine_similarity(a[:, block], b[:, block], dim=-1).min())
                    for a, b in zip(features[result.reference], features[backend], strict=True)
                )
            )
        result.min_cosine[backend] = cosines
    return result


def print_parity(result: ParityResult, num_prompts: int, num_tokens: int) -> None:
    if result.reference is None:
        print("the target has no linear-attention layers: nothing to compare")
        return
    print(f"{num_prompts} prompts, {num_tokens} tokens; reference backend: {result.reference}")
    for backend, reason in result.skipped.items():
        print(f"not compared: {backend} ({reason})")
    if not result.min_cosine:
        print("only one backend runs here: no comparison possible")
        return
    names = list(result.min_cosine)
    print("layer  " + "  ".join(f"{result.reference} vs {n}".rjust(24) for n in names))
    for j, layer in enumerate(result.layer_ids):
        row = "  ".join(
            f"{result.min_cosine[n][j]:.6f}{' <' if result.min_cosine[n][j] < result.threshold else '  '}".rjust(24)
            for n in names
        )
        print(f"{layer:5d}  {row}")
    worst = min(c for cosines in result.min_cosine.values() for c in cosines)
    verdict = "PASS" if result.passed else "FAIL"
    print(f"{verdict}: minimum cosine {worst:.6f}, threshold {result.threshold}")
