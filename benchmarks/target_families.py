"""The README's pipeline on a tiny random target of each family with recurrent or latent caches (Qwen3-Next,
Nemotron-H, the MLA of DeepSeek-V3, GLM-4.7-Flash and DeepSeek-V2), with the built-in tiny target's 4096-token
BPE tokenizer: every stage's exit status, the held-out τ offline and online.

    .venv/bin/python benchmarks/target_families.py --work WORKDIR [--families qwen3_next,glm4_moe_lite:3] [--seed 0]

The targets are the test suite's (`tests/target/tiny_families.py`: hidden 128, 4 layers mixing the family's
layer kinds, MoE included) with the tokenizer's vocabulary, and their layers' output projections scaled by 0.2:
a random target is then close to a bigram model whose greedy text falls into cycles a drafter can learn in a few
hundred steps (an unscaled one writes text no drafter predicts, and `doctor RUN` rightly fails its τ check).
Prints one JSON line per family. Measured (2-core CPU): every stage exits 0 on all five, offline τ == online τ:
qwen3_next 1.363, nemotron_h 1.476, deepseek_v3 1.078, deepseek_v2 1.204, glm4_moe_lite (seed 3) 1.170. The
seed-0 glm4_moe_lite target writes text its drafter does not learn (τ 1.016 at 300 steps, 1.025 at 1000), so
`doctor RUN` fails its τ check there, as it should.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from flashdraft.target.model import TINY_DIR
from tests.target.tiny_families import FAMILIES, make_family_model

STAGES = [
    "generate --prompts builtin:code --out train.json --max-new-tokens 32 --num-prompts 12",
    "generate --prompts builtin:code:heldout --out heldout.json --max-new-tokens 32 --num-prompts 4",
    "cache --completions train.json --out cache-train --layers 2",
    "cache --completions heldout.json --out cache-heldout --layers 2",
    "init --out init --draft-layers 1 --block-size 8",
    "train --cached-hidden-states cache-train --out run --init init --max-steps 300 --lr 0.006 --num-anchors 8 "
    "--eval-every 100 --eval-cached-hidden-states cache-heldout",
    "train --completions train.json --out online --init init --max-steps 30 --num-anchors 8",
    "eval --checkpoint run --cached-hidden-states cache-heldout --reference ngram --json eval.json",
    "eval --checkpoint run --completions heldout.json --online --check-consistency",
    "export --checkpoint run --out drafter",
    "doctor run",
    "doctor drafter --serving",
    "parity --num-prompts 2",
]


def save_bpe_target(directory: Path, model_type: str, seed: int) -> Path:
    """The family's tiny target over the tiny target's tokenizer (EOS 0, pad 1), near-bigram (module doc)."""
    model = make_family_model(model_type, seed, vocab_size=4096, eos_token_id=0, pad_token_id=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight", "experts.down_proj")):
                param.mul_(0.2)
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_DIR / name, directory / name)
    return directory


def run_family(work: Path, model_type: str, seed: int) -> dict:
    target = save_bpe_target(work / "target", model_type, seed)
    row = {"family": model_type, "seed": seed, "exit": {}}
    for i, stage in enumerate(STAGES):
        argv = [sys.executable, "-m", "flashdraft", *stage.split(), "--target-model", str(target)]
        done = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=900)
        row["exit"][f"{i + 1} {stage.split()[0]}"] = done.returncode
        for line in done.stdout.splitlines():
            if line.startswith("offline vs online:"):
                row["consistency"] = line
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for item in args.families.split(","):  # FAMILY or FAMILY:SEED
        model_type, _, seed = item.partition(":")
        work = args.work / model_type
        work.mkdir(parents=True, exist_ok=True)
        print(json.dumps(run_family(work, model_type, int(seed or args.seed))), flush=True)


if __name__ == "__main__":
    main()
