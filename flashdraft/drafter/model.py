"""The DFlash drafter: a few Qwen3 decoder layers whose attention takes queries from a
block of tokens and keys/values from both the target's context features and the block.

Reference: section 2 of `shared/docs/dflash-reference.md`. The parameter names and shapes
are exactly the public checkpoint format (see `checkpoint.py`); the drafter owns no
embedding and no LM head, it borrows the target's.

One forward serves inference (one block per sequence, committed context K/V cached across
steps) and training (many blocks per sequence, each seeing only context strictly before
its own anchor); the mask rule is the same in both, built by `attention_mask`.

The module is over 600 lines because the drafter is one file, as the reference's is: the mask, the attention, the
layer, each family's parts (DFlash2's convolution and candidate selector, DSpark's Markov and confidence heads) and
the forward that composes them read together, and the checkpoint names their parameters after this layout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from flashdraft.drafter.config import DrafterConfig, LayerAttention
from flashdraft.drafter.packed_attention import ContextTiles, TiledMask, own_block_mask, tiled_attention, tiled_mask

# Position given to padding context slots: never before any anchor, so never visible.
PAD_POSITION = 1 << 40


def qwen3_config(cfg: DrafterConfig) -> Qwen3Config:
    """The transformers Qwen3 config equivalent to a drafter config (for RoPE and the MLP)."""
    return Qwen3Config(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,  # a copy: transformers adds rope_theta to it
        vocab_size=cfg.vocab_size,
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first rotary_dim dims of each head (all of them unless partial_rotary_factor
    < 1: the rest pass through, as vLLM's get_rope and SGLang rotate them)."""
    # x: [N, heads, P, head_dim]; cos/sin: [N, P, rotary_dim]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rotated * cos + rotate_half(rotated) * sin, passed], dim=-1)


def attention_mask(
    query_positions: torch.Tensor,
    query_block: torch.Tensor,
    query_anchor: torch.Tensor,
    context_positions: torch.Tensor,
    attention: LayerAttention,
    documents: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Which keys each block query may see (True = visible).

    query_positions, query_anchor: [N, Q] absolute position of each query and of its anchor
    query_block: [Q] block index of each query; context_positions: [N, C]
    returns [N, 1, Q, C + Q]: context keys strictly before the query's anchor, keys of its own
    block (a causal layer: only those at or before the query), none of another block; a
    sliding window keeps keys with |q - k| < window (section 2 of the reference doc).
    documents (packed training): (query_document [N, Q], context_document [N, C]); a context key is
    then visible only to the blocks of its own document (positions restart per document).
    """
    sees_context = context_positions[:, None, :] < query_anchor[:, :, None]  # [N, Q, C]
    if documents is not None:
        sees_context &= documents[1][:, None, :] == documents[0][:, :, None]
    same_block = (query_block[:, None] == query_block[None, :]).expand(query_positions.shape[0], -1, -1)
    if attention.causal:
        same_block = same_block & (query_positions[:, None, :] <= query_positions[:, :, None])  # key <= query
    mask = torch.cat([sees_context, same_block], dim=-1)  # [N, Q, C + Q]
    if attention.window is not None:
        key_positions = torch.cat([context_positions, query_positions], dim=-1)  # [N, C + Q]
        distance = query_positions[:, :, None] - key_positions[:, None, :]  # [N, Q, C + Q]
        mask &= distance.abs() < attention.window
    return mask.unsqueeze(1)


def mask_mod_for(
    query_positions: torch.Tensor,
    query_block: torch.Tensor,
    query_anchor: torch.Tensor,
    context_positions: torch.Tensor,
    attention: LayerAttention,
    documents: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """The rule of `attention_mask` as a flex-attention mask_mod (block-sparse on GPU)."""
    num_context = context_positions.shape[1]
    key_positions = torch.cat([context_positions, query_positions], dim=1)  # [N, C + Q]
    key_block = torch.cat([query_block.new_full((num_context,), -1), query_block])  # [C + Q]
    causal, window = attention.causal, attention.window
    query_document = key_document = None
    if documents is not None:  # [N, Q], and [N, C + Q]: the blocks' own entries never read
        query_document, key_document = documents[0], torch.cat([documents[1], documents[0]], dim=1)

    def mask_mod(b, h, q, kv):
        in_block = key_block[kv] == query_block[q]
        if causal:
            in_block = in_block & (key_positions[b, kv] <= query_positions[b, q])
        sees_context = key_positions[b, kv] < query_anchor[b, q]
        if query_document is not None:
            sees_context = sees_context & (key_document[b, kv] == query_document[b, q])
        ok = torch.where(kv < num_context, sees_context, in_block)
        if window is not None:
            ok = ok & ((query_positions[b, q] - key_positions[b, kv]).abs() < window)
        return ok

    return mask_mod


@dataclass(frozen=True)
class BlockwiseMask:
    """`attention_mask`'s rule split where it is sparse: the context keys each query sees [N, 1, Q, C], and within
    its own block [B, B] (the same for every block); the keys of other blocks, never seen, are never computed, so a
    forward of K blocks costs Q x (C + B) scores, not Q x (C + Q) (the dense training path on CPU)."""

    context: torch.Tensor  # [N, 1, Q, C] bool
    own_block: torch.Tensor  # [B, B] bool: key j of a block visible to its query i


def blockwise_mask(
    query_positions: torch.Tensor,
    query_anchor: torch.Tensor,
    context_positions: torch.Tensor,
    block_size: int,
    attention: LayerAttention,
    documents: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> BlockwiseMask:
    """`attention_mask`'s rule (same arguments, block_size the tokens of a block) as a `BlockwiseMask`."""
    sees = context_positions[:, None, :] < query_anchor[:, :, None]  # [N, Q, C]
    if documents is not None:
        sees &= documents[1][:, None, :] == documents[0][:, :, None]
    if attention.window is not None:
        sees &= (query_positions[:, :, None] - context_positions[:, None, :]).abs() < attention.window
    return BlockwiseMask(sees.unsqueeze(1), own_block_mask(block_size, attention, query_positions.device))


def blockwise_attention(
    q: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor], block_kv: tuple, mask: BlockwiseMask
) -> torch.Tensor:
    """Attention of q [N, h, Q, d] over the context's keys/values ([N, kv_h, C, d] each, seen where mask.context) and
    its own block's ([N, kv_h, Q, d], seen where mask.own_block): one softmax over both, as the dense mask's."""
    n, heads, q_len, dim = q.shape
    block = mask.own_block.shape[0]
    group = heads // context_kv[0].shape[1]
    k_ctx, v_ctx, k_blk, v_blk = (t.repeat_interleave(group, dim=1) for t in (*context_kv, *block_kv))
    scale = dim**-0.5
    scores_ctx = (q @ k_ctx.transpose(-1, -2)) * scale  # [N, h, Q, C]
    scores_ctx = scores_ctx.masked_fill(~mask.context, float("-inf"))
    q_blocks = q.view(n, heads, q_len // block, block, dim)
    scores_blk = (q_blocks @ k_blk.view(q_blocks.shape).transpose(-1, -2)) * scale  # [N, h, K, B, B]
    scores_blk = scores_blk.masked_fill(~mask.own_block, float("-inf")).view(n, heads, q_len, block)
    weights = torch.softmax(torch.cat([scores_ctx, scores_blk], dim=-1).float(), dim=-1).to(q.dtype)  # [N, h, Q, C+B]
    num_context = k_ctx.shape[2]
    out = weights[..., :num_context] @ v_ctx  # [N, h, Q, d]
    own = weights[..., num_context:].reshape(n, heads, q_len // block, block, block) @ v_blk.view(q_blocks.shape)
    return out + own.view(n, heads, q_len, dim)


_compiled_flex = None
# The distinct input shapes handed to flex attention: compiled with dynamic=False (on GPU), each is one compile, so
# their count is the run's compile count (training reports it; on CPU flex runs uncompiled: torch 2.13 compiles it
# there too, but ~40 s a shape on 2 cores, so the count of shapes stands in for it).
flex_shapes: set[tuple] = set()


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    global _compiled_flex
    if torch.compiler.is_compiling():  # inside the compiled training step (`train --compile`): part of its graph
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    flex_shapes.add((tuple(q.shape), tuple(k.shape), q.dtype, q.device.type))
    if q.device.type != "cuda":  # uncompiled flex is a reference path (tests); real use is on GPU
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


class DrafterCache:
    """Committed context of the drafter, per layer: K/V after k_norm and RoPE, plus the
    positions they sit at. Only context is ever stored; a block's K/V are discarded."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # [N, C]

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=2)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=2)
        return self.keys[layer], self.values[layer]

    def keys_and_values(self, layer: int, context_kv: tuple, block_kv: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a block attends to [N, kv_heads, C_all + Q, d]: the cached context with the new
        context_kv appended (kept), then the block's own block_kv (not kept). A fixed-shape cache
        (`flashdraft.drafter.static_cache.StaticDrafterCache`) answers the same call from its buffers."""
        k_ctx, v_ctx = self.append(layer, *context_kv)
        return torch.cat([k_ctx, block_kv[0]], dim=2), torch.cat([v_ctx, block_kv[1]], dim=2)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.layer_idx = layer_idx
        self.v_scale = cfg.attention_value_scale  # MiMo drafters: the servers scale V in every layer

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, p, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, p, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, p, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.v_scale is not None:  # block and context V alike, as both servers' draft caches hold them
            v = v * self.v_scale
        return apply_rope(k, cos, sin), v  # [N, kv_heads, P, head_dim]

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | BlockMask | None,
        cache: DrafterCache | None,
    ) -> torch.Tensor:
        n, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *block_rope)
        k_block, v_block = self._kv(x, *block_rope)
        if context is not None:
            k_ctx, v_ctx = self._kv(context, *context_rope)
        else:
            k_ctx = v_ctx = x.new_zeros(n, self.num_kv_heads, 0, self.head_dim)
        if isinstance(
            mask, BlockwiseMask
        ):  # training's many blocks (no cache): a block's keys are its context and itself
            out = blockwise_attention(q, (k_ctx, v_ctx), (k_block, v_block), mask)
            return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))
        if isinstance(mask, TiledMask):  # packed rows: a block's keys are its document's context tiles and itself
            out = tiled_attention(q, (k_ctx, v_ctx), (k_block, v_block), mask)
            return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))
        if cache is not None:  # committed context persists; the block's K/V do not
            k, v = cache.keys_and_values(self.layer_idx, (k_ctx, v_ctx), (k_block, v_block))
        else:
            k, v = torch.cat([k_ctx, k_block], dim=2), torch.cat([v_ctx, v_block], dim=2)
        if isinstance(mask, BlockMask):
            out = _flex_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


def shift_within_blocks(x: torch.Tensor, block: int, tap: int) -> torch.Tensor:
    """x [N, K * b, C] moved `tap` positions later inside each block of b, zeros entering at the
    block's start: row j of a block reads row j - tap of the same block, never another block's."""
    if tap == 0:
        return x
    n, q_len, c = x.shape
    blocks = x.view(n, q_len // block, block, c)
    shifted = torch.zeros_like(blocks)
    if tap < block:
        shifted[:, :, tap:] = blocks[:, :, :-tap]
    return shifted.view(n, q_len, c)


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2's convolution around one sublayer (vLLM 0.33.0 `qwen3_dflash2.py`, the z-lab reference):
    out[t, c] = sum_tap (base[side, tap, c] + delta[t, side, tap, g(c)]) x[t - tap, c], taps causal
    within the block and zero across its boundary; g(c) = c // group_size. One projection of the
    normalised sublayer input gives both sides' per-position corrections: `prepare` convolves the
    sublayer's input (side 0) and `finish` its output (side 1)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [side, tap, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int, block: int) -> torch.Tensor:
        # x [N, Q, H]; delta [N, Q, K, groups]; per channel and tap: the static weight plus its group's correction
        k = self.kernel_size
        base = self.base_kernel[side].view(k, self.groups, self.group_size)
        weight = (base + delta.unsqueeze(-1)).view(*x.shape[:2], k, -1)  # [N, Q, K, H]
        taps = torch.stack([shift_within_blocks(x, block, tap) for tap in range(k)], dim=2)  # [N, Q, K, H]
        return (weight * taps).sum(2)

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer input convolved, the output side's corrections [N, Q, K, groups])."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, delta[..., 0, :, :], 0, block), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
        """The sublayer output convolved with the corrections `prepare` returned."""
        return self._convolve(y, delta, 1, block)

    @torch.no_grad()
    def reset_identity(self) -> None:
        """The convolution that changes nothing: base tap 0 = 1, other taps and the projection 0."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()


def is_dflash2_parameter(name: str) -> bool:
    """True for the parameters DFlash2 adds to the backbone (convolutions, candidate selector)."""
    return name.startswith("candidate_selector.") or "_conv." in name


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, qwen3: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(cfg, layer_idx)
        self.mlp = Qwen3MLP(qwen3)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attention = cfg.layer_attention[layer_idx]
        if cfg.family == "dflash2":  # the block inputs pass through a convolution around each sublayer
            self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None, masks: dict, block: int, **attn_kwargs
    ) -> torch.Tensor:
        mask = masks[self.attention]
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            x = x + self.self_attn(h, context, mask=mask, **attn_kwargs)
            return x + self.mlp(self.post_attention_layernorm(x))
        # DFlash2: context features reach k/v unconvolved; only the block's rows are convolved
        h, delta = self.attention_conv.prepare(h, block)
        x = x + self.attention_conv.finish(self.self_attn(h, context, mask=mask, **attn_kwargs), delta, block)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        return x + self.mlp_conv.finish(self.mlp(h), delta, block)


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector: at each draft position keep the top-K unary candidates and
    score candidate c after predecessor p as unary(c) + < P[p] * W h, S[c] >; a draft is a walk
    from the anchor, each position choosing given the token chosen before it. The codebooks are
    stored without `.weight`, as published."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # [V, r]
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # [V, r]
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def pair_scores(
        self, projected: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """< P[p] * W h, S[c] > for projected W h [..., r], predecessors p [...], candidates c [..., K] -> [..., K]."""
        query = self.predecessor_codebook[predecessors] * projected  # [..., r]
        return (self.successor_codebook[candidates] * query.unsqueeze(-2)).sum(-1)

    def walk(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        anchors: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        path: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's drafts for N blocks: hidden [N, k, H] and unary logits [N, k, V] at the k
        draft positions, anchors [N]. Greedy (temperature 0): each position takes the best score
        given the token chosen before it; returns (drafts [N, k], scores [N, k, V]: each row the
        scores its position chose from, -inf outside its top-K, so its argmax is the draft).
        temperature > 0: each draft sampled from softmax(score / T) over the K candidates; returns
        (drafts, q [N, k, V]: the distribution each was drawn from, zero outside its top-K). `path` [N, k]: each
        position's predecessor is path's token before it (the rows along a given continuation; a path token outside
        the previous position's top-K scores with its own codebook row)."""
        unary_top, candidates = unary.float().topk(self.top_k, dim=-1)  # [N, k, K]
        # candidates in token order: the first best score is then the lowest token id, as an argmax over V
        candidates, order = candidates.sort(-1)
        unary_top = unary_top.gather(-1, order)
        # every pair score at once: a predecessor is the anchor (position 0) or one of the K candidates
        # before it, so the walk itself only indexes K x K tables
        successors = self.successor_codebook[candidates] * self.hidden_projection(hidden).unsqueeze(-2)  # [N, k, K, r]
        successors = successors.float()
        from_anchor = (successors[:, 0] * self.predecessor_codebook[anchors].float().unsqueeze(1)).sum(-1)  # [N, K]
        between = self.predecessor_codebook[candidates[:, :-1]].float() @ successors[:, 1:].transpose(-1, -2)
        # between [N, k - 1, K (predecessor), K (successor)]
        chosen = candidates.new_empty(candidates.shape[:2])  # [N, k]: index among the K
        chose_from = torch.empty_like(unary_top)  # [N, k, K]: the scores (or q) each position chose from
        rows_n = torch.arange(candidates.shape[0], device=candidates.device)
        for t in range(candidates.shape[1]):
            if path is not None and t > 0:  # [N, K]: < P[path token] * W h_t, S[c] >
                pair = (successors[:, t] * self.predecessor_codebook[path[:, t - 1]].float().unsqueeze(1)).sum(-1)
            else:
                pair = from_anchor if t == 0 else between[rows_n, t - 1, chosen[:, t - 1]]  # [N, K]
            scores = unary_top[:, t] + pair
            if temperature <= 0:
                chosen[:, t] = scores.argmax(-1)
                chose_from[:, t] = scores
            else:
                chose_from[:, t] = probs = torch.softmax(scores / temperature, dim=-1)
                chosen[:, t] = torch.multinomial(probs, 1, generator=generator)[:, 0]
        rows = torch.full_like(unary, float("-inf") if temperature <= 0 else 0.0, dtype=torch.float32)
        rows.scatter_(-1, candidates, chose_from)
        return candidates.gather(-1, chosen[..., None])[..., 0], rows

    @torch.no_grad()
    def reset_neutral(self, generator: torch.Generator) -> None:
        """A selector that changes nothing until trained: W = 0 (every pair score 0, so the walk is the
        unary argmax), codebooks random so W gets a gradient from the first step."""
        rank = self.predecessor_codebook.shape[1]
        for codebook in (self.predecessor_codebook, self.successor_codebook):
            codebook.copy_(torch.randn(codebook.shape, generator=generator) * rank**-0.25)
        self.hidden_projection.weight.zero_()


class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head (vLLM 0.33.0 `qwen3_dspark.py` DSparkMarkovHead, DeepSpec VanillaMarkov): the
    logits of a draft get the bias W2 W1[p] from the token p drafted just before it (the anchor before the first).
    markov_w1 [V, r] embeds the previous token, markov_w2 [V, r] projects it back to the vocabulary."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, previous: torch.Tensor) -> torch.Tensor:
        """The Markov embedding W1[p] of previous tokens [...] -> [..., r]."""
        return self.markov_w1(previous)

    def bias(self, previous: torch.Tensor) -> torch.Tensor:
        """The transition bias W2 W1[p]: previous tokens [...] -> [..., V]."""
        return self.markov_w2(self.embed(previous))


class ConfidenceHead(nn.Module):
    """DSpark's confidence head: c = sigmoid(w . [h; W1[p]] + b), an estimate of the probability that a draft is
    accepted, from the final hidden state h at its position and (confidence_head_with_markov) the Markov embedding
    of the token before it. Computed in float32, as vLLM 0.33.0 and SGLang 0.5.23 compute it."""

    def __init__(self, hidden_size: int, markov_rank: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (markov_rank if with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor | None) -> torch.Tensor:
        """The confidence logit [...] of hidden [..., H] and markov_embedding [..., r] (sigmoid it for c)."""
        features = torch.cat([hidden, markov_embedding.to(hidden.dtype)], -1) if self.with_markov else hidden
        return F.linear(features.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


def is_family_parameter(name: str) -> bool:
    """True for the parameters DFlash2 or DSpark add to the shared backbone (convolutions, candidate selector,
    Markov and confidence heads): a new drafter's backbone draws do not depend on them."""
    return is_dflash2_parameter(name) or name.startswith(("markov_head.", "confidence_head."))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, own_embedding: bool = False, own_lm_head: bool = False) -> None:
        """own_embedding / own_lm_head: the checkpoint carries `embed_tokens.weight` / `lm_head.weight` over the full
        vocabulary (DeepSpec's frozen copies of the target's), which vLLM 0.33.0 then uses in place of the target's;
        kept frozen, as DeepSpec trains them."""
        super().__init__()
        if not cfg.in_own_conventions:  # `checkpoint.fold_conventions` converts such weights on load
            raise ValueError("a drafter is built in flashdraft's conventions: fold gemma norms / GPT-J rotation first")
        self.config = cfg
        qwen3 = qwen3_config(cfg)
        self.fc = nn.Linear(cfg.num_context_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, qwen3, i) for i in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        rope = qwen3_config(cfg)
        rope.head_dim = cfg.rotary_dim  # cos/sin for the rotated dims only (partial_rotary_factor)
        self.rotary_emb = Qwen3RotaryEmbedding(rope)
        self.candidate_selector = None
        if cfg.family == "dflash2":
            self.candidate_selector = CandidateSelector(
                cfg.vocab_size, cfg.hidden_size, cfg.selector_rank, cfg.selector_top_k
            )
        self.markov_head = self.confidence_head = None
        if cfg.family == "dspark":
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
            if cfg.confidence_head:
                self.confidence_head = ConfidenceHead(cfg.hidden_size, cfg.markov_rank, cfg.confidence_head_with_markov)
        # A reduced vocabulary (draft_vocab_size): an own LM head over draft ids, and d2t mapping
        # them to target ids (target id = i + d2t[i], the EAGLE-3 convention vLLM serves).
        self.lm_head = self.embed_tokens = None
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size).requires_grad_(False)
        if own_lm_head and cfg.draft_vocab_size is None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).requires_grad_(False)
        if cfg.draft_vocab_size is not None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
            if cfg.draft_vocab_size < cfg.vocab_size:
                self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        # "auto": block-sparse flex attention for many-block (training) forwards on GPU, a dense
        # boolean mask otherwise; "sdpa" or "flex" force one.
        self.attention_backend = "auto"

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def init_weights(self, seed: int = 0) -> None:
        """Fresh weights for an untrained drafter (Qwen3's init: normal(0, 0.02), norms at 1). The
        backbone's draws do not depend on the family: a DFlash2 drafter starts from the same backbone
        as a DFlash one of that shape and seed."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if is_family_parameter(name):
                continue
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        self.reset_family_parts(gen)

    def reset_family_parts(self, generator: torch.Generator) -> None:
        """DFlash2's and DSpark's parts as their trainers start them, so the drafter drafts exactly as its backbone
        alone (greedy) until they are trained: identity convolutions and a neutral selector; a Markov head whose W2
        is 0 (no bias; W1 random, so W2 gets a gradient from the first step) and a confidence head at 0.5."""
        if self.markov_head is not None:
            with torch.no_grad():
                rank = self.markov_head.markov_w1.weight.shape[1]
                self.markov_head.markov_w1.weight.copy_(
                    torch.randn(self.markov_head.markov_w1.weight.shape, generator=generator) * rank**-0.5
                )
                self.markov_head.markov_w2.weight.zero_()
        if self.confidence_head is not None:
            with torch.no_grad():
                self.confidence_head.proj.weight.zero_()
                self.confidence_head.proj.bias.zero_()
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    conv.reset_identity()
        if self.candidate_selector is not None:
            self.candidate_selector.reset_neutral(generator)

    def embed(self, token_ids: torch.Tensor, target) -> torch.Tensor:
        """The block's input embeddings: its own embedding when the checkpoint has one, else the target's."""
        return target.embed(token_ids) if self.embed_tokens is None else self.embed_tokens(token_ids)

    def markov_walk(
        self,
        base: torch.Tensor,
        anchors: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        path: torch.Tensor | None = None,
        honour_draft_top_k: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DSpark's sequential drafting of N blocks (vLLM 0.33.0 `dspark/speculator.py` _sample_sequential): from
        base logits [N, k, V] (the LM head at the k draft positions) and the anchors [N], position t's logits are
        base[t] + W2 W1[the draft at t - 1] (the anchor for t = 0), and its draft is their argmax (temperature 0) or
        a draw from softmax(logits / T). With dspark_draft_topk, only the top-k base candidates of a position get
        the bias; the rest are excluded (as vLLM's _sample_sequential_topk).

        Returns (drafts [N, k]; rows [N, k, V]: the corrected logits (greedy, their argmax the drafts) or the
        distribution q each draft was drawn from (sampling, what verification uses); previous [N, k]: the token
        each position's bias came from). `path` [N, k]: each position's predecessor is path's token before it (the
        distributions along a given continuation, not a walk); `honour_draft_top_k` False: as SGLang, which ignores
        dspark_draft_topk."""
        top_k = self.config.draft_top_k if honour_draft_top_k else None
        if top_k is not None:  # the excluded tokens never get a bias: -inf before it
            keep = base.topk(top_k, dim=-1).indices
            base = torch.full_like(base, float("-inf")).scatter(-1, keep, base.gather(-1, keep))
        drafts = anchors.new_empty(base.shape[:2])
        previous = torch.empty_like(drafts)
        rows = torch.empty(base.shape, dtype=torch.float32, device=base.device)
        before = anchors
        for t in range(base.shape[1]):
            previous[:, t] = before
            logits = base[:, t].float() + self.markov_head.bias(before).float()  # [N, V]
            if temperature <= 0:
                rows[:, t] = logits
                before = logits.argmax(-1)
            else:
                rows[:, t] = q = torch.softmax(logits / temperature, dim=-1)
                before = torch.multinomial(q, 1, generator=generator)[:, 0]
            if path is not None:
                before = path[:, t]
            drafts[:, t] = before
        return drafts, rows, previous

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """DSpark's confidence c in [0, 1] of each draft: hidden [..., H] at its position, previous [...] the token
        drafted before it."""
        embedding = self.markov_head.embed(previous) if self.confidence_head.with_markov else None
        return torch.sigmoid(self.confidence_head(hidden, embedding))

    def target_ids(self) -> torch.Tensor | None:
        """The target id of each draft-vocabulary id [draft_vocab_size]; None with the full vocabulary."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else torch.arange(d2t.shape[0], device=d2t.device) + d2t

    def vocabulary_mask(self) -> torch.Tensor | None:
        """[V] bool: the target ids this drafter can draft (None: all of them)."""
        target_ids = self.target_ids()
        if target_ids is None:
            return None
        mask = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=target_ids.device)
        mask[target_ids] = True
        return mask

    def logits(self, hidden: torch.Tensor, target_lm_head) -> torch.Tensor:
        """The drafter's logits over the target's vocabulary [..., V] from its hidden states [..., H]:
        its own LM head if it has one (draft ids mapped through d2t; target ids outside the draft
        vocabulary get -inf), else the target's; then the reference's output_multiplier and
        final_logit_softcapping."""
        logits = (self.lm_head or target_lm_head)(hidden)
        multiplier = self.config.reference_option("output_multiplier")
        if multiplier != 1.0:
            logits = logits * multiplier
        cap = self.config.reference_option("final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / cap) * cap
        target_ids = self.target_ids()
        if target_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., target_ids] = logits
        return full

    def new_cache(self) -> DrafterCache:
        return DrafterCache(len(self.layers))

    def _context(
        self,
        anchor_positions: torch.Tensor,
        context_features: torch.Tensor | None,
        context_positions: torch.Tensor | None,
        cache: DrafterCache | None,
    ) -> tuple[torch.Tensor | None, tuple | None, torch.Tensor]:
        """The new context's features after `fc` and `hidden_norm` [N, C, H] and their RoPE (None without new
        context), and the positions of every context token the blocks see, cached and new [N, C_all] (the new
        ones appended to `cache`)."""
        context = None
        context_rope = None
        if context_features is not None:
            context = self.hidden_norm(self.fc(context_features))  # [N, C, H]
            context_rope = self.rotary_emb(context, context_positions.clamp(max=self.config.max_position_embeddings))
        all_context_positions = context_positions
        if cache is not None:
            n = anchor_positions.shape[0]
            new = context_positions if context_positions is not None else anchor_positions.new_zeros(n, 0)
            cache.positions = new if cache.positions is None else torch.cat([cache.positions, new], dim=1)
            all_context_positions = cache.positions
        if all_context_positions is None:
            all_context_positions = anchor_positions.new_zeros(anchor_positions.shape[0], 0)
        return context, context_rope, all_context_positions

    def forward(
        self,
        block_embeds: torch.Tensor,
        anchor_positions: torch.Tensor,
        context_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        cache: DrafterCache | None = None,
        documents: tuple[torch.Tensor, torch.Tensor] | None = None,
        context_before_anchors: bool = False,
        context_tiles: ContextTiles | None = None,
    ) -> torch.Tensor:
        """Hidden states of the block positions, after the final norm (feed to the LM head).

        block_embeds: [N, K * b, H] target embeddings of K blocks of b tokens each (anchor, masks...)
        anchor_positions: [N, K] absolute position of each block's anchor
        context_features: [N, C, n_ctx * H] concatenated target layer outputs (raw, before fc)
        context_positions: [N, C] their positions (PAD_POSITION for padding)
        cache: committed context from earlier calls; the new context is appended to it.
        documents: packed training only: (anchor_documents [N, K], context_documents [N, C]), the document of each
            block and context token (-1 on padding); a block sees only its own document's context.
        context_before_anchors: the caller knows every context position (cached and new) is before every anchor
            (decoding: the context is the committed tokens), so a one-block forward's full layers need no mask and
            nothing is read back from the device to find that out.
        context_tiles: packed training on the dense path on CPU: the (block, context tile) pairs of each row
            (`packed_attention`); only they are scored (elsewhere the blockwise mask with `documents`).
        """
        n, q_len, _ = block_embeds.shape
        num_blocks = anchor_positions.shape[1]
        scale = self.config.reference_option("input_embedding_scale")
        if scale != 1.0:
            block_embeds = block_embeds * scale
        b = q_len // num_blocks
        offsets = torch.arange(b, device=block_embeds.device)
        query_anchor = anchor_positions.repeat_interleave(b, dim=1)  # [N, Q]
        query_positions = query_anchor + offsets.repeat(num_blocks)  # [N, Q]
        query_block = torch.arange(num_blocks, device=block_embeds.device).repeat_interleave(b)  # [Q]
        packed_documents = documents  # (anchor_documents [N, K], context_documents [N, C])
        if documents is not None:  # (query_document [N, Q], context_document [N, C])
            documents = (documents[0].repeat_interleave(b, dim=1), documents[1])

        context, context_rope, all_context_positions = self._context(
            anchor_positions, context_features, context_positions, cache
        )
        block_rope = self.rotary_emb(block_embeds, query_positions)
        backend = self.attention_backend
        if backend == "auto":
            backend = "flex" if block_embeds.is_cuda and num_blocks > 1 else "sdpa"
        masks = {}
        # Drafting one block after committed context (decoding): in a full non-causal layer every key
        # is visible to every query, so no mask; building one and masking costs ~10% of a CPU drafting step.
        sees_all = (
            backend == "sdpa"
            and num_blocks == 1
            and documents is None
            and (context_before_anchors or bool((all_context_positions < anchor_positions).all()))
        )
        for attention in {layer.attention for layer in self.layers}:
            if sees_all and attention.window is None and not attention.causal:
                masks[attention] = None
            elif backend == "flex":
                rule = mask_mod_for(
                    query_positions, query_block, query_anchor, all_context_positions, attention, documents
                )
                num_keys = all_context_positions.shape[1] + q_len
                masks[attention] = create_block_mask(rule, n, None, q_len, num_keys, device=block_embeds.device)
            elif context_tiles is not None and cache is None and block_embeds.device.type == "cpu":  # packed, CPU
                tiled = (query_positions, anchor_positions, all_context_positions, packed_documents, b, attention)
                masks[attention] = tiled_mask(context_tiles, *tiled)
            elif num_blocks > 1 and cache is None:  # training: the blocks never see each other
                masks[attention] = blockwise_mask(
                    query_positions, query_anchor, all_context_positions, b, attention, documents
                )
            else:
                masks[attention] = attention_mask(
                    query_positions, query_block, query_anchor, all_context_positions, attention, documents
                )
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, masks, b, block_rope=block_rope, context_rope=context_rope, cache=cache)
        return self.norm(x)
