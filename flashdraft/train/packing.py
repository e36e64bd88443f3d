"""Packed training (`--pack-length L`): records packed into rows of exactly L context tokens and A blocks, so every
batch has one shape and little padding.

What packing keeps: each record is a document of its row, its position ids restart at 0 (RoPE as at serving), its
blocks see only its own context (`drafter.model.attention_mask`'s documents) and its own block, its anchors are
drawn exactly as unpacked (`--num-anchors` per document, the generator of (seed, epoch, record index)), and every
loss term is per block: a packed row's loss and gradients are the sum of its documents' unpacked ones.

The rows are a function of the records and the settings alone (first-fit decreasing, ties by record index), made
once per run; each epoch shuffles them with (seed, epoch). A record longer than L (after --max-length) is cut to
its first L tokens, alone in its row, and the run's first lines say how many were. The rows need only the records'
loss masks (a cache's, or the completions' with the target in process or the engine feeding), so an engine is asked
for the records row by row (`step.stream_order`), and a packed batch is made from them as from a cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from flashdraft.drafter.model import PAD_POSITION
from flashdraft.drafter.packed_attention import BLOCK_TILE, KEY_TILE, ContextTiles, row_tile_pairs
from flashdraft.errors import FlashdraftError
from flashdraft.train.blocks import IGNORE, candidate_anchors
from flashdraft.train.data import FRESH, Batch, BatchSpec, record_blocks, served_positions

BLOCK_SLACK = 1.25  # a row's block capacity over the blocks its L tokens hold on average
# tiled attention where it scores at most this share of the dense path's scores: a tiled score (the fused kernel) costs
# less than a dense one where rows hold several documents (the dense path's hidden scores), about as much where a row
# is one record (attention alone, forward and backward, an epoch: the long-tailed mix, 1.12 of the dense scores,
# tiled 2.6x faster; the built-in mix, one record of 144 tokens a row, 1.6: tiled 0.68x; benchmarks/packing.py's)
TILED_SHARE = 1.25


@dataclass(frozen=True)
class PackPlan:
    """The run's packed rows: `rows[r]` the record indices of row r (each record in exactly one row)."""

    rows: list[list[int]]
    length: int  # L: context tokens per row
    blocks: int  # A: blocks per row
    feature_dim: int  # the records' context feature width (a row may hold none)
    topk: int  # the records' stored target top-k width (0: none)
    cut: int  # records longer than L, cut to their first L tokens
    # (block tile, context key tile) pairs of the row that has the most: every batch's (one shape); 0: dense attention
    tile_pairs: int = 0

    def lines(self, num_records: int) -> list[str]:
        """What the run's first lines say about the packing."""
        line = (
            f"packed {num_records} records into {len(self.rows)} rows of {self.length} tokens and {self.blocks} "
            f"blocks (--pack-length; --batch-size counts rows)"
        )
        if self.cut:
            line += (
                f"; {self.cut} records longer than {self.length} tokens cut to it (raise --pack-length to keep them)"
            )
        return [line]


def _loss_masks(records) -> list[torch.Tensor]:
    """Every record's loss mask, read without its features where the source can (a cache, online sequences)."""
    if hasattr(records, "loss_masks"):
        return records.loss_masks()
    if hasattr(records, "records"):  # online: the sequences the target runs on
        return [r.loss_mask for r in records.records]
    return [records[i].loss_mask for i in range(len(records))]


def record_sizes(records, length: int, num_anchors: int, max_length: int | None) -> tuple[list[int], list[int], int]:
    """(tokens, blocks) of each record as packed: its tokens cut to --max-length and L, and its anchors
    min(num_anchors, candidates) (how many the sampler draws: a count, not which); and how many records L cut."""
    cap = length if max_length is None else min(length, max_length)
    tokens, blocks, cut = [], [], 0
    for mask in _loss_masks(records):
        kept = mask[:cap].bool()
        tokens.append(len(kept))
        blocks.append(min(num_anchors, len(candidate_anchors(kept))))
        cut += min(len(mask), max_length or len(mask)) > length
    return tokens, blocks, cut


def first_fit_decreasing(tokens: list[int], blocks: list[int], length: int, capacity: int) -> list[list[int]]:
    """Records (sizes `tokens`, `blocks`) into rows of at most `length` tokens and `capacity` blocks: the longest
    first (ties by index), each into the first row it fits, else a new one. Deterministic."""
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    room_tokens = torch.empty(0, dtype=torch.long)
    room_blocks = torch.empty(0, dtype=torch.long)
    rows: list[list[int]] = []
    for i in order:
        fits = ((room_tokens >= tokens[i]) & (room_blocks >= blocks[i])).nonzero()
        if len(fits):
            r = int(fits[0])
        else:
            r = len(rows)
            rows.append([])
            room_tokens = torch.cat([room_tokens, torch.tensor([length])])
            room_blocks = torch.cat([room_blocks, torch.tensor([capacity])])
        rows[r].append(i)
        room_tokens[r] -= tokens[i]
        room_blocks[r] -= blocks[i]
    return rows


def balanced_rows(tokens: list[int], blocks: list[int], length: int, num_rows: int) -> list[list[int]] | None:
    """Records (sizes `tokens`, `blocks`) spread over exactly `num_rows` rows of at most `length` tokens, as evenly
    in blocks as they go: the longest first (ties by index), each into the row with room for its tokens that holds
    the fewest blocks (then tokens, then the first). None when a record finds no row with room. Deterministic."""
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    held_tokens = torch.zeros(num_rows, dtype=torch.long)
    held_blocks = torch.zeros(num_rows, dtype=torch.long)
    rows: list[list[int]] = [[] for _ in range(num_rows)]
    for i in order:
        fits = (held_tokens + tokens[i] <= length).nonzero().squeeze(1)
        if not len(fits):
            return None
        key = held_blocks[fits] * (length + 1) + held_tokens[fits]  # fewest blocks, then fewest tokens
        r = int(fits[int(key.argmin())])
        rows[r].append(i)
        held_tokens[r] += tokens[i]
        held_blocks[r] += blocks[i]
    return rows


def pack_plan(
    records, length: int, num_anchors: int, max_length: int | None, rows_multiple: int = 1, tiles: bool | None = None
) -> PackPlan:
    """The run's rows of `length` tokens and A blocks: packed with room for the blocks `length` tokens of these
    records hold on average plus a quarter (at least the most one record has), A then the fullest row's blocks.
    `rows_multiple` (the global batch, in rows): when first-fit leaves the last global batch part empty, the records
    are spread evenly over a whole number of global batches instead (`balanced_rows`), so no step computes empty
    rows and the fullest row, hence A, holds fewer blocks. `tiles`: the rows' attention over (block tile, key tile)
    pairs (`drafter.packed_attention`); None: where it scores under TILED_SHARE of the dense path's scores (rows of
    several documents of different lengths), else the dense path (`tile_pairs` 0)."""
    tokens, blocks, cut = record_sizes(records, length, num_anchors, max_length)
    if not tokens:
        raise FlashdraftError("--pack-length: no training records to pack")
    capacity = max(max(blocks), math.ceil(BLOCK_SLACK * length * sum(blocks) / max(1, sum(tokens))), 1)
    rows = first_fit_decreasing(tokens, blocks, length, capacity)
    if len(rows) % rows_multiple:
        whole = -(-len(rows) // rows_multiple) * rows_multiple
        rows = balanced_rows(tokens, blocks, length, whole) or rows
    capacity = max(1, max(sum(blocks[i] for i in row) for row in rows))  # the fullest row's: no row pads more
    tile_pairs = max(len(row_tile_pairs([tokens[i] for i in row], [blocks[i] for i in row])) for row in rows)
    if tiles is None:  # scores a row computes: tiled (pairs x G blocks x T keys) against dense (A blocks x L keys)
        tiles = tile_pairs * BLOCK_TILE * KEY_TILE <= TILED_SHARE * capacity * length
    tile_pairs = max(1, tile_pairs) if tiles else 0
    if hasattr(records, "feature_dim"):  # a stream (the engine): its width is known, no record is read ahead of it
        feature_dim, topk = records.feature_dim, 0
    else:
        first = records[rows[0][0]]
        feature_dim = first.context_features.shape[-1]
        topk = 0 if first.target_topk is None else first.target_topk[0].shape[-1]
    return PackPlan(rows, length, capacity, feature_dim, topk, cut, tile_pairs)


def make_packed_batch(records, rows: list[list[int]], epoch: int, batch_spec: BatchSpec, plan: PackPlan) -> Batch:
    """Rows of `plan.length` context tokens and `plan.blocks` blocks: each record a document with positions from 0,
    its blocks and labels exactly as `make_batch` makes them (`record_blocks`), padding after the last."""
    block_size, length = batch_spec.block_size, plan.length
    cap = length if batch_spec.max_length is None else min(length, batch_spec.max_length)
    spec = replace(batch_spec, max_length=cap)
    fetched = [[records[i] for i in row] for row in rows]  # each read once: an engine's stream hands them in order
    docs = [
        [record_blocks(r, i, epoch, spec) for r, i in zip(rs, row, strict=True)]
        for rs, row in zip(fetched, rows, strict=True)
    ]
    n, q_len = len(rows), plan.blocks * block_size
    dtype = next((d[0].features.dtype for d in docs if d), torch.float32)
    # [N, L, n * H]; the padding zeroed below
    features = (batch_spec.buffers or FRESH).take((n, length, plan.feature_dim), dtype)
    positions = torch.full((n, length), PAD_POSITION, dtype=torch.long)  # [N, L], from 0 in each document
    context_documents = torch.full((n, length), -1, dtype=torch.long)  # [N, L]
    anchors = torch.zeros(n, plan.blocks, dtype=torch.long)  # [N, A]; padding blocks: anchor 0, labels ignored
    anchor_documents = torch.full((n, plan.blocks), -1, dtype=torch.long)  # [N, A]
    block_ids = torch.full((n, q_len), batch_spec.mask_token_id, dtype=torch.long)  # [N, A * B]
    labels = torch.full((n, q_len), IGNORE, dtype=torch.long)
    topk = None
    if plan.topk:
        topk = (torch.zeros(n, q_len, plan.topk), torch.zeros(n, q_len, plan.topk, dtype=torch.long))
    for i, row in enumerate(docs):
        t = k = 0
        for d, doc in enumerate(row):
            dt, dk = doc.features.shape[0], len(doc.anchors)
            features[i, t : t + dt] = doc.features
            served = served_positions(fetched[i][d], dt)  # the token index, or M-RoPE's row 0 beside images
            positions[i, t : t + dt] = served
            context_documents[i, t : t + dt] = d
            anchors[i, k : k + dk], anchor_documents[i, k : k + dk] = served[doc.anchors], d
            blocks = slice(k * block_size, (k + dk) * block_size)
            block_ids[i, blocks], labels[i, blocks] = doc.block_ids, doc.labels
            if topk is not None:
                topk[0][i, blocks], topk[1][i, blocks] = doc.target_topk[0].float(), doc.target_topk[1].long()
            t, k = t + dt, k + dk
        features[i, t:] = 0
    indices = [i for row in rows for i in row]
    tiles = None
    if plan.tile_pairs:  # [N, P]: which context tiles each block's scores cover
        pairs = [row_tile_pairs([d.features.shape[0] for d in row], [len(d.anchors) for d in row]) for row in docs]
        tiles = ContextTiles.of_rows(pairs, plan.tile_pairs)
    documents = (anchor_documents, context_documents)
    return Batch(indices, features, positions, block_ids, anchors, labels, topk, documents, tiles)
