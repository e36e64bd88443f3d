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

The pairs are scored by the CPU's fused attention kernel (the one `scaled_dot_product_attention` runs there), one call
batched over the pairs: its scores stay in cache-sized tiles, where the same softmax by autograd's elementwise ops
made about a dozen passes over a [pairs, heads, G x B queries, T keys] tensor and cost about 3x a dense score. The
pairs' parts and the own block's are merged by their log-sum-exps, and the backward hands each part the merged
output and log-sum-exp (`_PairAttention`). In eager the padding pairs are dropped (the kernel's batch is the batch's
own pairs); compiled, they stay, fully hidden, so the shape is the run's one. On a GPU flex attention does this work
(its block mask), and the dense path with the documents' mask is the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.drafter.config import LayerAttention

KEY_TILE = 128  # context keys per tile (16 x 128 measured fastest on CPU among 8-32 x 64-256, benchmarks/packing.py)
BLOCK_TILE = 16  # blocks per query tile: a gathered key tile serves this many blocks, a query tile that many key tiles


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
    and its own block's ([N, kv_h, Q, d]): one softmax over both per query (fp32), as `blockwise_attention`'s.
    CPU tensors (the fused kernel is the CPU one; on a GPU flex attention does this work)."""
    n, heads, q_len, dim = q.shape
    k_ctx, v_ctx = context_kv
    kv_heads, num_context = k_ctx.shape[1], k_ctx.shape[2]
    tiles, block = mask.tiles, mask.own_block.shape[0]
    size, group = tiles.key_tile_size, tiles.block_tile_size
    num_blocks, per_head = q_len // block, heads // kv_heads
    rows = per_head * group * block  # a pair's query rows, (per_head, G, B) per kv head

    # the own block's queries and keys [N, h, A, B, d] (the scale on q: fewer elements than on the scores)
    q_blocks = (q * dim**-0.5).view(n, heads, num_blocks, block, dim)
    k_blk, v_blk = (t.repeat_interleave(per_head, dim=1).view(q_blocks.shape) for t in block_kv)

    # the pairs, flat over the batch's rows: the padding pairs dropped (eager: the shape is this batch's; compiled:
    # kept, fully hidden, so the shape stays the run's one)
    pairs = torch.arange(tiles.valid.numel(), device=q.device)
    if not torch.compiler.is_compiling():
        pairs = tiles.valid.view(-1).nonzero().squeeze(1) if bool(tiles.valid.any()) else pairs[:1]
    num_tiles = -(-num_blocks // group)
    row = torch.arange(n, device=q.device)[:, None]
    pair_tile = (row * num_tiles + tiles.block_tile).view(-1)[pairs]  # [K]: the pair's block tile, flat
    pair_keys = (row * -(-num_context // size) + tiles.key_tile).view(-1)[pairs]  # [K]: its key tile, flat
    k_pairs, v_pairs = (
        torch.nn.functional.pad(t, (0, 0, 0, -num_context % size))
        .view(n, kv_heads, -1, size, dim)
        .transpose(1, 2)
        .reshape(-1, kv_heads, size, dim)
        .index_select(0, pair_keys)
        for t in (k_ctx, v_ctx)
    )  # [K, kv_h, T, d]
    q_tiles = _padded(q_blocks.transpose(1, 2), group, 0)  # [N, A', h, B, d], A' a multiple of G
    q_tiles = q_tiles.view(n, num_tiles, group, kv_heads, per_head, block, dim).permute(0, 1, 3, 4, 2, 5, 6)
    q_pairs = q_tiles.reshape(-1, kv_heads, rows, dim).index_select(0, pair_tile)  # [K, kv_h, rows, d]
    # what each pair's query rows see of its key tile [K, 1, rows, T]: the kernel's mask, additive in q's dtype
    sees = mask.context.flatten(0, 1)[pairs][:, None].expand(-1, per_head, -1, block, -1).reshape(-1, 1, rows, size)
    bias = torch.zeros(sees.shape, dtype=q.dtype, device=q.device).masked_fill_(~sees, float("-inf"))
    own, paired = (q_blocks, k_blk, v_blk), (q_pairs, k_pairs, v_pairs)
    out = _PairAttention.apply(*own, *paired, ~mask.own_block, bias, sees.any(-1), pair_tile)  # [N, h, A, B, d]
    return out.reshape(n, heads, q_len, dim)


class _PairAttention(torch.autograd.Function):
    """The attention of each query over its pairs' keys and its own block's, one softmax over all of them.

    The pairs are one call of the fused CPU attention kernel (`_scaled_dot_product_flash_attention_for_cpu`, batched
    over the pairs: the scores never leave its cache-sized tiles, where the same ops by autograd made about a dozen
    passes over a [pairs, h, G, B, T] tensor, each into a new one), which gives each pair's output and log-sum-exp
    per query; the own block [B, B] is small and done here. The parts are merged by their log-sum-exps (each part's
    output weighted by its share of the query's total), and the backward hands each part the merged output and
    log-sum-exp, from which the softmax backward gives that part's exact share of the gradient (the identity ring
    attention rests on).

    Inputs: the own block's q (scaled), k, v [N, h, A, B, d]; the K pairs' q [K, kv_h, per_head * G * B, d], k and v
    [K, kv_h, T, d]; what is hidden within a block [B, B]; the pairs' additive mask [K, 1, rows, T] and whether a
    row sees any key of its pair [K, 1, rows]; pair_tile [K]: each pair's block tile (flat over the rows, row *
    A'/G + tile). Output [N, h, A, B, d] in q's dtype."""

    @staticmethod
    def forward(ctx, q_own, k_own, v_own, q_pairs, k_pairs, v_pairs, hidden_own, bias, sees_any, pair_tile):
        n, heads, num_blocks, block, dim = q_own.shape
        group, dtype = q_pairs.shape[2] * q_pairs.shape[1] // heads // block, q_own.dtype
        wide = torch.promote_types(dtype, torch.float32)  # the softmax's dtype: float32, float64 for float64
        pair_out, pair_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_pairs, k_pairs, v_pairs, attn_mask=bias, scale=1.0
        )  # [K, kv_h, rows, d], [K, kv_h, rows]; a row that sees nothing: 0 and 0
        ctx.lse_dtype = pair_lse.dtype
        pair_lse = pair_lse.to(wide).masked_fill(~sees_any, float("-inf")).view(-1, heads, group, block)
        own = (q_own @ k_own.transpose(-1, -2)).to(wide).masked_fill_(hidden_own, float("-inf"))  # [N, h, A, B, B]
        own_lse = own.logsumexp(-1)  # [N, h, A, B]: a query always sees itself
        own_out = own.sub_(own_lse[..., None]).exp_().to(dtype) @ v_own  # [N, h, A, B, d]
        # the merged log-sum-exp per query [N * A'/G, h, G, B] (padding blocks: their own block's, finite)
        own_lse_tiled = _tiled(own_lse, group, 0.0)
        to_tile = pair_tile[:, None, None, None].expand(pair_lse.shape)  # [K, h, G, B]
        top = own_lse_tiled.scatter_reduce(0, to_tile, pair_lse, "amax", include_self=True)
        total = (
            (own_lse_tiled - top).exp_().index_add_(0, pair_tile, (pair_lse - top.index_select(0, pair_tile)).exp_())
        )
        lse = top.add_(total.log_())
        pair_share = (pair_lse - lse.index_select(0, pair_tile)).exp_()[..., None]  # [K, h, G, B, 1]
        own_share = (own_lse - _untiled(lse, n, num_blocks)).exp_()[..., None]  # [N, h, A, B, 1]
        out = _tiled(own_out.to(wide) * own_share, group, 0.0)  # [N * A'/G, h, G, B, d]
        out = out.index_add(0, pair_tile, pair_out.to(wide).view(*pair_share.shape[:-1], dim).mul_(pair_share))
        own = own.mul_(own_share)  # the own block's merged weights [N, h, A, B, B], for the backward
        out = _untiled(out, n, num_blocks)  # [N, h, A, B, d]
        ctx.save_for_backward(q_own, k_own, v_own, q_pairs, k_pairs, v_pairs, own, bias, pair_tile, out, lse)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q_own, k_own, v_own, q_pairs, k_pairs, v_pairs, own, bias, pair_tile, out, lse = ctx.saved_tensors
        dtype = q_own.dtype
        group, wide = lse.shape[2], torch.promote_types(dtype, torch.float32)
        grad_out = grad_out.to(wide)
        # the own block: softmax backward with its merged weights, weight * (d weight - sum(grad_out * out))
        delta = (grad_out * out).sum(-1, keepdim=True)  # [N, h, A, B, 1]
        d_v_own = own.to(dtype).transpose(-1, -2) @ grad_out.to(dtype)
        d_own = (grad_out.to(dtype) @ v_own.transpose(-1, -2)).to(wide).sub_(delta).mul_(own).to(dtype)
        d_q_own, d_k_own = d_own @ k_own, d_own.transpose(-1, -2) @ q_own

        def per_pair(x: torch.Tensor) -> torch.Tensor:  # [N, h, A, B, ...] -> [K, kv_h, rows, ...]
            return (
                _tiled(x, group, 0.0).index_select(0, pair_tile).to(x.dtype).reshape(*q_pairs.shape[:3], *x.shape[4:])
            )

        # the pairs: the kernel's backward, given each row's merged output and log-sum-exp
        d_q_pairs, d_k_pairs, d_v_pairs = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            per_pair(grad_out.to(dtype)),
            q_pairs,
            k_pairs,
            v_pairs,
            per_pair(out.to(dtype)),
            lse.index_select(0, pair_tile).reshape(q_pairs.shape[:3]).to(ctx.lse_dtype),
            0.0,
            False,
            attn_mask=bias,
            scale=1.0,
        )
        return d_q_own, d_k_own, d_v_own, d_q_pairs, d_k_pairs, d_v_pairs, None, None, None, None


def _tiled(x: torch.Tensor, group: int, pad: float) -> torch.Tensor:
    """[N, h, A, B, ...] -> [N * A'/G, h, G, B, ...] (A' = A padded with `pad` to a multiple of G)."""
    x = _padded(x.transpose(1, 2), group, pad)  # [N, A', h, B, ...]
    return x.view(-1, group, *x.shape[2:]).transpose(1, 2)


def _untiled(x: torch.Tensor, n: int, num_blocks: int) -> torch.Tensor:
    """[N * A'/G, h, G, B, ...] -> [N, h, A, B, ...] (the padding blocks dropped)."""
    x = x.transpose(1, 2).reshape(n, -1, *x.shape[1:2], *x.shape[3:])[:, :num_blocks]
    return x.transpose(1, 2)
