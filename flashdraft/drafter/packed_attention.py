"""Attention of a packed training row (`train --pack-length`) computed only where its documents are.

A packed row holds several documents side by side: L context tokens and A blocks. A block sees only its own
document's context, so laying every block's queries against all L context keys (the dense path, [Q, L] scores a
row) spends most of its work on keys it never sees, and a row's cost grows with its blocks times L where an unpacked
record's grows with its blocks times its own length: packed trained slower per token than unpacked.

Here the context keys are cut into tiles of `KEY_TILE` tokens and a row lists its (block, key tile) pairs: each
block with the tiles that overlap its document's tokens (`row_tile_pairs`, from the row's layout alone). Only those
pairs are scored, so a block pays for its own document's length rounded to tiles, as unpacked. The pair lists are
made with the batch on the host and padded to the run's most (`PackPlan.tile_pairs`), so every batch of a packed run
has one shape and nothing is read back from the device (the compiled step's one graph). Inside a pair the rule is
`attention_mask`'s (context of the own document strictly before the anchor, a sliding window where the layer has
one); the softmax runs over a block query's context tiles and its own block at once, so the result equals the dense
path's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.drafter.config import LayerAttention

KEY_TILE = 128  # context keys per tile (8 x 128 measured fastest on CPU among 4-32 x 32-256)
BLOCK_TILE = 8  # blocks per query tile: a gathered key tile serves this many blocks, a query tile that many key tiles


def row_tile_pairs(
    doc_tokens: list[int], doc_blocks: list[int], key_tile: int = KEY_TILE, block_tile: int = BLOCK_TILE
) -> list[tuple[int, int]]:
    """The (block tile, key tile) pairs of a row whose documents, in row order, have `doc_tokens` context tokens and
    `doc_blocks` blocks: a pair wherever a tile of a document's blocks meets a tile of its tokens; sorted."""
    pairs, start, first_block = set(), 0, 0
    for tokens, blocks in zip(doc_tokens, doc_blocks, strict=True):
        if tokens and blocks:
            key_tiles = range(start // key_tile, (start + tokens - 1) // key_tile + 1)
            block_tiles = range(first_block // block_tile, (first_block + blocks - 1) // block_tile + 1)
            pairs.update((i, j) for i in block_tiles for j in key_tiles)
        start, first_block = start + tokens, first_block + blocks
    return sorted(pairs)


@dataclass
class ContextTiles:
    """A packed batch's (block tile, key tile) pairs, each row's padded to the run's most: [N, P] each."""

    block_tile: torch.Tensor  # [N, P] long: the pair's blocks are block_tile * block_tile_size ...
    key_tile: torch.Tensor  # [N, P] long: the pair's context keys are key_tile * key_tile_size ...
    valid: torch.Tensor  # [N, P] bool: False on padding pairs (never seen)
    key_tile_size: int = KEY_TILE
    block_tile_size: int = BLOCK_TILE

    @classmethod
    def of_rows(
        cls, rows: list[list[tuple[int, int]]], pairs: int, key_tile: int = KEY_TILE, block_tile: int = BLOCK_TILE
    ) -> ContextTiles:
        """Pairs of each row (`row_tile_pairs`) padded to `pairs` per row."""
        block = torch.zeros(len(rows), pairs, dtype=torch.long)
        tile = torch.zeros(len(rows), pairs, dtype=torch.long)
        valid = torch.zeros(len(rows), pairs, dtype=torch.bool)
        for i, row in enumerate(rows):
            if len(row) > pairs:
                raise ValueError(f"packed row {i} has {len(row)} (block, key tile) pairs, more than the plan's {pairs}")
            if row:
                listed = torch.tensor(row, dtype=torch.long)  # [p, 2]
                block[i, : len(row)], tile[i, : len(row)], valid[i, : len(row)] = listed[:, 0], listed[:, 1], True
        return cls(block, tile, valid, key_tile, block_tile)


@dataclass(frozen=True)
class TiledMask:
    """`attention_mask`'s rule for a packed row as its pairs see it: which key of each pair each block of the
    pair's block tile sees [N, P, G, 1, T] (with a sliding window each query: [N, P, G, B, T]), and within the own
    block [B, B] (as `BlockwiseMask.own_block`)."""

    tiles: ContextTiles
    context: torch.Tensor  # [N, P, G, 1 or B, T] bool
    own_block: torch.Tensor  # [B, B] bool


def _padded(x: torch.Tensor, size: int, value: int) -> torch.Tensor:
    """x [N, K, ...] padded along dim 1 to a multiple of `size` with `value`."""
    extra = -x.shape[1] % size
    if not extra:
        return x
    return torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), value)], dim=1)


def own_block_mask(block_size: int, attention: LayerAttention, device: torch.device) -> torch.Tensor:
    """[B, B] bool: key j of a block visible to its query i (all, causal: j <= i, within the window)."""
    offsets = torch.arange(block_size, device=device)
    own = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if attention.causal:
        own &= offsets[None, :] <= offsets[:, None]  # key <= query
    if attention.window is not None:
        own &= (offsets[:, None] - offsets[None, :]).abs() < attention.window
    return own


def tiled_mask(
    tiles: ContextTiles,
    query_positions: torch.Tensor,
    anchor_positions: torch.Tensor,
    context_positions: torch.Tensor,
    documents: tuple[torch.Tensor, torch.Tensor],
    block: int,
    attention: LayerAttention,
) -> TiledMask:
    """The pairs' visibility under `attention`'s rule: a key of the pair's key tile that exists, is of the block's
    document and is strictly before its anchor (and within the window). query_positions [N, A * B];
    anchor_positions [N, A]; context_positions [N, C]; documents (anchor_documents [N, A], context_documents [N, C]);
    block: B."""
    n, num_context = context_positions.shape
    size, group, window = tiles.key_tile_size, tiles.block_tile_size, attention.window
    keys = tiles.key_tile[..., None] * size + torch.arange(size, device=context_positions.device)  # [N, P, T]
    exists = keys < num_context
    keys = keys.clamp(max=num_context - 1).view(n, -1)
    key_positions = context_positions.gather(1, keys).view(exists.shape)  # [N, P, T]
    key_documents = documents[1].gather(1, keys).view(exists.shape)

    def per_pair(x: torch.Tensor, pad: int) -> torch.Tensor:  # [N, A, ...] -> [N, P, G, ...] of each pair's blocks
        tiled = _padded(x, group, pad).view(n, -1, group, *x.shape[2:])
        index = tiles.block_tile.view(n, -1, *([1] * (tiled.dim() - 2))).expand(-1, -1, *tiled.shape[2:])
        return tiled.gather(1, index)

    anchor = per_pair(anchor_positions, 0)  # [N, P, G]
    block_document = per_pair(documents[0], -2)  # [N, P, G]; -2: the padding blocks of the last tile see nothing
    sees = (exists & tiles.valid[..., None])[:, :, None, :] & (
        key_documents[:, :, None, :] == block_document[..., None]
    )
    sees = (sees & (key_positions[:, :, None, :] < anchor[..., None]))[:, :, :, None, :]  # [N, P, G, 1, T]
    if window is not None:
        query = per_pair(query_positions.view(n, -1, block), 0)  # [N, P, G, B]
        sees = sees & ((query[..., None] - key_positions[:, :, None, None, :]).abs() < window)
    return TiledMask(tiles, sees, own_block_mask(block, attention, context_positions.device))


def tiled_attention(
    q: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor], block_kv: tuple, mask: TiledMask
) -> torch.Tensor:
    """Attention of q [N, h, Q, d] (Q = A blocks of B) over its pairs' context keys/values ([N, kv_h, C, d] each)
    and its own block's ([N, kv_h, Q, d]): one softmax over both per query (fp32), as `blockwise_attention`'s."""
    n, heads, q_len, dim = q.shape
    k_ctx, v_ctx = context_kv
    kv_heads, num_context = k_ctx.shape[1], k_ctx.shape[2]
    tiles, block = mask.tiles, mask.own_block.shape[0]
    size, group = tiles.key_tile_size, tiles.block_tile_size
    num_blocks, per_head = q_len // block, heads // kv_heads

    # the own block's queries and keys [N, h, A, B, d] (the scale on q: fewer elements than on the scores)
    q_blocks = (q * dim**-0.5).view(n, heads, num_blocks, block, dim)
    k_blk, v_blk = (t.repeat_interleave(per_head, dim=1).view(q_blocks.shape) for t in block_kv)

    # the pairs: each pair's block tile's queries [N, P, kv_h, per_head * G * B, d] and its key tile's keys
    padded_context = -(-num_context // size) * size
    k_tiles, v_tiles = (
        torch.nn.functional.pad(t, (0, 0, 0, padded_context - num_context))
        .view(n, kv_heads, -1, size, dim)
        .transpose(1, 2)
        for t in (k_ctx, v_ctx)
    )  # [N, C / T, kv_h, T, d]
    index = tiles.key_tile[:, :, None, None, None].expand(-1, -1, kv_heads, size, dim)
    k_pairs, v_pairs = k_tiles.gather(1, index), v_tiles.gather(1, index)  # [N, P, kv_h, T, d]
    q_padded = _padded(q_blocks.transpose(1, 2), group, 0)  # [N, A', h, B, d], A' a multiple of G
    num_tiles = q_padded.shape[1] // group
    q_tiles = q_padded.view(n, num_tiles, group, kv_heads, per_head, block, dim).permute(0, 1, 3, 4, 2, 5, 6)
    rows = per_head * group * block
    q_tiles = q_tiles.reshape(n, num_tiles, kv_heads, rows, dim)
    q_pairs = q_tiles.gather(1, tiles.block_tile[:, :, None, None, None].expand(-1, -1, kv_heads, rows, dim))
    to_tile = tiles.block_tile[:, :, None, None, None].expand(-1, -1, heads, group, block)  # [N, P, h, G, B]
    own, pairs = (q_blocks, k_blk, v_blk), (q_pairs, k_pairs, v_pairs)
    out = _TiledSoftmax.apply(*own, *pairs, ~mask.own_block, ~mask.context, to_tile)  # [N, h, A, B, d]
    return out.reshape(n, heads, q_len, dim)


class _TiledSoftmax(torch.autograd.Function):
    """The softmax attention of each query over its pairs' keys and its own block's, forward and backward by hand:
    autograd's version of the same ops made about a dozen passes over the [N, P, h, G, B, T] scores, each to a new
    tensor (mask, max, subtract, exp, sum, the scatters, and as many again backward); here the scores are masked,
    shifted and exponentiated in place, left unnormalised (the 1 / sum goes on the [.., d] outputs and gradients),
    and the backward reads them once more, so the scores cost 5 passes forward and 2 backward.

    Inputs: the own block's q (scaled), k, v [N, h, A, B, d]; the pairs' q [N, P, kv_h, per_head * G * B, d], k and
    v [N, P, kv_h, T, d]; what is hidden within a block [B, B] and in each pair [N, P, G, 1 or B, T] (True: not
    seen); to_tile [N, P, h, G, B]: each pair's block tile. Output [N, h, A, B, d] in q's dtype."""

    @staticmethod
    def forward(ctx, q_own, k_own, v_own, q_pairs, k_pairs, v_pairs, hidden_own, hidden_context, to_tile):
        n, heads, num_blocks, block, dim = q_own.shape
        pairs, kv_heads, rows, size = q_pairs.shape[1], q_pairs.shape[2], q_pairs.shape[3], k_pairs.shape[3]
        group, dtype = to_tile.shape[3], q_own.dtype
        own = (q_own @ k_own.transpose(-1, -2)).float().masked_fill_(hidden_own, float("-inf"))  # [N, h, A, B, B]
        scores = (q_pairs @ k_pairs.transpose(-1, -2)).float().view(n, pairs, heads, group, block, size)
        scores.masked_fill_(hidden_context[:, :, None], float("-inf"))  # [N, P, h, G, B, T]
        # the running max per query keeps exp in range (a real query always sees itself); the softmax does not
        # depend on it
        top = _tiled(own.amax(-1), group, 0.0)  # [N, A'/G, h, G, B]
        top = top.scatter_reduce(1, to_tile, scores.amax(-1), reduce="amax", include_self=True)
        own.sub_(_untiled(top, num_blocks)[..., None]).exp_()  # unnormalised weights; hidden: 0
        scores.sub_(top.gather(1, to_tile)[..., None]).exp_()
        inverse = _tiled(own.sum(-1), group, 1.0).scatter_add(1, to_tile, scores.sum(-1)).reciprocal_()
        out = _tiled((own.to(dtype) @ v_own).float(), group, 0.0)  # [N, A'/G, h, G, B, d]
        pair_out = scores.to(dtype).view(n, pairs, kv_heads, rows, size) @ v_pairs  # [N, P, kv_h, rows, d]
        out = out.scatter_add(1, _with_dim(to_tile, dim), pair_out.view(n, pairs, heads, group, block, dim).float())
        out = _untiled(out * inverse[..., None], num_blocks)  # [N, h, A, B, d], normalised
        ctx.save_for_backward(q_own, k_own, v_own, q_pairs, k_pairs, v_pairs, own, scores, inverse, out, to_tile)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q_own, k_own, v_own, q_pairs, k_pairs, v_pairs, own, scores, inverse, out, to_tile = ctx.saved_tensors
        num_blocks, dim, dtype = q_own.shape[2], q_own.shape[-1], q_own.dtype
        group, weights = to_tile.shape[3], scores.view(*q_pairs.shape[:-1], -1)  # [N, P, kv_h, rows, T]
        grad_out = grad_out.float()
        # softmax backward: d score = weight * (d weight - sum over the query's keys of weight * d weight), that sum
        # being (grad_out * out).sum(-1); with unnormalised weights w = p / inverse, grad_out scaled by the inverse
        inverse_own = _untiled(inverse, num_blocks)[..., None]  # [N, h, A, B, 1]
        grad_scaled = grad_out * inverse_own  # [N, h, A, B, d]
        delta = (grad_out * out).sum(-1, keepdim=True) * inverse_own  # [N, h, A, B, 1]
        d_v_own = own.to(dtype).transpose(-1, -2) @ grad_scaled.to(dtype)
        d_own = (grad_scaled.to(dtype) @ v_own.transpose(-1, -2)).float().sub_(delta).mul_(own).to(dtype)
        d_q_own, d_k_own = d_own @ k_own, d_own.transpose(-1, -2) @ q_own

        grad_pairs = _tiled(grad_scaled, group, 0.0).gather(1, _with_dim(to_tile, dim))  # [N, P, h, G, B, d]
        delta_pairs = _tiled(delta, group, 0.0).gather(1, to_tile[..., None])  # [N, P, h, G, B, 1]
        grad_pairs = grad_pairs.to(dtype).view(*q_pairs.shape)  # [N, P, kv_h, rows, d]
        d_v_pairs = weights.to(dtype).transpose(-1, -2) @ grad_pairs
        d_scores = (grad_pairs @ v_pairs.transpose(-1, -2)).float().view(scores.shape)
        d_scores = d_scores.sub_(delta_pairs).mul_(scores).to(dtype).view(weights.shape)  # hidden: weight 0
        d_q_pairs, d_k_pairs = d_scores @ k_pairs, d_scores.transpose(-1, -2) @ q_pairs
        return d_q_own, d_k_own, d_v_own, d_q_pairs, d_k_pairs, d_v_pairs, None, None, None


def _with_dim(to_tile: torch.Tensor, dim: int) -> torch.Tensor:
    """to_tile [N, P, h, G, B] expanded over a last dim of `dim`."""
    return to_tile[..., None].expand(*to_tile.shape, dim)


def _tiled(x: torch.Tensor, group: int, pad: float) -> torch.Tensor:
    """[N, h, A, B, ...] -> [N, A'/G, h, G, B, ...] (A' = A padded with `pad` to a multiple of G)."""
    x = _padded(x.transpose(1, 2), group, pad)
    return x.view(x.shape[0], -1, group, *x.shape[2:]).transpose(2, 3)


def _untiled(x: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[N, A'/G, h, G, B, ...] -> [N, h, A, B, ...] (the padding blocks dropped)."""
    n, num_tiles, heads, group = x.shape[:4]
    x = x.transpose(2, 3).reshape(n, num_tiles * group, heads, *x.shape[4:])[:, :num_blocks]
    return x.transpose(1, 2)
