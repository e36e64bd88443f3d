"""Completions through the serving engine against flashdraft's own generation, measured in one run.

    .venv/bin/python benchmarks/engine_completions.py --work WORKDIR [--num-prompts 32] [--max-new-tokens 128]
        [--hidden 512] [--layers 8] [--batch-size 8]

Builds a dense Qwen3 target (random weights, sharpened logits, the built-in tiny target's tokenizer; the CPU
engine does not run the built-in hybrid `tiny`), then generates the first N prompts of builtin:code greedily
twice: `flashdraft generate` (local, transformers) and `flashdraft generate --engine vllm` (a vLLM server it
starts and stops; the startup is timed apart). Prints one JSON line: seconds and tokens/s of each, the ratio
local / engine with and without the engine's startup, and whether the tokens are identical (greedy, fp32).
Time nothing beside another job: on 2 cores two torch jobs slow each other many times over.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from flashdraft.target import resolve_target_path


def build_target(directory: Path, hidden: int, layers: int) -> Path:
    tiny = resolve_target_path("tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 128),
                      head_dim=64, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      max_position_embeddings=2048, tie_word_embeddings=True)  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)  # sharper logits: greedy far from ties
    model.float().eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def timed_generate(target: Path, out: Path, args: argparse.Namespace, engine: bool) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "flashdraft", "generate", "--target-model", str(target), "--prompts",
           "builtin:code", "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--batch-size", str(args.batch_size), "--out", str(out)]  # fmt: skip
    cmd += ["--engine", "vllm"] if engine else []
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return time.perf_counter() - start, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
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
    print(json.dumps({
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens, "target": f"dense Qwen3, hidden {args.hidden}, {args.layers} layers",
        "tokens": tokens, "local_s": local_s, "engine_s": engine_s, "engine_startup_s": startup_s,
        "local_tokens_per_s": tokens / local_s, "engine_tokens_per_s": tokens / engine_s,
        "ratio_with_startup": local_s / engine_s,
        "ratio_without_startup": local_s / (engine_s - startup_s) if startup_s else None,
        "identical_tokens": [r["completion_ids"] for r in local] == [r["completion_ids"] for r in engine],
    }))  # fmt: skip


def _startup_seconds(stdout: str) -> float | None:
    """generate --engine prints the server's startup time (`engine ready after S s`)."""
    for line in stdout.splitlines():
        if "ready after" in line:
            return float(line.split("ready after")[1].split()[0])
    return None


if __name__ == "__main__":
    main()
