"""Offline evaluation throughput from a hidden-state cache: records/s and steps/s of the
offline walk (`flashdraft eval --cached-hidden-states`) for an untrained drafter, and for the
n-gram baseline on the same records.

    .venv/bin/python benchmarks/eval.py [--target-model tiny] [--draft-layers 1,2] [--records 16]
        [--tokens-per-record 320] [--max-blocks N] [--threads 1]

Records are random tokens cached in bf16 in a temporary directory. An untrained drafter
accepts almost nothing, so every record is walked in about one step per completion token:
the most steps a record can take, hence the slowest case. No target forward runs (checked).
Prints one JSON line per drafter.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.data.cache import CacheSpec, build_cache
from flashdraft.data.cache_reader import HiddenStateCache
from flashdraft.data.completions import CompletionRecord, Completions
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.drafter.init import DrafterChoices, new_drafter_for_target
from flashdraft.evaluation.offline import WalkConfig, evaluate_offline
from flashdraft.evaluation.records import FeatureSource, records_from_cache
from flashdraft.target.model import TargetModel


def random_completions(target: TargetModel, records: int, tokens: int, where: Path) -> Completions:
    """Random-token records (as in benchmarks/cache.py): walking them costs what real ones do."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(records):
        ids = torch.randint(0, target.vocab_size, (tokens,), generator=gen).tolist()
        rows.append(CompletionRecord(f"r{i}", "", ids[: tokens // 5], ids[tokens // 5 :], "", "length"))
    return Completions(where / "completions.json", {"target": {"fingerprint": target.fingerprint()}}, rows, [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-model", default="tiny")
    ap.add_argument("--draft-layers", default="1,2", help="untrained drafters of these depths")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--tokens-per-record", type=int, default=320)
    ap.add_argument("--max-blocks", type=int, default=None, help="steps per record (default: whole completion)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.target_model)
    depths = [int(x) for x in args.draft_layers.split(",")]
    drafters = {
        f"untrained-{n}-layer": new_drafter_for_target(
            target, choices=DrafterChoices(num_layers=n, block_size=args.block_size)
        ).eval()
        for n in depths
    }
    layer_ids = sorted({i for d in drafters.values() for i in d.config.target_layer_ids})
    with tempfile.TemporaryDirectory() as tmp:
        completions = random_completions(target, args.records, args.tokens_per_record, Path(tmp))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            build_cache(target, completions, Path(tmp) / "cache", spec=CacheSpec(layer_ids=layer_ids, dtype="bf16"))
        cache = HiddenStateCache(Path(tmp) / "cache")
        candidates = list(drafters.items()) + [("ngram", NGramProposer(target.vocab_size))]
        for name, drafter in candidates:
            records = records_from_cache(cache)
            source = FeatureSource(target)
            evaluate_offline(
                drafter, target, records[:1], source, walk=WalkConfig(block_size=args.block_size, max_blocks=4)
            )  # warm-up
            t0 = time.perf_counter()
            result = evaluate_offline(
                drafter,
                target,
                records,
                source,
                walk=WalkConfig(block_size=args.block_size, max_blocks=args.max_blocks),
            )
            seconds = time.perf_counter() - t0
            assert source.target_forwards == 0, "offline evaluation from a cache ran the target"
            print(
                json.dumps(
                    {
                        "benchmark": "eval",
                        "target": str(target.path),
                        "drafter": name,
                        "machine": platform.processor() or platform.machine(),
                        "threads": args.threads,
                        "block_size": args.block_size,
                        "context_layers": result.context_layers,
                        "records": len(records),
                        "tokens_per_record": args.tokens_per_record,
                        "steps": result.num_steps,
                        "tau": round(result.tau, 3),
                        "records_per_s": round(len(records) / seconds, 2),
                        "steps_per_s": round(result.num_steps / seconds, 1),
                    }
                )
            )


if __name__ == "__main__":
    main()
