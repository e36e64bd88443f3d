"""A run's feature buffers: one is reused only once no tensor, view or autograd record holds it (the smallest that
fits), and a batch built in a reused buffer holds exactly its records' features and zero padding."""

import torch

from flashdraft.train.data import BatchSpec, make_batch
from flashdraft.train.host_memory import FeatureBuffers
from tests.conftest import MASK
from tests.train.helpers import Record


def test_a_kept_buffer_is_reused_only_once_no_view_or_autograd_record_holds_it_the_smallest_that_fits():
    buffers = FeatureBuffers(keep=2)
    first = buffers.take((4, 8), torch.float32)
    address, row = first.data_ptr(), first[1]
    del first
    held = buffers.take((4, 8), torch.float32)  # a view of the first still alive: a fresh buffer
    assert held.data_ptr() != address
    del row
    weight = torch.ones(3, 8, requires_grad=True)
    loss = (buffers.take((3, 8), torch.float32).fill_(1.0) * weight).sum()  # autograd saves the buffer for backward
    assert buffers.take((2, 8), torch.float32).data_ptr() not in (address, held.data_ptr())  # neither is free
    loss.backward()
    del loss
    assert buffers.take((2, 8), torch.float32).data_ptr() == address  # free again, and the smaller of the two
    del held
    bigger = buffers.take((5, 8), torch.float32)  # fits in neither: fresh, kept in place of a free one too small
    bigger_address = bigger.data_ptr()
    del bigger
    assert buffers.take((5, 8), torch.float32).data_ptr() == bigger_address


def test_pinned_buffers_are_left_to_torchs_caching_host_allocator():
    assert FeatureBuffers(pin=True, keep=4).keep == 0  # torch reuses pinned blocks only after their device copies


def test_a_batch_built_in_a_reused_buffer_holds_its_records_features_and_zero_padding():
    generator = torch.Generator().manual_seed(0)

    def record(length):
        ids = torch.randint(2, 60, (length,), generator=generator)
        return Record(ids, torch.arange(length) >= 4, torch.randn(length, 16, generator=generator), None, 4)

    buffers = FeatureBuffers(keep=2)
    spec = BatchSpec(seed=0, num_anchors=4, block_size=4, mask_token_id=MASK, buffers=buffers)
    longer = make_batch([record(40), record(40)], [0, 1], 0, spec)  # fills the buffer past the next batch's records
    address = longer.context_features.data_ptr()
    del longer
    records = [record(30), record(17)]
    batch = make_batch(records, [2, 3], 0, spec)
    assert batch.context_features.data_ptr() == address and batch.context_features.shape == (2, 32, 16)
    fresh = make_batch(records, [2, 3], 0, BatchSpec(seed=0, num_anchors=4, block_size=4, mask_token_id=MASK))
    assert torch.equal(batch.context_features, fresh.context_features)  # the same copies, in either buffer
    for row, r in enumerate(records):
        length = len(r.input_ids)
        assert torch.equal(batch.context_features[row, :length], r.context_features)
        assert not batch.context_features[row, length:].any()
