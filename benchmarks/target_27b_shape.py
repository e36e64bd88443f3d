"""Offline evaluation against a target of Qwen3.6-27B's real widths and vocabulary on a CPU:
peak RSS, and proof that the decoder layers are never needed.

    .venv/bin/python benchmarks/target_27b_shape.py [--workdir DIR] [--dtype bf16]

Writes (about 6.6 GB of bf16 on disk) a checkpoint in the published Qwen3.5/3.6 layout
(vision-language config with the language model's in text_config, weights under
model.language_model., shards with model.safetensors.index.json) whose config says 64
decoder layers while only layers 0 and 1 are written; a drafter of the published
Qwen3.6-27B drafter's shape (5 layers, fc [5120, 25600], 4 sliding-window layers and one
full); and a small hidden-state cache of random features for it. Then runs
`flashdraft eval --cached-hidden-states` in its own process and prints one JSON line: its
peak RSS, time, and the bytes it read, next to the sizes of the embedding, the LM head and
the written decoder layers. The config's 62 absent layers make the whole-target path
impossible, so the run finishing proves the offline path never touches them; the bytes read
show that it reads the two present layers only for fingerprint samples.

Target widths from the published Qwen3.6-27B config: hidden 5120, 64 layers (3 Gated DeltaNet
to 1 gated attention), vocabulary 248,320 (the reference doc), rope_theta 1e7; attention 24
heads / 4 KV heads x 256, linear attention 16 key / 48 value heads x 128, intermediate 17408.
Only hidden and vocabulary size what the offline path reads.

Measured on a 2-core CPU with 24 GB (shared), --dtype bf16: see docs/benchmarks.md ("Memory").
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from gpu.shapes import LAYERS_3_LINEAR_1_FULL, QWEN36_27B_SLICE
from synthetic_target import (
    run_measured,
    write_random_cache,
    write_random_drafter,
    write_random_target,
    write_tokenizer,
)

HIDDEN, VOCAB = QWEN36_27B_SLICE["hidden_size"], QWEN36_27B_SLICE["vocab_size"]
LAYERS, WRITTEN = 64, 2
EOS_ID, PAD_ID, MASK_ID = 248044, 248055, 248070  # the drafter's published mask token id
DRAFTER_LAYER_IDS = [1, 16, 31, 46, 61]  # the published drafter's: 5 context layers, fc [5120, 25600]


def target_config():
    from transformers import Qwen3_5Config

    # the published widths (gpu_check's slice), all 64 layers declared
    text = dict(
        QWEN36_27B_SLICE,
        num_hidden_layers=LAYERS,
        layer_types=LAYERS_3_LINEAR_1_FULL * (LAYERS // 4),
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return Qwen3_5Config(text_config=text, tie_word_embeddings=False)


def drafter_config():
    from flashdraft.drafter.config import DrafterConfig

    return DrafterConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=17408,
        vocab_size=VOCAB,
        num_target_layers=LAYERS,
        target_layer_ids=DRAFTER_LAYER_IDS,
        mask_token_id=MASK_ID,
        block_size=16,
        rope_theta=1e7,
        max_position_embeddings=262144,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None, help="keep the files here (default: a temporary directory)")
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="eval --dtype (fp32: about 17 GB, 10 of embedding and LM head, 7 of drafter)",
    )
    parser.add_argument("--records", type=int, default=2)
    parser.add_argument("--max-blocks", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from flashdraft.target.weights import TargetHead

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        target = root / "target"
        if not (target / "model.safetensors.index.json").is_file():
            sizes = write_random_target(target, target_config(), layers_written=WRITTEN)
            write_tokenizer(target, VOCAB, EOS_ID, PAD_ID)
            (root / "sizes.json").write_text(json.dumps(sizes))
        sizes = json.loads((root / "sizes.json").read_text())
        if not (root / "drafter" / "config.json").is_file():
            write_random_drafter(root / "drafter", drafter_config())
        if not (root / "cache" / "manifest.json").is_file():
            head = TargetHead.load(target, dtype=torch.bfloat16)
            write_random_cache(root / "cache", head, DRAFTER_LAYER_IDS, args.records, 32, 96)
        argv = [
            "eval",
            "--checkpoint",
            str(root / "drafter"),
            "--target-model",
            str(target),
            "--cached-hidden-states",
            str(root / "cache"),
            "--max-blocks",
            str(args.max_blocks),
            "--dtype",
            args.dtype,
            "--json",
            str(root / "eval.json"),
        ]
        measured = run_measured(argv, root / "eval.log")
        summary = json.loads((root / "eval.json").read_text())
        mb = {k: round(v / 2**20) for k, v in sizes.items()}
        print(
            json.dumps(
                {
                    "experiment": "27b-shape",
                    "dtype": args.dtype,
                    "target_layers_in_config": LAYERS,
                    "target_layers_written": WRITTEN,
                    "stored_mb": mb,
                    "drafter_fc": [HIDDEN, HIDDEN * len(DRAFTER_LAYER_IDS)],
                    "records": args.records,
                    "steps": summary["num_steps"],
                    **measured,
                }
            )
        )


if __name__ == "__main__":
    main()
