"""`flashdraft parity`: do the linear-attention backends compute what they should, in every dtype?

Hybrid targets (Qwen3.5/3.6: Gated DeltaNet + gated full attention) run their linear
layers through fla kernels on GPU or a torch fallback, chunked or recurrent; drafters are
trained on features from one and served with another (failure mode 5 of the reference
doc). This runs the target over real prompts once per available backend and dtype and compares each linear
layer's output with an fp32 reference (the torch chunked path, TF32 off) run on the very inputs that layer
received. Two bf16 computations differ from each other by bf16's rounding whatever the kernel, so a backend is
judged against the error the reference path itself makes in that dtype (its noise floor), per layer: it passes
where its error is at most `NOISE_FACTOR` times the floor plus `ERROR_FLOOR` (docs/gpu.md).

A backend is forced by replacing the two module-level functions the GatedDeltaNet forward
calls (`torch_chunk_gated_delta_rule` for prompts, `torch_recurrent_gated_delta_rule` for
single-token steps) for the duration of a forward. Mamba-2 targets (Nemotron-H) compare mamba-ssm's
kernels where they run, transformers' chunked torch scan, and its recurrence one token at a time
(`flashdraft.target.mamba`).
"""

from __future__ import annotations

import contextlib
import copy
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
    # the recurrent backend runs cached blocks through its own function too, not flashdraft's short-block solve
    short_block = {i: getattr(m, "short_block_path", True) for i, m in target.linear_mixers.items()}
    for mixer in target.linear_mixers.values():
        mixer.short_block_path = backend != "torch_recurrent"
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
        for i, mixer in target.linear_mixers.items():
            mixer.short_block_path = short_block[i]


NOISE_FACTOR = 2.0  # a backend may be this many times as far from the fp32 reference as the reference path in its dtype
ERROR_FLOOR = 3e-3  # plus this much relative error in any dtype: fp32 rounding, TF32 inside fla's fp32 kernels
CONTINUATION = 16  # tokens a continuation case feeds after a cached prefill: one verification block
CASES = ("prompt", "continuation")


@dataclass
class ParityResult:
    """Each backend's relative L2 error against the fp32 reference, per case, dtype and linear layer, beside the
    reference path's own error in that dtype (its noise floor): a backend passes where
    error <= noise_factor x floor + error_floor."""

    reference: str | None
    layer_ids: list[int]  # the linear-attention layers compared
    dtypes: list[str] = field(default_factory=list)
    errors: dict = field(default_factory=dict)  # case -> dtype -> backend -> [per layer]
    floors: dict = field(default_factory=dict)  # case -> dtype -> [per layer]: the reference path's own error
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why it could not run
    noise_factor: float = NOISE_FACTOR
    error_floor: float = ERROR_FLOOR

    def allowed(self, case: str, dtype: str, j: int) -> float:
        return self.noise_factor * self.floors[case][dtype][j] + self.error_floor

    def failures(self) -> list[tuple[str, str, str, int]]:
        """(case, dtype, backend, layer) of every error over its allowance."""
        return [
            (case, dtype, backend, layer)
            for case, by_dtype in self.errors.items()
            for dtype, by_backend in by_dtype.items()
            for backend, errors in by_backend.items()
            for j, (layer, error) in enumerate(zip(self.layer_ids, errors, strict=True))
            if not error <= self.allowed(case, dtype, j)
        ]

    @property
    def passed(self) -> bool:
        return not self.failures()


@contextmanager
def _exact_fp32() -> Iterator[None]:
    """fp32 matmuls in full precision (no TF32) inside the block: the reference's arithmetic."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


@contextmanager
def _mixer_io(target: TargetModel, layer_ids: list[int]) -> Iterator[dict[int, list]]:
    """Each listed linear layer's token mixer's (input, output) pairs [1, T, H], call by call, inside the block."""
    calls: dict[int, list] = {i: [] for i in layer_ids}

    def hook(i):
        def record(module, args, kwargs, output):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            calls[i].append((x.detach(), (output[0] if isinstance(output, tuple) else output).detach()))

        return record

    handles = [target.linear_mixers[i].register_forward_hook(hook(i), with_kwargs=True) for i in layer_ids]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _run(target: TargetModel, ids: torch.Tensor, case: str, token_by_token: bool) -> None:
    """The target over ids [1, T]: the whole prompt at once, or (continuation) all but the last CONTINUATION tokens
    into a cache, then those; a recurrent backend without a prompt path (Mamba-2) one token at a time."""
    if token_by_token:
        cache = target.new_cache()
        for i in range(ids.shape[1]):
            target.forward(ids[:, i : i + 1], cache)
    elif case == "prompt":
        target.forward(ids)
    else:
        cache = target.new_cache()
        target.forward(ids[:, :-CONTINUATION], cache)
        target.forward(ids[:, -CONTINUATION:], cache)


def _layer_errors(
    target: TargetModel, calls: dict[int, list], reference_mixers: dict, compared: int | None, reference: str
) -> list[float]:
    """Per layer: relative L2 error of the mixer outputs of the last `compared` tokens (None: all) of each run
    against the fp32 reference mixer on the same inputs (one run's inputs, concatenated, through it at once, no
    cache)."""
    errors = []
    for i, pairs in calls.items():
        diff = norm = 0.0
        for run in pairs:  # one prompt's calls
            x = torch.cat([x for x, _ in run], dim=1).float()
            first = -compared if compared else 0
            out = torch.cat([o for _, o in run], dim=1)[:, first:].float()
            mixer = reference_mixers[i]
            with force_backend(target, reference), _exact_fp32():
                expected = type(mixer).forward(mixer, hidden_states=x)[:, first:]
            diff += float((out - expected).norm() ** 2)
            norm += float(expected.norm() ** 2)
        errors.append((diff / max(norm, 1e-30)) ** 0.5)
    return errors


def _linear_layers_for(target: TargetModel, layer_ids: list[int] | None) -> list[int]:
    """The linear layers whose kernels can change the listed layers' outputs: every one up to the deepest."""
    deepest = target.num_layers - 1 if not layer_ids else max(layer_ids)
    return [i for i in target.linear_layers if i <= deepest]


@torch.no_grad()
def run_parity(
    target: TargetModel,
    prompts: list[list[int]],
    layer_ids: list[int] | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    noise_factor: float = NOISE_FACTOR,
    error_floor: float = ERROR_FLOOR,
) -> ParityResult:
    """Every available backend, in each of `dtypes` (None: the target's own), against the fp32 reference: the
    torch chunked path with TF32 off, run per linear layer on the very inputs the backend's layer received (so an
    earlier layer's rounding is not charged to a later one), with the layer's weights as the dtype holds them.
    Two cases: whole prompts, and the last CONTINUATION tokens of each prompt fed after a cached prefill (the path
    a verification takes). The reference path itself run in each dtype gives that dtype's noise floor per layer.
    Prompts shorter than CONTINUATION + 1 tokens take part in the prompt case only (none longer: no continuation
    case). The target ends in the dtype it started in."""
    linear = _linear_layers_for(target, layer_ids)
    if not target.is_hybrid or not linear:
        return ParityResult(None, linear, noise_factor=noise_factor, error_floor=error_floor)
    runnable = [b for b in backends_of(target) if unavailable_reason(target, b) is None]
    reference = "torch_chunk"
    result = ParityResult(reference, linear, noise_factor=noise_factor, error_floor=error_floor)
    result.skipped = {b: unavailable_reason(target, b) for b in backends_of(target) if b not in runnable}
    start_dtype = target.dtype
    try:
        for dtype in dtypes or (start_dtype,):
            target.model.to(dtype)
            name = str(dtype).removeprefix("torch.")
            result.dtypes.append(name)
            # the reference arithmetic on the weights as this dtype holds them
            reference_mixers = {i: copy.deepcopy(target.linear_mixers[i]).float() for i in linear}
            for case in CASES:
                ids = [p for p in prompts if case == "prompt" or len(p) > CONTINUATION]
                if not ids:  # no prompt continues past a prefill: the case is left out, and said so
                    continue
                errors = {}
                for backend in [reference] + [b for b in runnable if b != reference]:
                    token_by_token = _has_mamba(target) and backend == "torch_recurrent"
                    with force_backend(target, backend), _mixer_io(target, linear) as calls:
                        runs = {i: [] for i in linear}
                        for p in ids:
                            for i in linear:
                                calls[i].clear()
                            _run(target, torch.tensor([p], device=target.device), case, token_by_token)
                            for i in linear:
                                runs[i].append(list(calls[i]))
                    compared = CONTINUATION if case == "continuation" else None
                    errors[backend] = _layer_errors(target, runs, reference_mixers, compared, reference)
                result.floors.setdefault(case, {})[name] = errors.pop(reference)
                result.errors.setdefault(case, {})[name] = errors
            del reference_mixers
    finally:
        target.model.to(start_dtype)
    return result


def print_parity(result: ParityResult, num_prompts: int, num_tokens: int) -> None:
    if result.reference is None:
        print("the target has no linear-attention layers: nothing to compare")
        return
    print(
        f"{num_prompts} prompts, {num_tokens} tokens; reference: {result.reference} in float32 (TF32 off), each "
        f"linear layer on the inputs the backend gave it"
    )
    print(
        f"rule: relative error <= {result.noise_factor:g} x the reference path's own error in that dtype "
        f"+ {result.error_floor:g}"
    )
    for backend, reason in result.skipped.items():
        print(f"not compared: {backend} ({reason})")
    backends = sorted({b for by_dtype in result.errors.values() for by in by_dtype.values() for b in by})
    if not backends:
        print("only one backend runs here: no comparison possible")
        return
    if "continuation" not in result.errors:
        print(f"not compared: continuation (no prompt longer than {CONTINUATION + 1} tokens)")
    failed = set(result.failures())
    print(f"{'case':<13} {'dtype':<9} {'layer':>5}  {'floor':>9}  " + "  ".join(f"{b:>17}" for b in backends))
    for case, by_dtype in result.errors.items():
        for dtype, by_backend in by_dtype.items():
            for j, layer in enumerate(result.layer_ids):
                cells = [
                    f"{by_backend[b][j]:9.2e}{' <' if (case, dtype, b, layer) in failed else '  '}".rjust(17)
                    for b in backends
                ]
                floor = result.floors[case][dtype][j]
                print(f"{case:<13} {dtype:<9} {layer:>5}  {floor:9.2e}  " + "  ".join(cells))
    if failed:
        print(f"FAIL: {len(failed)} errors over their allowance (marked <)")
    else:
        print("PASS: every backend within its allowance in every dtype")
