import torch

from flashdraft.train.vocab import draft_vocabulary, with_draft_vocabulary
from tests.conftest import make_drafter
from tests.train.helpers import Record


def _record(ids, supervised_from):
    ids = torch.tensor(ids)
    return Record(ids, torch.arange(len(ids)) >= supervised_from, None, None)


def test_draft_vocabulary_is_the_most_frequent_supervised_tokens_with_mask_and_stop_tokens_always_in():
    records = [_record([9, 9, 9, 5, 5, 7, 7, 7, 3], supervised_from=3), _record([7, 1, 1], supervised_from=0)]
    # supervised counts: 7 x4, 5 x2, 1 x2, 3 x1 (the prompt's 9s are not supervised)
    assert draft_vocabulary(records, 4, 64, always=[63]) == [1, 5, 7, 63]
    assert draft_vocabulary(records, 5, 64, always=[63, 61]) == [1, 5, 7, 61, 63]


def test_own_head_starts_as_the_targets_rows_and_the_drafter_is_otherwise_unchanged():
    drafter = make_drafter()
    head = torch.randn(64, 64)
    reduced = with_draft_vocabulary(drafter, [2, 5, 9], head)
    torch.testing.assert_close(reduced.lm_head.weight, head[[2, 5, 9]])
    assert reduced.target_ids().tolist() == [2, 5, 9]
    hidden = torch.randn(4, 64)
    torch.testing.assert_close(reduced.logits(hidden, None)[:, [2, 5, 9]], hidden @ head[[2, 5, 9]].T)
    assert all(torch.equal(v, reduced.state_dict()[k]) for k, v in drafter.state_dict().items())
