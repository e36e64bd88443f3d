"""A drafter's served speed-up, measured by `flashdraft bench` beside the speed-up it predicts, in one run.

    .venv/bin/python benchmarks/served_speedup.py --work WORKDIR [--hidden 512] [--layers 8] [--train-steps 60]
        [--concurrency 1,2,4] [--num-prompts 8] [--max-new-tokens 64] [--repeats 3]

Builds the dense Qwen3 target of benchmarks/engine.py (random weights, sharpened logits, the tiny target's
tokenizer), trains a 1-layer DFlash drafter (block 8) `--train-steps` on the target's greedy completions of 32
`builtin:code` prompts, then runs `flashdraft bench` on two held-out sets (`builtin:code:heldout`,
`builtin:stdlib:heldout`) at each concurrency, and `flashdraft eval --served vllm` on the first set's requests:
its τ from the engine's counters must equal bench's at concurrency 1. Prints one JSON line (the per-set,
per-concurrency figures) and writes the whole bench summary to WORKDIR/bench.json. Time nothing beside another
job; the ratios are measured within one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engine import build_target, flashdraft  # noqa: E402  (the engine benchmark's target and runner)

SETS = "builtin:code:heldout,builtin:stdlib:heldout"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    target = build_target(work / "target", args.hidden, args.layers)
    t = ["--target-model", target]
    flashdraft(
        "generate",
        *t,
        "--prompts",
        "builtin:code",
        "--num-prompts",
        32,
        "--max-new-tokens",
        128,
        "--batch-size",
        8,
        "--out",
        work / "train.json",
    )
    flashdraft(
        "init", *t, "--out", work / "init", "--draft-layers", 1, "--target-layer-ids", "1,4,6", "--block-size", 8
    )
    flashdraft(
        "train",
        *t,
        "--completions",
        work / "train.json",
        "--out",
        work / "run",
        "--init",
        work / "init",
        "--max-steps",
        args.train_steps,
        "--epochs",
        1000,
    )
    requests = ["--num-prompts", args.num_prompts, "--max-new-tokens", args.max_new_tokens]
    bench_s, table = flashdraft(
        "bench",
        *t,
        "--checkpoint",
        work / "run",
        "--prompts",
        SETS,
        *requests,
        "--concurrency",
        args.concurrency,
        "--repeats",
        args.repeats,
        "--json",
        work / "bench.json",
        "--report",
        work / "report",
        "--work",
        work / "logs",
    )
    flashdraft(
        "eval",
        "--checkpoint",
        work / "run",
        *t,
        "--prompts",
        SETS.split(",")[0],
        *requests,
        "--served",
        "vllm",
        "--json",
        work / "served.json",
    )
    summary = json.loads((work / "bench.json").read_text())
    served = json.loads((work / "served.json").read_text())["served"]
    print(table[table.index("served speed-up:") :])
    print(
        json.dumps(
            {
                "machine": summary["machine"],
                "engine": summary["engine"],
                "bench_s": bench_s,
                "target": f"dense Qwen3, hidden {args.hidden}, {args.layers} layers",
                "lossless": summary["lossless"],
                "eval_served_tau": served["tau"],
                "sets": {
                    s["prompts"]: {
                        "flashdraft_tau": s["flashdraft_tau"],
                        "by_concurrency": [
                            {
                                "concurrency": r["concurrency"],
                                "tok_s_alone": r["baseline"]["output_tok_s"],
                                "tok_s_drafter": r["speculative"]["output_tok_s"],
                                "speedup": r["speedup_output_tok_s"],
                                "speedup_tpot": r["speedup_tpot"],
                                "predicted": r["predicted"],
                                "tau": r["tau"],
                                "tau_delivered": r["tau_delivered"],
                                "step_costs_ms": r["step_costs_ms"],
                            }
                            for r in s["by_concurrency"]
                        ],
                    }
                    for s in summary["sets"]
                },
            }
        )
    )


if __name__ == "__main__":
    main()
