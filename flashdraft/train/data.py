"""Training batches: sequences with their context features, anchors, blocks and labels.

Everything random about a sequence (its anchors) is drawn from a generator seeded by
(seed, epoch, record index), so a batch is the same whatever the world size, and a resumed
run sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from flashdraft.drafter.model import PAD_POSITION
from flashdraft.drafter.packed_attention import ContextTiles
from flashdraft.target.image_files import record_images
from flashdraft.train.blocks import IGNORE, build_blocks, sample_anchors
from flashdraft.train.host_memory import FeatureBuffers

FRESH = FeatureBuffers()  # a fresh buffer for every batch (none kept)


class TrainRecord(Protocol):
    """A sequence as stored by the cache (`flashdraft.data.cache_reader.CachedRecord`)."""

    input_ids: torch.Tensor  # [T] long, prompt + completion
    loss_mask: torch.Tensor  # [T] bool, True on completion tokens
    context_features: torch.Tensor | None  # [T, n * H]
    target_topk: tuple[torch.Tensor, torch.Tensor] | None  # ([T, k], [T, k])
    # optional `drafter_positions` [T]: the drafter's positions as served beside images (M-RoPE's row 0); absent or
    # None: the token index (`served_positions`)


@dataclass
class Batch:
    record_indices: list[int]
    context_features: torch.Tensor  # [N, T, n * H]
    context_positions: torch.Tensor  # [N, T]; PAD_POSITION on padding
    block_ids: torch.Tensor  # [N, K * B]
    anchor_positions: torch.Tensor  # [N, K]
    labels: torch.Tensor  # [N, K * B]; IGNORE where untrained
    target_topk: tuple[torch.Tensor, torch.Tensor] | None  # ([N, K * B, k], ...) aligned with labels
    # packed rows (`train.packing`): (anchor_documents [N, K], context_documents [N, C]), each block's and context
    # token's document in its row (-1 on padding); None: one record per row
    documents: tuple[torch.Tensor, torch.Tensor] | None = None
    # packed rows: the (block, context key tile) pairs whose scores the attention computes (`packed_attention`)
    context_tiles: ContextTiles | None = None

    def to(self, device: torch.device | str) -> Batch:
        """On `device`; the copies non-blocking (they overlap where the batch is pinned, `pin_memory`)."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:
        """Its tensors in pinned memory (a prefetched batch, for a GPU)."""
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> Batch:
        tiles = self.context_tiles
        if tiles is not None:
            tiles = replace(tiles, block_tile=fn(tiles.block_tile), key_tile=fn(tiles.key_tile), valid=fn(tiles.valid))
        return replace(
            self,
            documents=None if self.documents is None else tuple(fn(t) for t in self.documents),
            context_tiles=tiles,
            context_features=fn(self.context_features),
            context_positions=fn(self.context_positions),
            block_ids=fn(self.block_ids),
            anchor_positions=fn(self.anchor_positions),
            labels=fn(self.labels),
            target_topk=None if self.target_topk is None else tuple(fn(t) for t in self.target_topk),
        )

    def context_reach(self, block_size: int) -> int:
        """The longest context a block of the batch trains at: its anchor's position (the context before it) plus
        the block, i.e. one past the furthest position a block query is rotated to."""
        return int(self.anchor_positions.max()) + block_size

    def with_labels_in(self, vocabulary: torch.Tensor | None) -> Batch:
        """Only labels inside `vocabulary` ([V] bool, a drafter's reduced vocabulary) stay trained:
        a drafter cannot draft the others, so they are not its loss (None: all labels)."""
        if vocabulary is None:
            return self
        labels = self.labels.clone()
        trained = labels != IGNORE
        labels[trained & ~vocabulary.to(labels.device)[labels.clamp(min=0)]] = IGNORE
        return replace(self, labels=labels)


def served_positions(record: TrainRecord, length: int) -> torch.Tensor:
    """[length] the drafter's positions of a record's first `length` tokens: as served beside its images (a
    vision-language target, `flashdraft.target.vision`), else the token index."""
    positions = getattr(record, "drafter_positions", None)
    return torch.arange(length) if positions is None else positions[:length].long()


def record_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_033 + index)


def length_bucket(n: int) -> int:
    """n rounded up to one of four sizes per power of two (..., 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...): a batch
    padded to its bucket wastes under 25 % of its slots, and flex attention, compiled for fixed shapes
    (`dynamic=False`), sees four shapes per doubling of the longest record, not one per length."""
    if n <= 4:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


@dataclass(frozen=True)
class BatchSpec:
    """How records are cut into a training batch: `num_anchors` blocks per record (sampled with `seed`, epoch and
    record index), of `block_size` tokens in the layout whose first drafting position is `first_draft` (1 fill-in,
    0 anchor-first), masked with `mask_token_id`, sequences cut to `max_length` (None: whole); the context length
    and the number of blocks padded up to their `length_bucket` (bucket) or to the batch's longest (not); the context
    features built in a buffer from `buffers` (a run's, reused or pinned: `train.host_memory`; None: a fresh one)."""

    seed: int
    num_anchors: int
    block_size: int
    mask_token_id: int
    max_length: int | None = None
    first_draft: int = 1
    bucket: bool = True
    buffers: FeatureBuffers | None = None


@dataclass
class RecordBlocks:
    """One record cut into its training blocks (`record_blocks`)."""

    features: torch.Tensor  # [T, n * H] its context features (cut to the batch's max length)
    anchors: torch.Tensor  # [K]
    block_ids: torch.Tensor  # [K * B]
    labels: torch.Tensor  # [K * B]
    target_topk: tuple[torch.Tensor, torch.Tensor] | None  # ([K * B, k], ...) aligned with labels


def record_blocks(record: TrainRecord, index: int, epoch: int, batch_spec: BatchSpec) -> RecordBlocks:
    """A record's anchors (drawn with (seed, epoch, index): the same packed or not), blocks and labels, in the layout
    whose first drafting position is `batch_spec.first_draft` (1 fill-in, 0 anchor-first)."""
    block_size, first_draft, max_length = batch_spec.block_size, batch_spec.first_draft, batch_spec.max_length
    seq_len = len(record.input_ids) if max_length is None else min(len(record.input_ids), max_length)
    ids, loss_mask = record.input_ids[:seq_len].long(), record.loss_mask[:seq_len].bool()
    anchors = sample_anchors(loss_mask, batch_spec.num_anchors, record_generator(batch_spec.seed, epoch, index))
    block_ids, labels = build_blocks(ids, loss_mask, anchors, block_size, batch_spec.mask_token_id, first_draft)
    topk = None
    if record.target_topk is not None:
        # the target's logits at position t predict token t + 1: the label of block position k sits at
        # anchor + k + 1 - first_draft, so it is row anchor + k - first_draft
        rows_for_labels = (anchors[:, None] + torch.arange(block_size) - first_draft).clamp(0, seq_len - 1)
        rows_for_labels = rows_for_labels.reshape(-1)
        topk = tuple(t[:seq_len][rows_for_labels] for t in record.target_topk)
    return RecordBlocks(record.context_features[:seq_len], anchors, block_ids, labels, topk)


def make_batch(records: list[TrainRecord], indices: list[int], epoch: int, batch_spec: BatchSpec) -> Batch:
    """Pad the sequences (context) and their blocks (anchors) into one batch, labelled in the layout whose first
    drafting position is `batch_spec.first_draft` (1 fill-in, 0 anchor-first)."""
    block_size = batch_spec.block_size
    rows = []
    for record, index in zip(records, indices, strict=True):
        r = record_blocks(record, index, epoch, batch_spec)
        rows.append((r.features, r.anchors, r.block_ids, r.labels, r.target_topk))

    n = len(rows)
    max_t = max(r[0].shape[0] for r in rows)
    max_k = max(len(r[1]) for r in rows)
    if batch_spec.bucket:  # padding slots and padding blocks are never trained nor seen: the loss is unchanged
        max_t, max_k = length_bucket(max_t), max(max_k, min(length_bucket(max_k), batch_spec.num_anchors))
    feat_dim = rows[0][0].shape[1]
    # empty, the padding zeroed below: zeros then the copy would write the batch's largest tensor twice
    features = (batch_spec.buffers or FRESH).take((n, max_t, feat_dim), rows[0][0].dtype)  # [N, T, n * H]
    positions = torch.full((n, max_t), PAD_POSITION, dtype=torch.long)
    block_ids = torch.full((n, max_k * block_size), batch_spec.mask_token_id, dtype=torch.long)
    anchors = torch.zeros(n, max_k, dtype=torch.long)  # padding blocks: anchor 0, labels ignored
    labels = torch.full((n, max_k * block_size), IGNORE, dtype=torch.long)
    topk = None
    if rows[0][4] is not None:
        k = rows[0][4][0].shape[-1]
        topk = (torch.zeros(n, max_k * block_size, k), torch.zeros(n, max_k * block_size, k, dtype=torch.long))
    for i, (feat, anc, blk, lab, tk) in enumerate(rows):
        t, q = feat.shape[0], blk.shape[0]
        features[i, :t], features[i, t:] = feat, 0
        served = served_positions(records[i], t)  # the token index, or M-RoPE's row 0 beside images
        positions[i, :t] = served
        anchors[i, : len(anc)] = served[anc]
        block_ids[i, :q], labels[i, :q] = blk, lab
        if topk is not None:
            topk[0][i, :q], topk[1][i, :q] = tk[0].float(), tk[1].long()
    return Batch(list(indices), features, positions, block_ids, anchors, labels, topk)


def add_context_noise(batch: Batch, std: float, generator: torch.Generator) -> Batch:
    """Gaussian noise on the context features only. Labels and target logits are never
    touched (failure mode 1 of the reference doc: noise on the label path)."""
    if std <= 0:
        return batch
    noise = torch.randn(batch.context_features.shape, generator=generator) * std
    return replace(batch, context_features=batch.context_features + noise.to(batch.context_features))


class OnlineRecords:
    """Records whose context features come from running the frozen target now, for users who
    cannot store a cache. `records` need input_ids and loss_mask (e.g. completions)."""

    def __init__(self, records: list, target, layer_ids: list[int], topk: int = 0) -> None:
        # topk > 0: also the target's top-k logits at every position (a DSpark drafter's distribution terms)
        self.records, self.target, self.layer_ids, self.topk = records, target, layer_ids, topk

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> TrainRecord:
        record = self.records[i]
        self.target.set_context_layers(self.layer_ids)
        with record_images(self.target, record):  # its images, where it has any
            out = self.target.forward(record.input_ids[None].to(self.target.device))
        topk = None
        if self.topk:
            values, indices = out.logits[0].float().topk(self.topk, dim=-1)  # [T, k], as the cache stores them
            topk = (values.cpu(), indices.cpu())
        positions = getattr(record, "drafter_positions", None)
        return _Online(record.input_ids, record.loss_mask, out.context_features[0].cpu(), topk, positions)


@dataclass
class _Online:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    context_features: torch.Tensor
    target_topk: tuple | None
    drafter_positions: torch.Tensor | None = None
