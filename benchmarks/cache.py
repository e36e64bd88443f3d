"""Hidden-state cache extraction: tokens/s of `flashdraft cache` (target forward, cast,
safetensors shards, checksums) and bytes stored per token against the floor, the context
features alone (context layers x hidden x bytes per value).

    .venv/bin/python benchmarks/cache.py [--target-model tiny] [--layers 1,3] [--dtypes bf16,fp32]
        [--records 16] [--tokens-per-record 320] [--threads 1]

Records are random tokens (what extraction costs does not depend on them), written to a
temporary directory. Prints one JSON line per (storage dtype, number of context layers);
the rest of a token's bytes are its input id (int32), loss mask (bool) and the shard headers.
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

from flashdraft.data.cache import DTYPES, CacheSpec, build_cache
from flashdraft.data.completions import CompletionRecord, Completions
from flashdraft.drafter.config import default_target_layer_ids
from flashdraft.target.model import TargetModel


def random_completions(target: TargetModel, records: int, tokens: int, where: Path) -> Completions:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(records):
        ids = torch.randint(0, target.vocab_size, (tokens,), generator=gen).tolist()
        prompt, completion = ids[: tokens // 5], ids[tokens // 5 :]
        rows.append(CompletionRecord(f"r{i}", "", prompt, completion, "", "length"))
    header = {"target": {"fingerprint": target.fingerprint()}, "generation": None}
    return Completions(where / "completions.json", header, rows, [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-model", default="tiny")
    ap.add_argument("--layers", default="1,3", help="numbers of context layers (reference default ids)")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--tokens-per-record", type=int, default=320)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.target_model)
    hidden = target.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        completions = random_completions(target, args.records, args.tokens_per_record, Path(tmp))
        num_tokens = args.records * args.tokens_per_record
        target.set_context_layers([0])  # warm-up forward
        target.forward(torch.tensor([completions.records[0].prompt_ids + completions.records[0].completion_ids]))
        for dtype in args.dtypes.split(","):
            for n in (int(x) for x in args.layers.split(",")):
                layer_ids = default_target_layer_ids(target.num_layers, n)
                out = Path(tmp) / f"cache-{dtype}-{n}"
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    build_cache(target, completions, out, spec=CacheSpec(layer_ids=layer_ids, dtype=dtype))
                seconds = time.perf_counter() - t0
                shards = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
                total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
                floor = n * hidden * DTYPES[dtype].itemsize
                print(
                    json.dumps(
                        {
                            "benchmark": "cache",
                            "target": str(target.path),
                            "machine": platform.processor() or platform.machine(),
                            "threads": args.threads,
                            "dtype": dtype,
                            "context_layers": n,
                            "layer_ids": layer_ids,
                            "tokens": num_tokens,
                            "tokens_per_s": round(num_tokens / seconds, 1),
                            "bytes_per_token": round(shards / num_tokens, 2),
                            "bytes_per_token_with_manifest": round(total / num_tokens, 2),
                            "floor_bytes_per_token": floor,
                            "over_floor": round(shards / num_tokens / floor, 4),
                        }
                    )
                )


if __name__ == "__main__":
    main()
