"""One training step's parts: the loss of a micro-batch."""

from dataclasses import replace

import torch

from flashdraft.drafter.model import flex_shapes
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import BatchSpec, OnlineRecords, length_bucket, make_batch
from flashdraft.train.step import forward_loss, loss_spec
from tests.conftest import MASK, make_drafter
from tests.train.helpers import Record


def test_online_features_give_the_same_loss_as_cached_features(target, records):
    online = OnlineRecords(records, target, [0, 2])
    drafter = make_drafter()
    cfg = TrainConfig(epochs=10, max_steps=6, batch_size=2, lr=3e-3, num_anchors=6)
    cached = make_batch(
        [records[1], records[2]],
        [1, 2],
        0,
        batch_spec=BatchSpec(seed=0, num_anchors=6, block_size=8, mask_token_id=MASK),
    )
    live = make_batch(
        [online[1], online[2]], [1, 2], 0, batch_spec=BatchSpec(seed=0, num_anchors=6, block_size=8, mask_token_id=MASK)
    )
    a = forward_loss(drafter, target, cached, loss_spec(cfg, drafter))
    b = forward_loss(drafter, target, live, loss_spec(cfg, drafter))
    torch.testing.assert_close(a.weighted_sum, b.weighted_sum)


def _cut(record, length: int) -> Record:
    return Record(record.input_ids[:length], record.loss_mask[:length], record.context_features[:length], None)


def test_batches_of_five_lengths_hand_flex_attention_one_shape_per_length_bucket_and_padding_leaves_the_loss(
    target, records
):
    drafter = make_drafter()
    drafter.attention_backend = "flex"  # on CPU uncompiled: the shapes it is handed are what a GPU compiles
    cfg = TrainConfig(num_anchors=6, loss_weighting="decay")
    lengths = [17, 19, 21, 23, 26]  # buckets 20, 20, 24, 24, 28
    spec = BatchSpec(seed=0, num_anchors=6, block_size=8, mask_token_id=MASK)
    batches = [[_cut(record, n), _cut(records[7], n - 2)] for n, record in zip(lengths, records, strict=False)]
    shapes_before = len(flex_shapes)
    with torch.no_grad():  # flex attention has no backward on CPU
        bucketed = [
            forward_loss(drafter, target, make_batch(b, [0, 7], 0, spec), loss_spec(cfg, drafter)) for b in batches
        ]
        assert len(flex_shapes) - shapes_before <= len({length_bucket(n) for n in lengths}) == 3
        for batch, parts, length in zip(batches, bucketed, lengths, strict=True):
            tight = make_batch(batch, [0, 7], 0, replace(spec, bucket=False))
            assert tight.context_features.shape[1] == length < length_bucket(length)
            loss = forward_loss(drafter, target, tight, loss_spec(cfg, drafter))
            torch.testing.assert_close(parts.weighted_sum, loss.weighted_sum)  # padding is never seen nor trained
