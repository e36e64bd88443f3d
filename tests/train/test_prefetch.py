"""Batches built ahead of the step in a thread: the same batches, in order, at most `depth` ahead, errors raised by
the step that asks for the batch."""

import threading
import time

import pytest
import torch

from flashdraft.train import host_memory
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


def test_two_workers_build_two_steps_at_once_and_hand_them_over_in_order_within_the_depth():
    running, most, started, lock = [0], [0], [], threading.Lock()

    def build(step):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            started.append(step)
        time.sleep(0.1 if step % 2 else 0.03)  # odd steps slower: they finish after the next even one
        with lock:
            running[0] -= 1
        return f"batch {step}"

    prefetcher = BatchPrefetcher(build, range(10), depth=2, workers=2)
    try:
        assert _wait_for(lambda: len(started) == 3)
        time.sleep(0.3)
        assert sorted(started) == [0, 1, 2]  # as with one worker: two built ahead and one more, no further
        assert [prefetcher.get(step) for step in range(10)] == [f"batch {step}" for step in range(10)]
    finally:
        prefetcher.close()
    assert most[0] == 2


def test_with_several_workers_no_step_after_a_failed_build_is_started_nor_handed_over():
    started = []

    def build(step):
        started.append(step)
        if step == 1:
            raise KeyError("record 3 is damaged")
        time.sleep(0.05)
        return step

    prefetcher = BatchPrefetcher(build, range(100), depth=3, workers=3)
    assert prefetcher.get(0) == 0
    with pytest.raises(KeyError, match="record 3 is damaged"):
        prefetcher.get(1)
    assert _wait_for(lambda: not any(thread.is_alive() for thread in prefetcher._threads))
    assert max(started) <= 4  # only those claimed before the failure was known (within the depth)
    with pytest.raises(RuntimeError, match="after an earlier step's build failed"):
        prefetcher.get(2)
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


def test_a_runs_prefetched_batches_reuse_their_feature_buffers_after_the_first_steps(
    target, records, tmp_path, monkeypatch
):
    fresh = []
    allocate = host_memory.feature_buffer
    monkeypatch.setattr(host_memory, "feature_buffer", lambda *args, **kw: fresh.append(args) or allocate(*args, **kw))
    cfg = TrainConfig(max_steps=16, batch_size=2, lr=3e-3, num_anchors=3, log_every=1, optimizer="adamw")
    train(cfg, make_drafter(), target, records, tmp_path / "run", options=LoopOptions(prefetch=2))
    # fresh ones only while the pipeline fills (prefetch 2, 2 workers building, the step's batch, the one its autograd
    # still holds) and where a longer batch needs a bigger buffer; how many of those a run sees depends on the
    # threads' timing (6 alone, 7 beside other jobs): at most half the steps, the rest reused
    assert 0 < len(fresh) <= cfg.max_steps // 2
