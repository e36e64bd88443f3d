"""Mamba-2 layers of Nemotron-H hybrids (Nemotron-3), and how `TargetModel` finds any recurrent token mixer.

A Nemotron-H block holds one mixer (`block.mixer`): Mamba-2, attention, an MLP or a MoE; `layer_types` (the
config's `layers_block_type`) calls the Mamba-2 blocks `linear_attention`. A Mamba-2 mixer keeps, as Gated
DeltaNet does, a convolution state (the last `conv_kernel` inputs of x, B and C) and a recurrent (SSM) state
[B, heads, head_dim, state] in transformers' `LinearAttentionLayer`: neither can be cut back. Rollback is the
exact way of section 6 of the reference doc: the states are copied before each forward, the mixer's inputs
are captured during it, and after partial acceptance the copy is restored and only the Mamba mixers re-run
over the accepted prefix (`TargetModel.rollback`, the path Gated DeltaNet takes without a short-block record).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec

from torch import nn

from flashdraft.errors import FlashdraftError


def recurrent_mixer(layer: nn.Module, index: int) -> nn.Module:
    """The token mixer of a `linear_attention` layer: Qwen3.5's and Qwen3-Next's `linear_attn` (Gated
    DeltaNet), Nemotron-H's `mixer` (Mamba-2), Falcon-H1's and Bamba's `mamba` (Mamba-2)."""
    mixer = getattr(layer, "linear_attn", None) or getattr(layer, "mixer", None) or getattr(layer, "mamba", None)
    if mixer is None:
        raise FlashdraftError(
            f"target layer {index} ({type(layer).__name__}): a linear_attention layer with neither `linear_attn` "
            f"(Gated DeltaNet) nor `mixer` (Mamba-2); flashdraft cannot roll its states back"
        )
    return mixer


def is_mamba(mixer: nn.Module) -> bool:
    """A Mamba-2 mixer (Nemotron-H's, Falcon-H1's, Bamba's): grouped B/C (`n_groups`) over an SSM state."""
    return all(hasattr(mixer, name) for name in ("n_groups", "ssm_state_size", "conv1d"))


def mamba_backend(device_type: str) -> str:
    """Which Mamba-2 implementation transformers runs: the mamba-ssm kernels where installed on CUDA, else
    its torch path (chunked scan for prompts and blocks, the recurrence for single tokens)."""
    return "mamba_ssm" if device_type == "cuda" and find_spec("mamba_ssm") is not None else "torch"


# -- parity: the Mamba-2 backends (`flashdraft parity`) ---------------------------------------------------------

MAMBA_BACKENDS = ("mamba_ssm", "torch_chunk", "torch_recurrent")
# the module-level functions a Mamba-2 mixer calls; each may be bound to a mamba-ssm / causal-conv1d kernel
MAMBA_FUNCTIONS = (
    "mamba2_chunk_scan",
    "mamba2_selective_state_update",
    "mamba2_split_conv1d_scan_combined",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def mamba_unavailable_reason(device_type: str, backend: str) -> str | None:
    """Why a Mamba-2 `backend` cannot run here, or None. transformers binds no fla kernel to Mamba-2: on GPU they are
    mamba-ssm's (with causal-conv1d's), which transformers binds when they are installed."""
    if backend == "mamba_ssm":
        if find_spec("mamba_ssm") is None:
            return "mamba-ssm is not installed (transformers runs Mamba-2 on its kernels, not fla's)"
        if device_type != "cuda":
            return f"mamba-ssm needs a CUDA device (the target is on {device_type})"
    return None


@contextmanager
def torch_mamba_path(modeling_module) -> Iterator[None]:
    """Inside the block, the Mamba-2 mixers of `modeling_module` run transformers' torch functions, whatever
    kernels are installed (`inspect.unwrap` reaches the torch function behind a kernel wrapper)."""
    saved = {name: getattr(modeling_module, name) for name in MAMBA_FUNCTIONS if hasattr(modeling_module, name)}
    for name, fn in saved.items():
        setattr(modeling_module, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(modeling_module, name, fn)
