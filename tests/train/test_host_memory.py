"""A batch's feature buffer: batch-sized ones are their own mapping advised to use huge pages, freed with their last
view; a batch built in one holds exactly its records' features and zero padding."""

import mmap
import sys

import pytest
import torch

from flashdraft.train.data import BatchSpec, make_batch
from flashdraft.train.host_memory import HUGE_PAGE_BYTES, feature_buffer
from tests.conftest import MASK
from tests.train.helpers import Record

linux_huge_pages = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux's madvise(MADV_HUGEPAGE)"
)


def _mapping_of(address: int) -> dict | None:
    """The entry of /proc/self/smaps whose range holds `address`: its range and VmFlags; None where none does."""
    found = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = {"range": (lo, hi)} if lo <= address < hi else None
                if found is None and lo > address:
                    return None
            elif found is not None and line.startswith("VmFlags:"):
                found["flags"] = line.split()[1:]
                return found
    return found


@linux_huge_pages
def test_a_batch_sized_buffer_is_its_own_mapping_advised_to_use_huge_pages_and_unmapped_with_its_last_view():
    buffer = feature_buffer((4, 256, 1024), torch.bfloat16)  # 2 MiB: one huge page
    assert buffer.shape == (4, 256, 1024) and buffer.dtype == torch.bfloat16
    mapping = _mapping_of(buffer.data_ptr())
    assert mapping is not None and "hg" in mapping["flags"]  # hg: MADV_HUGEPAGE
    assert mapping["range"][1] - mapping["range"][0] >= HUGE_PAGE_BYTES
    row = buffer[3]  # a view outlives the batch's tensor: the mapping stays until it goes
    row.fill_(2.0)
    address = buffer.data_ptr()
    del buffer
    assert float(row.float().mean()) == 2.0 and _mapping_of(address) is not None
    del row
    assert _mapping_of(address) is None


def test_a_batch_built_in_a_batch_sized_buffer_holds_its_records_features_and_zero_padding():
    generator = torch.Generator().manual_seed(0)
    records = []
    for length in (300, 170):  # features [T, 2048] fp32: the batch's 4.8 MB buffer is a mapping of its own
        ids = torch.randint(2, 60, (length,), generator=generator)
        features = torch.randn(length, 2048, generator=generator)
        records.append(Record(ids, torch.arange(length) >= 10, features, None, 10))
    batch = make_batch(records, [0, 1], 0, BatchSpec(seed=0, num_anchors=4, block_size=4, mask_token_id=MASK))
    assert batch.context_features.numel() * 4 >= HUGE_PAGE_BYTES
    assert batch.context_features.shape == (2, 320, 2048)  # 300 tokens padded to their length bucket
    for row, record in enumerate(records):
        length = len(record.input_ids)
        assert torch.equal(batch.context_features[row, :length], record.context_features)  # copied, not computed
        assert not batch.context_features[row, length:].any()
