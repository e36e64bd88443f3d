"""Does the cache reader keep up with a GPU's training step? The read rate of a hidden-state cache in context
tokens/s at the 8B and 27B drafters' feature widths, beside what the step consumes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cache_read.py [--records 8] [--tokens-per-record 1024]
        [--step-tokens-per-s 17000] [--dir DIR]

For each width (Qwen3-8B's drafter: 5 context layers x 4,096; Qwen3.6-27B's: 5 x 5,120; bf16) a cache of random
records is written by `flashdraft cache`'s own writer (features stood in for the target's), then read as training
reads it: every record (`HiddenStateCache[i]`), and the training batches built from them (`step.global_batch`: 4
records a batch, anchors, blocks, labels, the padded copy), each with the files' pages dropped from the page cache
first (cold: the disk) and again (warm: memory). One JSON line per width and read: context tokens/s and GB/s, and
the ratio to the step's consumption (--step-tokens-per-s: 17,000 context tokens/s is the 8B-shaped step measured on
an H200; the 27B-shaped step consumes fewer tokens/s, so the ratio there is a lower bound). Above 1: the reader,
one thread, keeps up; training builds batches ahead of the step in a thread (`train.prefetch`).
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
    """Every record's features read into memory (a record's tensor may map the file: the copy reads it)."""
    return sum(cache[i].context_features.clone().shape[0] for i in range(len(cache)))


def read_batches(cache) -> int:
    from flashdraft.distributed import Dist
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.step import global_batch

    cfg = TrainConfig(batch_size=4, num_anchors=512, seed=0).recording(block_size=16, mask_token_id=1)
    steps = len(cache) // cfg.batch_size
    tokens = 0
    for step in range(steps):
        for batch in global_batch(cfg, cache, step, steps, Dist()).micro_batches:
            tokens += int((batch.context_positions < (1 << 40)).sum())
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=8)
    parser.add_argument("--tokens-per-record", type=int, default=1024)
    parser.add_argument("--step-tokens-per-s", type=float, default=17000.0)
    parser.add_argument("--dir", default=None, help="where to write the caches (default: a temporary directory)")
    args = parser.parse_args()
    from flashdraft.data.cache_reader import HiddenStateCache
    from flashdraft.target.model import TargetModel

    target = TargetModel.load("tiny")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name, (layers, hidden) in WIDTHS.items():
            where = Path(tmp) / name
            where.mkdir()
            directory = write_cache(target, layers, hidden, args.records, args.tokens_per_record, where)
            cache = HiddenStateCache(directory)
            bytes_per_token = layers * hidden * 2
            for read, fn in (("records", read_records), ("batches", read_batches)):
                for state in ("cold", "warm"):
                    if state == "cold":
                        drop_pages(directory)
                    started = time.perf_counter()
                    tokens = fn(cache)
                    seconds = time.perf_counter() - started
                    rate = tokens / seconds
                    row = {
                        "benchmark": "cache_read",
                        "drafter": name,
                        "feature_width": layers * hidden,
                        "read": read,
                        "pages": state,
                        "machine": platform.processor() or platform.machine(),
                        "context_tokens": tokens,
                        "context_tokens_per_s": round(rate),
                        "gb_per_s": round(rate * bytes_per_token / 1e9, 3),
                        "step_consumes_tokens_per_s": args.step_tokens_per_s,
                        "read_over_step": round(rate / args.step_tokens_per_s, 2),
                    }
                    print(json.dumps(row), flush=True)
            del cache


if __name__ == "__main__":
    main()
