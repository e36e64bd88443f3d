"""Report on the built-in tiny target: held-out loss (from training.json), greedy
continuations of code prompts, and the share of distinct 4-grams in 200-token greedy
continuations (a target that loops on one line scores near 0).

    .venv/bin/python scripts/tiny_target_report.py [--tokens 200] [--target DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.target.model import TINY_DIR, TargetModel

PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef list_python_files(directory):\n",
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    "    def __repr__(self):\n",
    "def read_config(path):\n    with open(path) as f:\n",
]


def distinct_4gram_share(tokens: list[int]) -> float:
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / max(1, len(grams))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--target", type=Path, default=TINY_DIR, help="a target directory written by train_tiny_target.py")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = TargetModel.load(args.target)
    info = json.loads((args.target / "training.json").read_text())
    shares = []
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt)["input_ids"]
        out = autoregressive_generate(target, ids, args.tokens)
        shares.append(distinct_4gram_share(out.output_ids))
        print(f"--- {prompt!r} (distinct 4-grams {shares[-1]:.2f})")
        print(prompt + target.tokenizer.decode(out.output_ids))
    print(
        json.dumps(
            {
                "parameters_m": round(info["parameters"] / 1e6, 2),
                "held_out_loss": round(info["held_out_loss"], 3),
                "train_minutes": info["minutes"],
                "train_tokens_seen": info["train_tokens_seen"],
                "vocab_size": target.vocab_size,
                "layer_types": target.layer_types,
                "distinct_4gram_share_mean": round(sum(shares) / len(shares), 3),
                "distinct_4gram_share_min": round(min(shares), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
