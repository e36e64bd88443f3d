"""Gated DeltaNet (the linear attention of Qwen3.5/3.6 hybrids) for short inputs, in plain torch.

Without the fla kernels, transformers runs a cached forward of T > 1 tokens through its chunked
fallback, which pads the block to a 64-token chunk and solves 64 x 64 systems, and a 1-token
step through a recurrent loop; both also run the causal conv through a depthwise `conv1d`, which
costs ~50 us on a CPU for a few columns. A speculative step verifies a short block (B <= 64
tokens), so here the block is one chunk of exactly T tokens solved directly:

    cum = cumsum(g)                      decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0
    A   = (beta k k^T) * decay           (I + strict_lower(A)) v_new = beta v - (beta k e^cum) S0
    out = (q e^cum) S0 + ((q k^T) * decay) v_new
    S   = S0 e^cum_T + (k e^(cum_T - cum))^T v_new

which is the same algebra as the chunked fallback (one chunk, no padding, the two triangular
solves folded into one), and a 1-token step is the recurrence written with matmuls. Results
equal the fallback's within fp32 rounding. `install_short_block_path` puts this on a model's
Gated DeltaNet layers; longer inputs, padded batches and recorded-past caches keep the
transformers path.

The solve is causal (v_new_j depends only on tokens <= j), so the state after any prefix of the
block is S0 e^cum_t + (k e^(cum_t - cum))[:t]^T v_new[:t]: each short forward keeps a `BlockRecord`
and rollback after partial acceptance takes the state from it (`state_after`) instead of
re-running the layer over the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.target.qwen3_next import qwen3_next_projections

# Longest input the direct solve takes; a longer one (a prefill) keeps transformers' chunked path,
# whose cost grows linearly with length where this one's T x T terms grow quadratically.
SHORT_BLOCK_MAX = 64


@dataclass
class BlockRecord:
    """What a short forward leaves for rollback: with the recurrent state from before the block
    (which the caller keeps), enough to rebuild the layer's states after any prefix of its T
    tokens without running the layer again."""

    key: torch.Tensor  # [B, H, T, dk]
    v_new: torch.Tensor  # [B, H, T, dv] the solved values (causal: a prefix's own)
    cum: torch.Tensor  # [B, H, T] cumulative log decay
    window: torch.Tensor  # [B, C, K + T] conv inputs: the K cached before the block, then the block's


def state_after(record: BlockRecord, initial_state: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv state [B, C, K], recurrent state [B, H, dk, dv]) after the first `kept` (>= 1) tokens
    of the block that started from `initial_state` [B, H, dk, dv]."""
    kernel = record.window.shape[-1] - record.key.shape[2]
    last = record.cum[..., kept - 1 : kept]  # [B, H, 1]
    decayed_key = record.key[:, :, :kept] * (last - record.cum[..., :kept]).exp()[..., None]
    state = initial_state.float() * last.exp()[..., None] + decayed_key.transpose(-1, -2) @ record.v_new[:, :, :kept]
    return record.window[..., kept : kept + kernel], state


def gated_delta_rule_block(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens as one chunk, from `state`.

    query, key: [B, H, T, dk] (L2-normalized; query also scaled by dk^-0.5); value: [B, H, T, dv];
    g (log decay, <= 0), beta: [B, H, T]; state: [B, H, dk, dv]. Returns out [B, H, T, dv], the
    state after the last token [B, H, dk, dv], and for `BlockRecord` v_new [B, H, T, dv] and cum [B, H, T].
    """
    if query.shape[2] == 1:  # one token: the recurrence itself is fewer ops than the chunk algebra
        decayed = state * g.exp()[..., None]  # [B, H, dk, dv]
        delta = (value - key @ decayed) * beta[..., None]  # [B, H, 1, dv]: v_new of the chunk algebra
        decayed = decayed + key.transpose(-1, -2) @ delta
        return query @ decayed, decayed, delta, g
    cum = g.cumsum(-1)  # [B, H, T]
    # decay[i, j] = exp(cum_i - cum_j) below and on the diagonal; exp overflows above it, and tril zeroes that
    decay = (cum[..., :, None] - cum[..., None, :]).exp().tril()  # [B, H, T, T]
    key_beta = key * beta[..., None]
    exp_cum = cum.exp()[..., None]  # [B, H, T, 1]
    system = (key_beta @ key.transpose(-1, -2)) * decay  # its strict lower part; the solve takes the diagonal as 1
    rhs = value * beta[..., None] - (key_beta * exp_cum) @ state  # [B, H, T, dv]
    v_new = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (query * exp_cum) @ state + ((query @ key.transpose(-1, -2)) * decay) @ v_new
    last = cum[..., -1:]  # [B, H, 1]
    decayed_key = key * (last - cum).exp()[..., None]  # each key decayed to the block's end
    state = state * last.exp()[..., None] + decayed_key.transpose(-1, -2) @ v_new
    return out, state, v_new, cum


def causal_conv_window(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of the last T columns: window [B, C, T + K - 1] (K - 1 columns of
    left context first), weight [C, K]. Returns [B, C, T]; as transformers' conv1d, without its
    fixed cost (a windowed matmul is ~5x cheaper than conv1d for a few columns on a CPU)."""
    kernel = weight.shape[-1]
    return (window.unfold(-1, kernel, 1) @ weight[:, :, None]).squeeze(-1)  # [B, C, T, K] @ [C, K, 1]


def gated_delta_net_projections(layer: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed qkv [B, T, 2 * key_dim + value_dim] (query, key, value: the conv's channel order), z [B, T, ..],
    b and a [B, T, Hv]) of a Gated DeltaNet layer: Qwen3.5's separate projections or Qwen3-Next's fused ones."""
    if hasattr(layer, "in_proj_qkvz"):
        return qwen3_next_projections(layer, hidden_states)
    return (
        layer.in_proj_qkv(hidden_states),
        layer.in_proj_z(hidden_states),
        layer.in_proj_b(hidden_states),
        layer.in_proj_a(hidden_states),
    )


def short_block_forward(layer: nn.Module, hidden_states: torch.Tensor, cache_params) -> torch.Tensor:
    """Qwen3_5GatedDeltaNet.forward (and Qwen3NextGatedDeltaNet's) for a short input with a cache (no padding mask):
    hidden_states [B, T, hidden] -> [B, T, hidden], updating the layer's conv and recurrent states.
    Leaves `layer.last_block` (a `BlockRecord`) when the cache held states before the block."""
    batch, seq_len, _ = hidden_states.shape
    idx, kernel = layer.layer_idx, layer.conv_kernel_size
    recurrent_state = cache_params.get_recurrent_state(idx)  # None before the first forward

    mixed_qkv, z, b, a = gated_delta_net_projections(layer, hidden_states)
    mixed_qkv = mixed_qkv.transpose(1, 2)  # [B, C, T]

    # the cache keeps the last K inputs and hands back [state | new] (only new before the first forward)
    window = cache_params.update_conv_state(mixed_qkv, idx, conv_kernel_size=kernel)
    continues = recurrent_state is not None and window.shape[-1] == seq_len + kernel  # [K cached | T new]
    if window.shape[-1] < seq_len + kernel - 1:
        window = F.pad(window, (seq_len + kernel - 1 - window.shape[-1], 0))
    mixed_qkv = causal_conv_window(window[..., -(seq_len + kernel - 1) :], layer.conv1d.weight[:, 0])
    query, key, value, g, beta = _heads(layer, mixed_qkv, b, a)
    if recurrent_state is None:
        recurrent_state = value.new_zeros(batch, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    out, state, v_new, cum = gated_delta_rule_block(query, key, value, g, beta, recurrent_state.float())
    cache_params.update_recurrent_state(state, idx)
    layer.last_block = BlockRecord(key, v_new, cum, window) if continues else None
    return _output(layer, out, z, hidden_states)


def _heads(layer: nn.Module, conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(query, key [B, Hv, T, dk], value [B, Hv, T, dv], g, beta [B, Hv, T]) from the conv's output [B, C, T] (before
    its bias and SiLU) and the b and a projections [B, T, Hv], in fp32 as transformers' fallback computes them."""
    if layer.conv1d.bias is not None:
        conv_out = conv_out + layer.conv1d.bias[:, None]
    mixed_qkv = F.silu(conv_out).transpose(1, 2)  # [B, T, C]
    batch, seq_len, _ = mixed_qkv.shape
    # query and key sit side by side: one L2 norm (in fp32, as the fallback) over both
    qk = mixed_qkv[..., : 2 * layer.key_dim].reshape(batch, seq_len, 2 * layer.num_k_heads, layer.head_k_dim)
    qk = qk.float()
    qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)
    query, key = qk[:, :, : layer.num_k_heads], qk[:, :, layer.num_k_heads :]  # [B, T, Hk, dk]
    query = query * layer.head_k_dim**-0.5
    value = mixed_qkv[..., 2 * layer.key_dim :].reshape(batch, seq_len, layer.num_v_heads, layer.head_v_dim).float()
    if layer.num_v_heads != layer.num_k_heads:  # each key head serves consecutive value heads
        query = query.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
        key = key.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
    beta = b.sigmoid().float().transpose(1, 2)  # [B, Hv, T]
    g = (-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)).transpose(1, 2)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), g, beta


def _output(layer: nn.Module, out: torch.Tensor, z: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """The layer's output [B, T, hidden] of the rule's out [B, Hv, T, dv]: the gated norm with z, then out_proj."""
    batch, seq_len, _ = hidden_states.shape
    out = out.transpose(1, 2).to(hidden_states.dtype).reshape(-1, layer.head_v_dim)  # [B * T * Hv, dv]
    out = layer.norm(out, z.reshape(-1, layer.head_v_dim)).reshape(batch, seq_len, -1)
    return layer.out_proj(out)


@dataclass(frozen=True)
class TreeNodes:
    """A draft tree's nodes on the device, for `tree_block_forward`: parents and depths [T] (int64; parents[0] = -1,
    the root, after the cached tokens), and the deepest node's depth (known on the host)."""

    parents: torch.Tensor
    depths: torch.Tensor
    max_depth: int


def tree_block_forward(layer: nn.Module, hidden_states: torch.Tensor, cache_params, tree: TreeNodes) -> torch.Tensor:
    """The layer over a draft tree's nodes (`flashdraft.decoding.tree`): hidden_states [B, T, hidden] of the `tree`'s
    nodes. Each node's conv reads its own root path (then the cached inputs) and its recurrent state is its parent's
    advanced by its token (the 1-token recurrence), so every node's output is the one its path alone would give.
    Indices are built on the device from `tree` (no copy from the host). Leaves the last node's states in the cache
    (right when the tree is a chain accepted whole; otherwise rollback restores its copy and re-runs the accepted
    path)."""
    batch, seq_len, _ = hidden_states.shape
    idx, kernel = layer.layer_idx, layer.conv_kernel_size
    state0 = cache_params.get_recurrent_state(idx)
    mixed_qkv, z, b, a = gated_delta_net_projections(layer, hidden_states)
    window = cache_params.update_conv_state(mixed_qkv.transpose(1, 2), idx, conv_kernel_size=kernel)  # [B, C, K + T]
    if state0 is None or window.shape[-1] != seq_len + kernel:
        raise RuntimeError("a tree forward needs the layer's states from a cached forward before it")
    out, states = tree_recurrence(layer, window, b, a, state0, tree)
    cache_params.update_recurrent_state(states[:, :, -1], idx)
    layer.last_block = None
    return _output(layer, out, z, hidden_states)


def tree_recurrence(
    layer: nn.Module, window: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state0: torch.Tensor, tree: TreeNodes
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's rule over a tree's T nodes, each along its own root path: (out [B, Hv, T, dv], the
    state after each node [B, Hv, T, dk, dv]) from the conv inputs `window` [B, C, K + T] (the K before the tree,
    then the nodes'), the b and a projections [B, T, Hv] and the state before the tree `state0` [B, Hv, dk, dv]. A
    node's conv reads its own root path, then the inputs before the tree; its state is its parent's advanced by its
    token (the 1-token recurrence). `tree.max_depth` bounds the loops: a larger bound gives the same result."""
    kernel, seq_len = layer.conv_kernel_size, window.shape[-1] - layer.conv_kernel_size
    parent, depths = tree.parents.clamp(min=0), tree.depths  # [T]: the root its own parent (never followed)
    # per node the window columns of its last K inputs: s steps back from the end, its s-th ancestor while the path
    # lasts (K + node), then the cached inputs before the tree (K + depth - s)
    above, from_end = torch.arange(seq_len, device=window.device), []
    for back in range(kernel):
        from_end.append(torch.where(depths >= back, kernel + above, kernel + depths - back))
        above = parent[above]
    columns = torch.stack(from_end[::-1], -1)  # [T, K], oldest first
    gathered = window[..., columns]  # [B, C, T, K]
    conv_out = (gathered @ layer.conv1d.weight[:, 0][:, :, None]).squeeze(-1)  # [B, C, T]
    query, key, value, g, beta = _heads(layer, conv_out, b, a)
    states = value.new_zeros(*value.shape[:2], seq_len, layer.head_k_dim, layer.head_v_dim)  # [B, Hv, T, dk, dv]
    out = torch.zeros_like(value)  # [B, Hv, T, dv]
    for d in range(tree.max_depth + 1):  # each node from its parent's state, kept at the node's own depth
        before = state0.float()[:, :, None] if d == 0 else states[:, :, parent]  # [B, Hv, T or 1, dk, dv]
        decayed = before * g.exp()[..., None, None]  # [B, Hv, T, dk, dv]
        delta = (value - (key[..., None, :] @ decayed)[..., 0, :]) * beta[..., None]
        advanced = decayed + key[..., :, None] * delta[..., None, :]
        at_depth = depths == d  # [T]
        states = torch.where(at_depth[:, None, None], advanced, states)
        out = torch.where(at_depth[:, None], (query[..., None, :] @ advanced)[..., 0, :], out)
    return out, states


def install_short_block_path(layer: nn.Module) -> None:
    """Route a Gated DeltaNet layer's short cached forwards through `short_block_forward`;
    everything else (long prefills, padding masks, no cache, recorded past) keeps the layer's own
    forward, and so do CUDA inputs where fla is installed (its kernels are the path there). Hooks
    on the layer still run: only its `forward` is replaced, on this instance. A layer whose conv
    activation is not SiLU (every released Qwen3.5 and Qwen3-Next layer's is) keeps its own forward."""
    if getattr(layer, "activation", "silu") != "silu":
        return
    original = layer.forward
    has_fla = find_spec("fla") is not None

    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        parents = getattr(layer, "tree_parents", None)  # set for a draft tree's forward (`decoding.tree`)
        if parents is not None and cache_params is not None:
            return tree_block_forward(layer, hidden_states, cache_params, parents)
        if (
            cache_params is not None
            and attention_mask is None
            and hidden_states.shape[1] <= SHORT_BLOCK_MAX
            and not cache_params.is_recording_past(layer.layer_idx)
            and not (has_fla and hidden_states.is_cuda)
            and getattr(layer, "short_block_path", True)  # False: `flashdraft parity` runs a backend's own path
        ):
            return short_block_forward(layer, hidden_states, cache_params)
        return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)

    layer.forward = forward
    layer.tree_parents = None  # this layer can verify a draft tree (`tree_block_forward`)
