"""One training step's parts: the loss of a micro-batch."""

import torch

from flashdraft.train.config import TrainConfig
from flashdraft.train.data import BatchSpec, OnlineRecords, make_batch
from flashdraft.train.step import forward_loss, loss_spec
from tests.conftest import MASK, make_drafter


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
