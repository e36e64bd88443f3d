"""The steps' global batches built ahead of the step (`LoopOptions.prefetch`): background threads read the records
(a cache on disk, the engine's stream, or the target online) and cut them into batches while the step computes, so
the step waits on its data only when reading is slower than computing (`wait_s` in metrics.jsonl says how long).

A batch is a function of (seed, epoch, step) alone, so building it early, or beside another step's, changes
nothing: `workers` threads build the next steps at once and the step takes them in order. A streamed source (the
engine) must be read in exactly the order it was told: one worker. At most `depth` batches wait built beyond the one
in progress, whatever the number of workers (what bounds the memory). On CUDA the batch's context features are built
in pinned memory (`train.host_memory`) and its other tensors pinned in the worker, so the step's copy to the device
(`Batch.to`, non-blocking) overlaps. An error while building (a lost engine, a damaged record) is raised by the step
that asks for that batch, as if it had built it itself; no later step is started after it. Threads, not worker
processes: the build is mostly copies of mapped shards (torch releases the GIL in them) and file reads, and an
engine's stream or the in-process target cannot be shared with other processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from flashdraft.train.step import GlobalBatch

_JOIN_S = 60.0


def pinned(batch: GlobalBatch) -> GlobalBatch:
    """The batch with its micro-batches' tensors in pinned (page-locked) memory: their copy to a GPU can overlap.
    Tensors already pinned (the features built there) stay where they are."""
    return replace(batch, micro_batches=[b.pin_memory() for b in batch.micro_batches])


class BatchPrefetcher:
    """`build(step)` for the steps of `steps` by `workers` threads, taken in order (`get`); a worker starts a step
    only while at most `depth` built batches would wait beyond it."""

    def __init__(
        self, build: Callable[[int], GlobalBatch], steps: range, depth: int, pin: bool = False, workers: int = 1
    ) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth {depth}: expected at least 1 (0: build in the step, no prefetcher)")
        if workers < 1:
            raise ValueError(f"prefetch workers {workers}: expected at least 1")
        self._build, self._steps, self._pin, self._depth = build, steps, pin, depth
        self._changed = threading.Condition()
        self._built: dict[int, tuple] = {}  # position in `steps` -> (batch, error), built and not yet taken
        self._claimed = self._taken = 0  # positions started by a worker; handed to the step
        self._end = len(steps)  # no position at or past it is started (a build's error moves it to just after)
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._run, name="flashdraft-batches", daemon=True)
            for _ in range(min(workers, depth + 1))
        ]
        for thread in self._threads:
            thread.start()

    def _claim(self) -> int | None:
        """The next position to build, once there is room for it; None when there is none left (or closed)."""
        with self._changed:
            while not self._stopped and self._claimed < self._end and self._claimed > self._taken + self._depth:
                self._changed.wait()
            if self._stopped or self._claimed >= self._end:
                return None
            self._claimed += 1
            return self._claimed - 1

    def _run(self) -> None:
        while (position := self._claim()) is not None:
            try:
                batch, error = self._build(self._steps[position]), None
                if self._pin:
                    batch = pinned(batch)
            except BaseException as e:  # handed to the step that asks for this batch
                batch, error = None, e
            with self._changed:
                if not self._stopped:  # closed meanwhile: the batch is dropped
                    self._built[position] = (batch, error)
                if error is not None:
                    self._end = min(self._end, position + 1)
                self._changed.notify_all()

    def get(self, step: int) -> GlobalBatch:
        """The batch of `step` (the next one in order), waiting for it if it is not built yet; the build's error."""
        with self._changed:
            position = self._taken
            expected = self._steps[position] if position < len(self._steps) else None
            if step != expected:
                raise RuntimeError(f"prefetcher: step {step} asked, step {expected} built (steps are taken in order)")
            if position >= self._end:
                raise RuntimeError(f"prefetcher: step {step} asked after an earlier step's build failed")
            while position not in self._built:
                self._changed.wait()
            batch, error = self._built.pop(position)
            self._taken += 1
            self._changed.notify_all()
        if error is not None:
            raise error
        return batch

    def close(self) -> None:
        """Stop building (the batches in progress are finished and dropped) and wait for the threads."""
        with self._changed:
            self._stopped = True
            self._built.clear()
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(timeout=_JOIN_S)  # a build stuck on a dead engine: the daemon thread dies with the run
