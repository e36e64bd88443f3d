"""The steps' global batches built ahead of the step (`LoopOptions.prefetch`): a background thread reads the records
(a cache on disk, the engine's stream, or the target online) and cuts them into batches while the step computes, so
the step waits on its data only when reading is slower than computing (`wait_s` in metrics.jsonl says how long).

One thread, building the steps in order: a batch is a function of (seed, epoch, step) alone, so building it early
changes nothing, and a streamed source (the engine) is read in exactly the order it was told. On CUDA the batch's
tensors are pinned in the thread, so the step's copy to the device (`Batch.to`, non-blocking) overlaps. An error
while building (a lost engine, a damaged record) is raised by the step that asks for that batch, as if it had built
it itself. Threads, not worker processes: the build is mostly torch ops and file reads, which release the GIL, and
an engine's stream or the in-process target cannot be shared with other processes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import replace

from flashdraft.train.step import GlobalBatch

_POLL_S = 0.1  # how often a thread waiting for room checks that the run still wants its batches
_JOIN_S = 60.0


def pinned(batch: GlobalBatch) -> GlobalBatch:
    """The batch with its micro-batches' tensors in pinned (page-locked) memory: their copy to a GPU can overlap."""
    return replace(batch, micro_batches=[b.pin_memory() for b in batch.micro_batches])


class BatchPrefetcher:
    """`build(step)` for the steps of `steps`, in order, up to `depth` ahead of the step that asks (`get`)."""

    def __init__(self, build: Callable[[int], GlobalBatch], steps: range, depth: int, pin: bool = False) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth {depth}: expected at least 1 (0: build in the step, no prefetcher)")
        self._build, self._steps, self._pin = build, steps, pin
        self._ready: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashdraft-batches", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for step in self._steps:
            try:
                batch, error = self._build(step), None
                if self._pin:
                    batch = pinned(batch)
            except BaseException as e:  # handed to the step that asks for this batch
                batch, error = None, e
            while not self._stop.is_set():
                try:
                    self._ready.put((step, batch, error), timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if error is not None or self._stop.is_set():
                return

    def get(self, step: int) -> GlobalBatch:
        """The batch of `step` (the next one in order), waiting for it if it is not built yet; the build's error."""
        built, batch, error = self._ready.get()
        if built != step:
            raise RuntimeError(f"prefetcher: step {step} asked, step {built} built (steps are taken in order)")
        if error is not None:
            raise error
        return batch

    def close(self) -> None:
        """Stop building (the batch in progress is finished and dropped) and wait for the thread."""
        self._stop.set()
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=_JOIN_S)  # a build stuck on a dead engine: the daemon thread dies with the run
