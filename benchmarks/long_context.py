"""Long context on the built-in target: τ by context length on held-out long files, for the same
drafter shape trained with and without long data, and the target's own loss by position beside it
(so a drafter's fall is never blamed on a target that breaks).

    python benchmarks/long_context.py --work WORKDIR --steps 400 \
        [--runs short long long-yarn sliding-short sliding-long] [--threads 1]

Every run starts from the shipped `tiny-drafter` (stage 1: native RoPE, completions of a few hundred
tokens) and trains --steps more with a fresh optimizer (warm start from the weights only), the
shipped recipe otherwise (D-PACE + Muon, 16 anchors; batch 4, lr 3e-3: a short re-warm):
- `short`: on short data (`builtin:stdlib`, the stage-1 distribution): the same shape trained on short data only;
- `long`: on long data (`builtin:long`: contexts of 128 to 3,584 tokens), native RoPE;
- `long-yarn`: the same with YaRN (factor 8 over the 512 positions stage 1 was trained at);
- `sliding-short` / `sliding-long`: every layer a sliding window of SLIDING_WINDOW tokens, short / long data.
Held out: `builtin:long:heldout`, every long held-out file continued from one cut after 128, 512, 1,024,
2,048 and 3,584 tokens of context, 96 new tokens each, with the n-gram baseline beside it. Online, the
cost side: each bucket's draft and verify time per step for a drafter of each family and attention layout,
and the speed-up bound they imply. Every stage is one `flashdraft` command and resumes: outputs that exist
are reused. Prints one JSON line per run and a closing JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from recipe import flashdraft

LAYERS = "1,2,3"
BUCKETS = "0,256,768,1536,3072,4096"  # each held-out context length in its own bucket, with its 96 new tokens
DATA = {  # name: (prompts, new tokens)
    "heldout": ("builtin:long:heldout", 96),
    "train-long": ("builtin:long:800", 128),
    "train-short": ("builtin:stdlib:800", 128),
}
TRAIN_ARGS = [
    "--loss-weighting",
    "dpace",
    "--dpace-alpha",
    "0.5",
    "--optimizer",
    "muon",
    "--lr",
    "3e-3",
    "--warmup-fraction",
    "0.05",
    "--num-anchors",
    "16",
    "--batch-size",
    "4",
    "--epochs",
    "100",
    "--save-every",
    "100",
    "--log-every",
    "25",
]
SLIDING_WINDOW = 512
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}
LOSS_BUCKETS = (0, 128, 512, 1024, 2048, 3072, 4096)
# the cost side, online: drafters of each family and attention layout, tiny-drafter's shape (untrained but for
# the shipped one: a step's cost does not depend on the weights), on the first COST_PROMPTS held-out prompts
COST_PROMPTS = 25  # 5 files x 5 context lengths
COST_DRAFTERS = {
    "dflash-full": None,  # the shipped tiny-drafter
    "dflash-sliding": ["--layer-types", "sliding", "--sliding-window", str(512)],
    "dflash2-sliding": ["--family", "dflash2", "--layer-types", "sliding", "--sliding-window", str(512)],
    "dspark-full": ["--family", "dspark"],
}


def prepare(work: Path) -> None:
    """Completions and bf16 caches of the held-out and training sets (reused when there)."""
    work.mkdir(parents=True, exist_ok=True)
    tiny = ["--target-model", "tiny"]
    for name, (prompts, new_tokens) in DATA.items():
        if not (work / f"{name}.json").exists():
            flashdraft(
                [
                    "generate",
                    *tiny,
                    "--prompts",
                    prompts,
                    "--out",
                    str(work / f"{name}.json"),
                    "--max-new-tokens",
                    str(new_tokens),
                    "--batch-size",
                    "32",
                ]
            )
        if not (work / f"cache-{name}" / "manifest.json").exists():
            flashdraft(
                [
                    "cache",
                    *tiny,
                    "--completions",
                    str(work / f"{name}.json"),
                    "--out",
                    str(work / f"cache-{name}"),
                    "--layers",
                    LAYERS,
                    "--dtype",
                    "bf16",
                ]
            )


def make_init(work: Path, run: str) -> Path:
    """The shipped tiny-drafter's weights under the run's attention and RoPE (a config change, the same tensors)."""
    from flashdraft.drafter.run_dir import BUILTIN_DRAFTERS

    init = work / f"init-{run}"
    if (init / "config.json").exists():
        return init
    shutil.copytree(BUILTIN_DRAFTERS["tiny-drafter"], init)
    config = json.loads((init / "config.json").read_text())
    if run.startswith("sliding"):
        config |= {
            "layer_types": ["sliding_attention"] * config["num_hidden_layers"],
            "sliding_window": SLIDING_WINDOW,
            "use_sliding_window": True,
        }
    if run.endswith("yarn"):
        config |= {"rope_scaling": YARN, "rope_parameters": {**YARN, "rope_theta": config["rope_theta"]}}
    (init / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return init


def evaluate(work: Path, name: str, checkpoint: str) -> dict:
    out = work / f"eval-{name}.json"
    if not out.exists():
        flashdraft(
            [
                "eval",
                "--checkpoint",
                checkpoint,
                "--target-model",
                "tiny",
                "--cached-hidden-states",
                str(work / "cache-heldout"),
                "--reference",
                "ngram",
                "--context-buckets",
                BUCKETS,
                "--json",
                str(out),
            ]
        )
    return json.loads(out.read_text())


def buckets_of(figures: dict) -> list[dict]:
    return [
        {
            "context": f"{b['context_from']}-{b['context_to']}",
            "steps": b["steps"],
            "tau": None if b["tau"] is None else round(b["tau"], 4),
            "draft_1": None if b["position_acceptance"] is None else round(b["position_acceptance"][0], 3),
        }
        for b in figures["by_context"]
    ]


def target_loss_by_position(limit: int = 4096) -> dict:
    """The built-in target's mean next-token loss per position bucket over the first `limit` tokens of every
    held-out long file that has that many (files the target never trained on)."""
    import torch

    from flashdraft.data.long_context import _usable
    from flashdraft.data.stdlib import stdlib_files, stdlib_root
    from flashdraft.target.model import TargetModel

    target = TargetModel.load("tiny")
    sums, counts, files = torch.zeros(len(LOSS_BUCKETS) - 1), torch.zeros(len(LOSS_BUCKETS) - 1), 0
    for path in sorted(stdlib_files()[1]):
        if not _usable(path, stdlib_root()):
            continue
        ids = target.tokenizer(path.read_text(encoding="utf-8", errors="replace"))["input_ids"][:limit]
        if len(ids) < limit:
            continue
        files += 1
        with torch.no_grad():
            logits = target.model(torch.tensor([ids])).logits[0, :-1].float()  # [limit - 1, V]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        for i, (low, high) in enumerate(zip(LOSS_BUCKETS, LOSS_BUCKETS[1:], strict=False)):
            sums[i] += loss[low : high - 1].sum()
            counts[i] += loss[low : high - 1].numel()
    return {
        "files": files,
        "buckets": [
            {"positions": f"{low}-{high}", "loss": round(float(s / c), 4)}
            for low, high, s, c in zip(LOSS_BUCKETS, LOSS_BUCKETS[1:], sums, counts, strict=False)
        ],
    }


def online_costs(work: Path) -> dict:
    """Per context bucket, each drafter's measured draft and verify ms per step and the speed-up bound, online
    (one eval run each, after a warm-up; compare them as ratios within this run)."""
    out = {}
    for name, init_args in COST_DRAFTERS.items():
        checkpoint = "tiny-drafter"
        if init_args is not None:
            checkpoint = str(work / f"init-cost-{name}")
            if not (Path(checkpoint) / "config.json").exists():
                flashdraft(
                    [
                        "init",
                        "--target-model",
                        "tiny",
                        "--out",
                        checkpoint,
                        "--draft-layers",
                        "2",
                        "--target-layer-ids",
                        LAYERS,
                        *init_args,
                    ]
                )
        path = work / f"online-{name}.json"
        if not path.exists():
            flashdraft(
                [
                    "eval",
                    "--checkpoint",
                    checkpoint,
                    "--target-model",
                    "tiny",
                    "--completions",
                    str(work / "heldout.json"),
                    "--num-prompts",
                    str(COST_PROMPTS),
                    "--online",
                    "--context-buckets",
                    BUCKETS,
                    "--json",
                    str(path),
                ]
            )
        figures = json.loads(path.read_text())
        out[name] = [
            {
                "context": f"{b['context_from']}-{b['context_to']}",
                "steps": b["steps"],
                **{
                    k: None if b[k] is None else round(b[k], 3)
                    for k in ("draft_ms", "verify_ms", "greedy_step_ms", "speedup_bound")
                },
            }
            for b in figures["by_context"]
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--runs", nargs="+", default=["short", "long", "long-yarn", "sliding-short", "sliding-long"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-only", action="store_true", help="make completions and caches, then stop")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    work = Path(args.work)
    prepare(work)
    if args.data_only:
        return
    shipped = evaluate(work, "shipped", "tiny-drafter")
    results = {"shipped": buckets_of(shipped)}
    print(json.dumps({"run": "shipped", "tau": round(shipped["tau"], 4), "by_context": results["shipped"]}), flush=True)
    walls = {}
    for run in args.runs:
        data = "train-long" if "long" in run.split("-") else "train-short"
        run_dir = work / f"run-{run}-{args.steps}"
        t0 = time.time()
        flashdraft(
            [
                "train",
                "--target-model",
                "tiny",
                "--cached-hidden-states",
                str(work / f"cache-{data}"),
                "--out",
                str(run_dir),
                "--init",
                str(make_init(work, run)),
                *TRAIN_ARGS,
                "--max-steps",
                str(args.steps),
                "--resume",
            ],
            log=work / f"train-{run}-{args.steps}.log",
        )
        walls[run] = round(time.time() - t0)
        figures = evaluate(work, f"{run}-{args.steps}", str(run_dir))
        results[run] = buckets_of(figures)
        print(
            json.dumps(
                {
                    "run": run,
                    "data": data,
                    "steps": args.steps,
                    "train_wall_s": walls[run],
                    "tau": round(figures["tau"], 4),
                    "by_context": results[run],
                }
            ),
            flush=True,
        )
    ngram = buckets_of(shipped["reference"])
    ratios = {}
    for run in args.runs:
        base = "sliding-short" if run.startswith("sliding") and "sliding-short" in results else "short"
        if run == base or base not in results:
            continue
        ratios[f"{run}/{base}"] = [
            round(a["tau"] / b["tau"], 4) if a["tau"] and b["tau"] else None
            for a, b in zip(results[run], results[base], strict=True)
        ]
    summary = {
        "machine": platform.machine(),
        "threads": args.threads,
        "steps": args.steps,
        "buckets": [b["context"] for b in results["shipped"]],
        "by_context": results,
        "ngram": ngram,
        "ratio_per_bucket": ratios,
        "target_loss_by_position": target_loss_by_position(),
        "online_costs": online_costs(work),
        "python": sys.version.split()[0],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
