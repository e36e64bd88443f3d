import torch

from flashdraft.train.data import BatchSpec, add_context_noise, make_batch
from tests.conftest import MASK, make_target
from tests.train.helpers import make_records


def test_noise_touches_context_features_only_labels_and_target_logits_bit_identical():
    records = make_records(make_target("qwen3"), n=2, topk=4)
    clean = make_batch(
        records, [0, 1], 0, batch_spec=BatchSpec(seed=0, num_anchors=8, block_size=4, mask_token_id=MASK)
    )
    noisy = add_context_noise(clean, 0.5, torch.Generator().manual_seed(0))
    assert not torch.equal(noisy.context_features, clean.context_features)
    assert torch.equal(noisy.labels, clean.labels)
    assert torch.equal(noisy.block_ids, clean.block_ids)
    assert torch.equal(noisy.target_topk[0], clean.target_topk[0])
    assert torch.equal(noisy.target_topk[1], clean.target_topk[1])
    # and the records themselves are untouched
    again = make_batch(
        records, [0, 1], 0, batch_spec=BatchSpec(seed=0, num_anchors=8, block_size=4, mask_token_id=MASK)
    )
    assert torch.equal(again.context_features, clean.context_features)


def test_batch_is_a_function_of_seed_epoch_and_record_index_only():
    records = make_records(make_target("qwen3"), n=3)
    a = make_batch(
        [records[2], records[0]],
        [2, 0],
        1,
        batch_spec=BatchSpec(seed=5, num_anchors=3, block_size=4, mask_token_id=MASK),
    )
    b = make_batch([records[2]], [2], 1, batch_spec=BatchSpec(seed=5, num_anchors=3, block_size=4, mask_token_id=MASK))
    assert torch.equal(a.anchor_positions[0], b.anchor_positions[0])
    c = make_batch([records[2]], [2], 2, batch_spec=BatchSpec(seed=5, num_anchors=3, block_size=4, mask_token_id=MASK))
    assert not torch.equal(b.anchor_positions, c.anchor_positions)


def test_target_topk_rows_are_aligned_with_labels():
    records = make_records(make_target("qwen3"), n=1, topk=3)
    batch = make_batch(records, [0], 0, batch_spec=BatchSpec(seed=0, num_anchors=4, block_size=4, mask_token_id=MASK))
    logits_rows = records[0].target_topk[1]
    for j, anchor in enumerate(batch.anchor_positions[0].tolist()):
        for k in range(1, 4):
            if batch.labels[0, j * 4 + k] != -100:
                # the target's top-1 after position anchor + k - 1 is its prediction for the label's token
                assert batch.target_topk[1][0, j * 4 + k, 0] == logits_rows[anchor + k - 1, 0]
