"""The serving engine in the loop, measured in one run: completions, served τ, a verified capture.

    .venv/bin/python benchmarks/engine.py --work WORKDIR [--num-prompts 32] [--max-new-tokens 128]
        [--hidden 512] [--layers 8] [--batch-size 8] [--train-steps 300] [--parts completions,served,capture]

Builds a dense Qwen3 target (random weights, sharpened logits, the built-in tiny target's tokenizer; the CPU
engine does not run the built-in hybrid `tiny`), then:
1. completions: the first N prompts of builtin:code greedily, `flashdraft generate` (local, transformers) and
   `flashdraft generate --engine vllm` (a vLLM server it starts and stops; its startup timed apart): seconds,
   tokens/s, the ratio local / engine with and without the startup, and whether the tokens are identical;
2. served τ: a DFlash drafter trained `--train-steps` on those completions, `flashdraft eval --served vllm
   --check-served` at T = 0 on held-out prompts: the engine's τ and flashdraft's, and the check;
3. capture: `flashdraft cache --engine vllm` against `flashdraft cache`: seconds, the verification's figures and
   the largest difference between the two caches.
Prints one JSON line per part. Time nothing beside another job: on 2 cores two torch jobs slow each other many
times over.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from flashdraft.target.model import resolve_target_path


def build_target(directory: Path, hidden: int, layers: int) -> Path:
    tiny = resolve_target_path("tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)  # sharper logits: greedy far from ties
    model.float().eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def flashdraft(*argv, ok=(0,)) -> tuple[float, str]:
    """`flashdraft ARGV` as a user runs it: (seconds, stdout); stops the benchmark on an unexpected exit."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flashdraft", *map(str, argv)], capture_output=True, text=True)
    if done.returncode not in ok:
        raise SystemExit(f"flashdraft {argv[0]} exited {done.returncode}: {done.stderr[-2000:]}")
    return time.perf_counter() - start, done.stdout


def timed_generate(target: Path, out: Path, args: argparse.Namespace, engine: bool) -> tuple[float, str]:
    return flashdraft(
        "generate",
        "--target-model",
        target,
        "--prompts",
        "builtin:code",
        "--num-prompts",
        args.num_prompts,
        "--max-new-tokens",
        args.max_new_tokens,
        "--batch-size",
        args.batch_size,
        "--out",
        out,
        *(["--engine", "vllm"] if engine else []),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--parts", default="completions,served,capture", help="which parts to run (comma-separated)")
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    target = build_target(work / "target", args.hidden, args.layers)
    local_s, _ = timed_generate(target, work / "local.json", args, engine=False)
    engine_s, log = timed_generate(target, work / "engine.json", args, engine=True)
    local = json.loads((work / "local.json").read_text())["records"]
    engine = json.loads((work / "engine.json").read_text())["records"]
    tokens = sum(len(r["completion_ids"]) for r in local)
    startup_s = _startup_seconds(log)
    print(
        json.dumps(
            {
                "part": "completions",
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "prompts": args.num_prompts,
                "max_new_tokens": args.max_new_tokens,
                "target": f"dense Qwen3, hidden {args.hidden}, {args.layers} layers",
                "tokens": tokens,
                "local_s": local_s,
                "engine_s": engine_s,
                "engine_startup_s": startup_s,
                "local_tokens_per_s": tokens / local_s,
                "engine_tokens_per_s": tokens / engine_s,
                "ratio_with_startup": local_s / engine_s,
                "ratio_without_startup": local_s / (engine_s - startup_s) if startup_s else None,
                "identical_tokens": [r["completion_ids"] for r in local] == [r["completion_ids"] for r in engine],
            }
        )
    )
    if "served" in args.parts:
        served_part(target, work, args)
    if "capture" in args.parts:
        capture_part(target, work)


def served_part(target: Path, work: Path, args: argparse.Namespace) -> None:
    t = ["--target-model", target]
    flashdraft(
        "generate",
        *t,
        "--prompts",
        "builtin:code:heldout",
        "--num-prompts",
        8,
        "--max-new-tokens",
        64,
        "--out",
        work / "heldout.json",
    )
    flashdraft(
        "init", *t, "--out", work / "init", "--draft-layers", 1, "--target-layer-ids", "1,4,6", "--block-size", 8
    )
    train_s, _ = flashdraft(
        "train",
        *t,
        "--completions",
        work / "local.json",
        "--out",
        work / "run",
        "--init",
        work / "init",
        "--max-steps",
        args.train_steps,
        "--epochs",
        1000,
    )
    seconds, _ = flashdraft(
        "eval",
        "--checkpoint",
        work / "run",
        *t,
        "--completions",
        work / "heldout.json",
        "--served",
        "vllm",
        "--check-served",
        "--json",
        work / "served.json",
        ok=(0, 1),
    )
    served = json.loads((work / "served.json").read_text())["served"]
    print(
        json.dumps(
            {
                "part": "served",
                "engine": served["engine"],
                "requests": len(served["requests"]),
                "train_s": train_s,
                "eval_s": seconds,
                "served_tau": served["tau"],
                "served_tau_delivered": served["tau_delivered"],
                "flashdraft_tau": served["flashdraft"]["tau"],
                "flashdraft_tau_uncut": served["flashdraft"]["tau_uncut"],
                "drafts": served["drafts"],
                "steps": served["flashdraft"]["steps"],
                "accepted_past_output": served["accepted_past_output"],
                "check": served["check"],
            }
        )
    )


def capture_part(target: Path, work: Path) -> None:
    from flashdraft.data.cache_reader import HiddenStateCache

    common = ["--target-model", target, "--completions", work / "local.json", "--layers", "1,4,6"]
    engine_s, _ = flashdraft("cache", *common, "--out", work / "cache-engine", "--engine", "vllm")
    local_s, _ = flashdraft("cache", *common, "--out", work / "cache-local")
    engine, local = HiddenStateCache(work / "cache-engine"), HiddenStateCache(work / "cache-local")
    worst = max(float((engine.features(i) - local.features(i)).abs().max()) for i in range(len(local)))
    verified = engine.manifest["computed_with"]["engine"]["verification"]
    print(
        json.dumps(
            {
                "part": "capture",
                "records": len(local),
                "tokens": local.num_tokens,
                "engine_s": engine_s,
                "local_s": local_s,
                "max_abs_difference": worst,
                "verification": verified,
            }
        )
    )


def _startup_seconds(stdout: str) -> float | None:
    """generate --engine prints the server's startup time (`engine ready after S s`)."""
    for line in stdout.splitlines():
        if "ready after" in line:
            return float(line.split("ready after")[1].split()[0])
    return None


if __name__ == "__main__":
    main()
