"""Whether eval's `expected_tau_stderr` is the error it states: eval the shipped `tiny-drafter` on `tiny` at one
temperature over many seeds (online: each seed decodes anew; offline: each seed samples the completions anew and
walks them) and compare the spread of `expected_tau` across seeds with the mean stated error (per prompt, as eval
reports it) and with the error that treats every step as independent. Prints one JSON line per seed and a summary.

    python benchmarks/expected_tau_error.py --mode online --temperature 0.6 --seeds 30

At temperature < 1 the request also gets top-p 0.95 and top-k 20 (Qwen3's chat settings); 8 code prompts, 64 new
tokens, the vLLM default rule.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics


def independent_steps_stderr(summary: dict) -> float:
    """std over all steps' expected lengths / sqrt(steps): the error if steps were independent."""
    values = [e for p in summary["per_prompt"] for e in p["expected_lengths"]]
    return statistics.stdev(values) / len(values) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["online", "offline"], default="online")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from flashdraft.evaluation.config import EvalConfig
    from flashdraft.evaluation.run import run_eval

    torch.set_num_threads(1)
    filters = {"top_k": 20, "top_p": 0.95} if args.temperature < 1 else {}
    rows = []
    for seed in range(args.seeds):
        cfg = EvalConfig(
            checkpoint="tiny-drafter",
            target_model="tiny",
            prompts="builtin:code:heldout",
            num_prompts=args.prompts,
            max_new_tokens=64,
            online=args.mode == "online",
            temperature=args.temperature,
            seed=seed,
            **filters,
        )
        s = run_eval(cfg, log=lambda *_: None)
        rows.append(
            {
                "seed": seed,
                "tau": s["tau"],
                "expected_tau": s["expected_tau"],
                "expected_tau_stderr": s["expected_tau_stderr"],
                "independent_steps_stderr": independent_steps_stderr(s),
                "steps": s["num_steps"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    spread = statistics.stdev(r["expected_tau"] for r in rows)
    stated = statistics.mean(r["expected_tau_stderr"] for r in rows)
    independent = statistics.mean(r["independent_steps_stderr"] for r in rows)
    print(
        json.dumps(
            {
                "machine": platform.machine(),
                "mode": args.mode,
                "temperature": args.temperature,
                "filters": filters,
                "seeds": args.seeds,
                "prompts": args.prompts,
                "mean_tau": statistics.mean(r["tau"] for r in rows),
                "mean_expected_tau": statistics.mean(r["expected_tau"] for r in rows),
                "spread_of_expected_tau": spread,
                "spread_of_tau": statistics.stdev(r["tau"] for r in rows),
                "mean_stated_stderr": stated,
                "mean_independent_steps_stderr": independent,
                "spread_over_stated": spread / stated,
                "spread_over_independent": spread / independent,
            }
        )
    )


if __name__ == "__main__":
    main()
