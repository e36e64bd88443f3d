"""Does the cache reader keep up with a GPU's training step? The read rate of a hidden-state cache in context
tokens/s at the 8B and 27B drafters' feature widths, beside what the step consumes and beside a plain copy of the
same bytes on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cache_read.py [--records 16] [--tokens-per-record 1024]
        [--workers 1,2] [--repeats 3] [--step-tokens-per-s 17000] [--dir DIR]

For each width (Qwen3-8B's drafter: 5 context layers x 4,096; Qwen3.6-27B's: 5 x 5,120; bf16) a cache of random
records is written by `flashdraft cache`'s own writer (features stood in for the target's), then read as training
reads it: every record (`HiddenStateCache[i]`, a view of the mapped shard, copied into a buffer), and the
training batches built from them as `flashdraft train` builds them (`step.global_batch`: 4 records a batch, anchors,
blocks, labels, the features copied into the batch's buffer, reused once let go: `train.host_memory`), by train's
prefetcher with each number of `--workers` threads; each with the files' pages dropped from the page cache first
(cold: the disk) and not (warm: memory). One JSON line per width, read and pages: context tokens/s (the median of
`--repeats`, and the best; the batches' buffers kept over the repeats as a run keeps them) and GB/s, and the ratio
to the step's consumption (--step-tokens-per-s: 17,000 context tokens/s is the 8B-shaped step measured on an H200;
the 27B-shaped step consumes fewer tokens/s, so the ratio there is a lower bound). Then the floors in the same run,
the reads taken in turn: the shards' feature bytes read from the disk by `preadv` into memory already touched (pages
dropped first), and one batch's bytes copied by one thread into memory already touched (the copy alone, what a
reused buffer costs) and into fresh memory from torch's allocator (what every batch paid before its buffers were
reused).
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
    mapped shard, copied into a buffer of the run's (`train.host_memory.FeatureBuffers`, reused once let go)."""
    from flashdraft.train.host_memory import FeatureBuffers

    buffers, tokens = FeatureBuffers(keep=1), 0
    for i in range(len(cache)):
        features = cache[i].context_features  # [T, n * H], mapped
        tokens += buffers.take(tuple(features.shape), features.dtype).copy_(features).shape[0]
    return tokens


def read_batches(cache, workers: int = 1, pin: bool = False, buffers=None) -> int:
    """The training batches of one epoch (4 records each) as `flashdraft train` builds them: by its prefetcher (2
    ahead) with `workers` threads, in the run's buffers (`buffers`, kept from epoch to epoch as a run keeps them; None:
    new ones; pinned with `pin`, a GPU's, else reused once let go), taken in order as the step takes them."""
    from flashdraft.distributed import Dist
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.host_memory import FeatureBuffers
    from flashdraft.train.prefetch import BatchPrefetcher
    from flashdraft.train.step import global_batch

    cfg = TrainConfig(batch_size=4, num_anchors=512, seed=0).recording(block_size=16, mask_token_id=1)
    steps, dist, depth = len(cache) // cfg.batch_size, Dist(), 2
    buffers = buffers or FeatureBuffers(pin=pin, keep=depth + 3)  # as train's loop keeps them
    prefetcher = BatchPrefetcher(
        lambda step: global_batch(cfg, cache, step, steps, dist, buffers=buffers), range(steps), depth, pin, workers
    )
    tokens = 0
    try:
        for step in range(steps):
            for batch in prefetcher.get(step).micro_batches:
                tokens += int((batch.context_positions < (1 << 40)).sum())
    finally:
        prefetcher.close()
    return tokens


def disk_read(directory: Path, shards: list[dict], into: torch.Tensor) -> int:
    """Every shard's context features read from the file by `preadv` into `into` (memory already touched): what the
    disk and the page cache give without mapping, the floor of a cold read. Returns the context tokens read."""
    tokens = 0
    view = memoryview(into.view(torch.uint8).numpy()).cast("B")
    for shard in shards:
        path = directory / shard["file"]
        with path.open("rb") as f:  # the safetensors header: its length, then JSON naming each tensor's byte range
            header_length = int.from_bytes(f.read(8), "little")
            begin, end = json.loads(f.read(header_length))["context_features"]["data_offsets"]
            done = 0
            while done < end - begin:
                chunk = min(end - begin - done, view.nbytes)
                done += os.preadv(f.fileno(), [view[:chunk]], 8 + header_length + begin + done)
        tokens += shard["num_tokens"]
    return tokens


def copy_into(shape: tuple[int, int, int], batches: int, into: str, touched: torch.Tensor, source: torch.Tensor):
    """One batch's features (bf16 `shape`, `source`) copied `batches` times by one thread into memory already
    touched, or into fresh memory from torch's allocator. Returns the context tokens."""
    for _ in range(batches):
        if into == "touched":
            touched.copy_(source)
        else:
            torch.empty(shape, dtype=source.dtype).copy_(source)
    return batches * shape[0] * shape[1]


def read_rows(cache, directory: Path, feature_width: int, args) -> list[dict]:
    """The cache read as records, as batches by each number of workers, cold and warm; the disk's and memcpy's
    floors: one row each, the median of `args.repeats` taken in turn (a load that comes and goes hits each alike)."""
    from flashdraft.train.host_memory import FeatureBuffers

    shape = (4, args.tokens_per_record, feature_width)  # one batch's features
    touched, source = torch.zeros(shape, dtype=torch.bfloat16), torch.randn(shape).to(torch.bfloat16)
    batches = len(cache) // 4
    reads = [("records", 1, "cold"), ("records", 1, "warm")]
    reads += [("batches", int(w), pages) for w in args.workers.split(",") for pages in ("cold", "warm")]
    reads += [("disk read into touched memory", 1, "cold")]
    reads += [(f"memcpy into {into}", 1, "warm") for into in ("touched", "torch_empty")]

    # a run's buffers live as long as the run: each number of workers keeps its own over the repeats (the first
    # repeat allocates them, as a run's first steps do)
    buffers = {w: FeatureBuffers(keep=2 + 3) for _, w, _ in reads}

    def run(read: str, workers: int) -> int:
        if read == "records":
            return read_records(cache)
        if read == "batches":
            return read_batches(cache, workers=workers, buffers=buffers[workers])
        if read.startswith("disk"):
            return disk_read(directory, cache.shards, touched)
        return copy_into(shape, batches, read.removeprefix("memcpy into "), touched, source)

    seconds: dict[tuple, list[float]] = {key: [] for key in reads}
    tokens: dict[tuple, int] = {}
    for _ in range(args.repeats):
        for read, workers, pages in reads:
            if pages == "cold":
                drop_pages(directory)
            started = time.perf_counter()
            tokens[read, workers, pages] = run(read, workers)
            seconds[read, workers, pages].append(time.perf_counter() - started)
    rows = []
    for key in reads:
        runs = sorted(seconds[key])
        rate, best = tokens[key] / runs[len(runs) // 2], tokens[key] / runs[0]
        row = {"read": key[0], "workers": key[1], "pages": key[2], "context_tokens": tokens[key]}
        rows.append(
            row
            | {
                "context_tokens_per_s": round(rate),
                "best_context_tokens_per_s": round(best),
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
            for row in rows:
                head = {"benchmark": "cache_read", "drafter": name, "feature_width": layers * hidden}
                rate = row["context_tokens_per_s"]
                tail = {"machine": machine, "step_consumes_tokens_per_s": args.step_tokens_per_s}
                ratio = {"read_over_step": round(rate / args.step_tokens_per_s, 2)}
                print(json.dumps(head | row | tail | ratio), flush=True)


if __name__ == "__main__":
    main()
