"""Batches built ahead of the step in a thread: the same batches, in order, at most `depth` ahead, errors raised by
the step that asks for the batch."""

import threading
import time

import pytest
import torch

from flashdraft.train.config import TrainConfig
from flashdraft.train.loop import LoopOptions, train
from flashdraft.train.prefetch import BatchPrefetcher
from tests.conftest import make_drafter


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_batches_come_in_order_built_ahead_of_the_step_but_never_more_than_depth_ahead():
    built = []
    prefetcher = BatchPrefetcher(lambda step: built.append(step) or f"batch {step}", range(3, 20), depth=2)
    try:
        # before any step asks: two batches wait in the queue and a third is built, held until there is room
        assert _wait_for(lambda: len(built) == 3)
        time.sleep(0.2)
        assert built == [3, 4, 5]
        assert [prefetcher.get(step) for step in range(3, 8)] == [f"batch {step}" for step in range(3, 8)]
        assert _wait_for(lambda: len(built) == 8) and built == list(range(3, 11))
    finally:
        prefetcher.close()
    with pytest.raises(RuntimeError, match="step 11 asked, step 8 built"):
        stale = BatchPrefetcher(lambda step: step, range(8, 10), depth=1)
        try:
            stale.get(11)
        finally:
            stale.close()


def test_a_build_error_is_raised_by_the_step_that_asks_for_that_batch_and_stops_the_thread():
    def build(step):
        if step == 2:
            raise KeyError("record 7 is damaged")
        return step

    prefetcher = BatchPrefetcher(build, range(5), depth=4)
    assert [prefetcher.get(0), prefetcher.get(1)] == [0, 1]
    with pytest.raises(KeyError, match="record 7 is damaged"):
        prefetcher.get(2)
    assert _wait_for(lambda: not any(thread.is_alive() for thread in prefetcher._threads))
    prefetcher.close()


def test_close_stops_a_thread_waiting_for_room():
    built = []
    prefetcher = BatchPrefetcher(lambda step: built.append(step) or step, range(10**6), depth=1, workers=2)
    assert _wait_for(lambda: len(built) == 2)
    prefetcher.close()
    assert not any(thread.is_alive() for thread in prefetcher._threads)
    assert not any(t.name == "flashdraft-batches" and t.is_alive() for t in threading.enumerate())


def test_a_run_with_prefetched_batches_trains_exactly_what_one_without_trains(target, records, tmp_path):
    cfg = TrainConfig(max_steps=4, batch_size=2, lr=3e-3, num_anchors=3, log_every=1, optimizer="adamw")
    runs = {
        depth: train(cfg, make_drafter(), target, records, tmp_path / str(depth), options=LoopOptions(prefetch=depth))
        for depth in (0, 2)
    }
    for key, value in runs[0].state_dict().items():
        assert torch.equal(value, runs[2].state_dict()[key]), key
