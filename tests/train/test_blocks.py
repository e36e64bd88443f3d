import torch

from flashdraft.train.blocks import IGNORE, build_blocks, candidate_anchors, sample_anchors


def test_anchors_are_only_where_anchor_and_next_token_are_supervised():
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 1, 0], dtype=torch.bool)
    assert candidate_anchors(loss_mask).tolist() == [3, 4, 7]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        anchors = sample_anchors(loss_mask, 2, gen)
        assert len(anchors) == 2 and set(anchors.tolist()) <= {3, 4, 7} and anchors.tolist() == sorted(anchors.tolist())


def test_block_inputs_and_labels_follow_the_recipe_entry_by_entry():
    ids = torch.arange(100, 112)  # token at position t is 100 + t
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    anchors = torch.tensor([3, 9])
    block, labels = build_blocks(ids, loss_mask, anchors, 4, mask_token_id=7)
    assert block.tolist() == [103, 7, 7, 7, 109, 7, 7, 7]
    # label k = token at anchor + k when it exists and is supervised; never at k = 0
    assert labels.tolist() == [IGNORE, 104, 105, 106, IGNORE, 110, 111, IGNORE]


def test_anchor_first_labels_every_position_with_the_token_after_anchor_plus_k_as_deepspec_defines_them():
    ids = torch.arange(100, 112)  # token at position t is 100 + t
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    anchors = torch.tensor([3, 8])
    block, labels = build_blocks(ids, loss_mask, anchors, 4, mask_token_id=7, first_draft=0)
    assert block.tolist() == [103, 7, 7, 7, 108, 7, 7, 7]  # the anchor and 3 masks, as the fill-in layout
    # position k: the token at anchor + k + 1 (DeepSpec's label_offsets 1..B); supervision stops at the first
    # unsupervised or missing token, and every position after it too (the Markov input would be unknown)
    assert labels.tolist() == [104, 105, 106, IGNORE, 109, 110, 111, IGNORE]
