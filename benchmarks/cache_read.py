"""Does the cache reader keep up with a GPU's training step? The read rate of a hidden-state cache in context
tokens/s at the 8B and 27B drafters' feature widths, beside what the step consumes and beside a plain copy of the
same bytes on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cache_read.py [--records 16] [--tokens-per-record 1024]
        [--workers 1,2] [--repeats 3] [--step-tokens-per-s 17000] [--dir DIR]

For each width (Qwen3-8B's drafter: 5 context layers x 4,096; Qwen3.6-27B's: 5 x 5,120; bf16) a cache of random
records is written by `flashdraft cache`'s own writer (features stood in for the target's), then read as training
reads it: every record (`HiddenStateCache[i]`, a view of the mapped shard, copied into a `feature_buffer`), and
the training batches built from them as `flashdraft train` builds them (`step.global_batch`: 4 records a batch,
anchors, blocks, labels, the features copied into the batch's buffer, `train.host_memory`), by train's prefetcher
with each number of `--workers` threads; each with the files' pages dropped from the page cache first (cold: the
disk) and not (warm: memory). One JSON line per width, read and pages: context tokens/s (the median of
`--repeats`, and the best) and GB/s, and the ratio to the step's consumption (--step-tokens-per-s: 17,000 context
tokens/s is the 8B-shaped step measured on an H200; the 27B-shaped step consumes fewer tokens/s, so the ratio there
is a lower bound). Then the floor in the same run: one batch's bytes copied by one thread into memory already
touched (what the copy itself costs), into fresh memory from torch's allocator, and into a fresh `feature_buffer`
(what a batch pays).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from cache import random_completions

WIDTHS = {"qwen3-8b-drafter": (5, 4096), "qwen3.6-27b-drafter": (5, 5120)}  # context layers, target hidden size


class WideTarget:
    """The tiny target as the cache writer sees it, but `hidden_size` wide (its features come from `features_of`)."""

    def __init__(self, target, hidden_size: int) -> None:
        self._target, self.hidden_size = target, hidden_size

    def __getattr__(self, name):
        return getattr(self._target, name)


def drop_pages(directory: Path) -> None:
    """The cache's files out of the page cache (only these files): the next read comes from the disk."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def write_cache(target, layers: int, hidden: int, records: int, tokens: int, where: Path) -> Path:
    from flashdraft.data.cache import CacheSpec, CapturedFeatures, build_cache

    completions = random_completions(target, records, tokens, where)
    generator = torch.Generator().manual_seed(1)

    def features_of(record):  # [T, layers * hidden]
        length = len(record.prompt_ids) + len(record.completion_ids)
        return torch.randn(length, layers * hidden, generator=generator).to(torch.bfloat16)

    captured = CapturedFeatures(features_of, {"name": "random features (benchmarks/cache_read.py)", "dtype": "bf16"})
    spec = CacheSpec(layer_ids=list(range(layers)), dtype="bf16", records_per_shard=4)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return build_cache(WideTarget(target, hidden), completions, where / "cache", spec=spec, captured=captured)


def read_records(cache) -> int:
    """Every record's features read into memory as the batch builder reads them: the record's tensor is a view of the
    mapped shard, copied into a fresh `feature_buffer`."""
    from flashdraft.train.host_memory import feature_buffer

    tokens = 0
    for i in range(len(cache)):
        features = cache[i].context_features  # [T, n * H], mapped
        tokens += feature_buffer(tuple(features.shape), features.dtype).copy_(features).shape[0]
    return tokens


def read_batches(cache, workers: int = 1, pin: bool = False) -> int:
    """The training batches of one epoch (4 records each), built by train's prefetcher (2 ahead) with `workers`
    threads, taken in order as the step takes them; `pin`: in pinned memory (a GPU's batches)."""
    from flashdraft.distributed import Dist
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.prefetch import BatchPrefetcher
    from flashdraft.train.step import global_batch

    cfg = TrainConfig(batch_size=4, num_anchors=512, seed=0).recording(block_size=16, mask_token_id=1)
    steps, dist = len(cache) // cfg.batch_size, Dist()
    prefetcher = BatchPrefetcher(
        lambda step: global_batch(cfg, cache, step, steps, dist, pin=pin), range(steps), 2, pin=pin, workers=workers
    )
    tokens = 0
    try:
        for step in range(steps):
            for batch in prefetcher.get(step).micro_batches:
                tokens += int((batch.context_positions < (1 << 40)).sum())
    finally:
        prefetcher.close()
    return tokens


def timed(read, directory: Path, pages: str, repeats: int) -> tuple[int, list[float]]:
    """`read()`'s context tokens and its seconds, `repeats` times (cold: the cache's pages dropped before each)."""
    seconds = []
    for _ in range(repeats):
        if pages == "cold":
            drop_pages(directory)
        started = time.perf_counter()
        tokens = read()
        seconds.append(time.perf_counter() - started)
    return tokens, seconds


def copy_floor(shape: tuple[int, int, int], batches: int, repeats: int) -> dict:
    """One batch's features (bf16 `shape`) copied `batches` times by one thread, `repeats` times: into memory already
    touched, into fresh memory from torch's allocator, into a fresh `feature_buffer`; the median seconds of each."""
    from flashdraft.train.host_memory import feature_buffer

    source = torch.randn(shape).to(torch.bfloat16)
    touched = torch.zeros_like(source)
    ways = {
        "touched": lambda: touched.copy_(source),
        "torch_empty": lambda: torch.empty(shape, dtype=source.dtype).copy_(source),
        "feature_buffer": lambda: feature_buffer(shape, source.dtype).copy_(source),
    }
    medians = {}
    for name, copy in ways.items():
        runs = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(batches):
                copy()
            runs.append(time.perf_counter() - started)
        medians[name] = sorted(runs)[len(runs) // 2]
    return medians


def read_rows(cache, directory: Path, feature_width: int, args) -> list[dict]:
    """The cache read as records, then as batches by each number of workers, cold and warm: one row each."""
    reads = [("records", 1, lambda: read_records(cache))] + [
        ("batches", int(w), lambda w=int(w): read_batches(cache, workers=w)) for w in args.workers.split(",")
    ]
    rows = []
    for read, workers, fn in reads:
        for pages in ("cold", "warm"):
            tokens, seconds = timed(fn, directory, pages, args.repeats)
            rate, best = tokens / sorted(seconds)[len(seconds) // 2], tokens / min(seconds)
            rows.append(
                {
                    "read": read,
                    "workers": workers,
                    "pages": pages,
                    "context_tokens": tokens,
                    "context_tokens_per_s": round(rate),
                    "best_context_tokens_per_s": round(best),
                    "gb_per_s": round(rate * feature_width * 2 / 1e9, 3),
                }
            )
    return rows


def floor_rows(feature_width: int, args) -> list[dict]:
    """The same bytes as the batches' features copied by one thread (`copy_floor`): one row per destination."""
    batches = args.records // 4
    floor = copy_floor((4, args.tokens_per_record, feature_width), batches, args.repeats)
    rows = []
    for into, seconds in floor.items():
        rate = 4 * args.tokens_per_record * batches / seconds
        rows.append(
            {
                "read": f"memcpy into {into}",
                "workers": 1,
                "context_tokens_per_s": round(rate),
                "gb_per_s": round(rate * feature_width * 2 / 1e9, 3),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--tokens-per-record", type=int, default=1024)
    parser.add_argument("--workers", default="1,2", help="numbers of threads building the batches, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-tokens-per-s", type=float, default=17000.0)
    parser.add_argument("--dir", default=None, help="where to write the caches (default: a temporary directory)")
    args = parser.parse_args()
    from flashdraft.data.cache_reader import HiddenStateCache
    from flashdraft.target.model import TargetModel

    target = TargetModel.load("tiny")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name, (layers, hidden) in WIDTHS.items():
            where = Path(tmp) / name
            where.mkdir()
            directory = write_cache(target, layers, hidden, args.records, args.tokens_per_record, where)
            rows = read_rows(HiddenStateCache(directory), directory, layers * hidden, args)
            for row in rows + floor_rows(layers * hidden, args):
                head = {"benchmark": "cache_read", "drafter": name, "feature_width": layers * hidden}
                rate = row["context_tokens_per_s"]
                tail = {"machine": machine, "step_consumes_tokens_per_s": args.step_tokens_per_s}
                ratio = {"read_over_step": round(rate / args.step_tokens_per_s, 2)}
                print(json.dumps(head | row | tail | ratio), flush=True)


if __name__ == "__main__":
    main()
