"""Peak memory of `flashdraft cache` and offline `flashdraft eval`/`train`: flat in the number
of records (features are streamed shard by shard when caching and read one record at a time
when evaluating) and flat in the depth of the target (offline reads only its embeddings and
LM head, `flashdraft/target/weights.py`).

    .venv/bin/python benchmarks/memory.py [--experiment records|tiny|depth|all] [--records 100,300,1000]
        [--tokens 256] [--depths 4,16,48] [--no-whole] [--workdir DIR]

Every measured command runs as its own process (`synthetic_target.run_measured`) and prints
one JSON line: peak RSS, wall time of the process, seconds of `main` after the interpreter and
torch started, and bytes it read.

records: a random Qwen3-shaped target (hidden 128, 4 layers) and random completions of
`--tokens` tokens each; `cache` and offline `eval` per record count, and a last line comparing
the growth in peak RSS with the size of the features that were streamed. Measured on a 2-core
CPU (100 -> 1000 records of 256 tokens): peak RSS +7 MB for cache and +6 MB for eval while
169 MB more features streamed through (the growth is the records' token ids, about 30 bytes
per token as Python lists).

tiny: offline eval of 5 prompts x 15 blocks on the built-in target, through the target head
and the whole target, with the interpreter's start and a second run in the same process.

depth: a Qwen3.5-style hybrid at hidden 1024, vocabulary 32k (untied), intermediate 3072, with
4, 16 and 48 layers written to disk in bf16 (`synthetic_target.py`), a random 5-record cache,
then offline eval (5 prompts x 15 blocks) and 20 offline train steps (batch 1, 4 anchors),
through the head (as shipped) and, unless --no-whole, through the whole target (as before).
Figures: docs/benchmarks.md ("Memory").
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from synthetic_target import run_measured, write_random_cache, write_random_target, write_tokenizer

from flashdraft.drafter.init import DrafterChoices

HIDDEN, LAYERS, VOCAB = 128, 4, 512
CACHE_LAYERS = [0, 1, 2]  # three context layers: 768 bf16 features (1.5 KB) per token


def write_target(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        eos_token_id=VOCAB - 2,
        pad_token_id=VOCAB - 1,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<eos>": VOCAB - 2, "<pad>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>").save_pretrained(directory)


def write_completions(path: Path, target_dir: Path, fingerprint: str, count: int, tokens: int) -> None:
    """`count` records of random ids in the completions format (docs/data-formats.md), a
    quarter of each record prompt and the rest completion."""
    rng = random.Random(0)
    prompt_len = tokens // 4
    header = {
        "format": "flashdraft.completions",
        "version": 1,
        "target": {"fingerprint": fingerprint, "path": str(target_dir), "vocab_size": VOCAB},
        "generation": {"prompts": "synthetic", "max_new_tokens": tokens - prompt_len, "temperature": 0.0},
        "token_ids": "target",
        "num_records": count,
    }
    with open(path, "w") as f:
        f.write(json.dumps(header)[:-1] + ', "records": [\n')
        for i in range(count):
            ids = [rng.randrange(VOCAB - 2) for _ in range(tokens)]
            record = {
                "id": f"r{i:05d}",
                "prompt": "",
                "prompt_ids": ids[:prompt_len],
                "completion_ids": ids[prompt_len:],
                "completion": "",
                "stop_reason": "length",
            }
            f.write(("," if i else "") + json.dumps(record) + "\n")
        f.write("]}\n")


def records_experiment(root: Path, counts: list[int], tokens: int) -> None:
    from flashdraft.drafter.checkpoint import save_drafter
    from flashdraft.drafter.init import new_drafter_for_target
    from flashdraft.target.weights import TargetHead

    write_target(root / "target")
    target = TargetHead.load(root / "target")
    save_drafter(
        new_drafter_for_target(
            target,
            choices=DrafterChoices(num_layers=1, block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=CACHE_LAYERS),
        ),
        root / "drafter",
    )
    rows = []
    for n in counts:
        completions, cache = root / f"c{n}.json", root / f"cache{n}"
        write_completions(completions, root / "target", target.fingerprint(), n, tokens)
        cache_cmd = [
            "cache",
            "--target-model",
            str(root / "target"),
            "--completions",
            str(completions),
            "--out",
            str(cache),
            "--layers",
            ",".join(map(str, CACHE_LAYERS)),
            "--dtype",
            "bf16",
        ]
        eval_cmd = [
            "eval",
            "--checkpoint",
            str(root / "drafter"),
            "--target-model",
            str(root / "target"),
            "--cached-hidden-states",
            str(cache),
            "--max-blocks",
            "2",
        ]
        feature_mb = n * tokens * len(CACHE_LAYERS) * HIDDEN * 2 / 2**20
        for command, argv in (("cache", cache_cmd), ("eval", eval_cmd)):
            measured = run_measured(argv, root / f"{command}{n}.log")
            row = {
                "command": command,
                "records": n,
                "tokens": n * tokens,
                "peak_rss_mb": measured["peak_rss_mb"],
                "features_mb": round(feature_mb, 1),
                "seconds": measured["wall_s"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    for command in ("cache", "eval"):
        points = [r for r in rows if r["command"] == command]
        first, last = points[0], points[-1]
        growth = {
            "peak_rss_growth_mb": round(last["peak_rss_mb"] - first["peak_rss_mb"], 1),
            "features_streamed_growth_mb": round(last["features_mb"] - first["features_mb"], 1),
        }
        print(json.dumps({"command": command, "records": [first["records"], last["records"]], **growth}))


# -- offline eval and train against target depth ----------------------------------------------

DEPTH_HIDDEN, DEPTH_VOCAB, DEPTH_LAYER_IDS = 1024, 32000, [1, 2]
EOS_ID, PAD_ID, MASK_ID = 2, 1, DEPTH_VOCAB - 1


def hybrid_config(num_layers: int):
    """A Qwen3.5-style hybrid (3 Gated DeltaNet layers to 1 gated attention layer), hidden 1024."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=DEPTH_VOCAB,
        hidden_size=DEPTH_HIDDEN,
        intermediate_size=3072,
        num_hidden_layers=num_layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def offline_commands(target: Path, drafter: Path, cache: Path, run: Path) -> dict[str, list[str]]:
    """Offline eval of 5 prompts x 15 blocks and 20 offline train steps (5 records, batch 1, 4 epochs)."""
    common = ["--target-model", str(target), "--cached-hidden-states", str(cache)]
    return {
        "eval": ["eval", "--checkpoint", str(drafter), *common, "--num-prompts", "5", "--max-blocks", "15"],
        "train": [
            "train",
            *common,
            "--init",
            str(drafter),
            "--out",
            str(run),
            "--max-steps",
            "20",
            "--epochs",
            "4",
            "--batch-size",
            "1",
            "--num-anchors",
            "4",
            "--save-every",
            "1000",
            "--log-every",
            "10",
        ],
    }


def depth_experiment(root: Path, depths: list[int], whole: bool) -> None:
    """Peak RSS and time of offline eval and train against target depth at equal width, through
    the target head (as shipped) and, with `whole`, through the whole loaded target (as before)."""
    from flashdraft.drafter.checkpoint import save_drafter
    from flashdraft.drafter.init import new_drafter_for_target
    from flashdraft.target.weights import TargetHead

    rows = []
    for depth in depths:
        target = root / f"hybrid{depth}"
        sizes = write_random_target(target, hybrid_config(depth))
        write_tokenizer(target, DEPTH_VOCAB, EOS_ID, PAD_ID)
        head = TargetHead.load(target)
        cache = write_random_cache(root / f"cache{depth}", head, DEPTH_LAYER_IDS, 5, 32, 96)
        drafter = root / f"drafter{depth}"
        save_drafter(
            new_drafter_for_target(
                head,
                choices=DrafterChoices(
                    num_layers=1, block_size=16, mask_token_id=MASK_ID, target_layer_ids=DEPTH_LAYER_IDS
                ),
            ),
            drafter,
        )
        for path in ("head", "whole") if whole else ("head",):
            for command, argv in offline_commands(target, drafter, cache, root / f"run{depth}-{path}").items():
                measured = run_measured(argv, root / f"{command}{depth}-{path}.log", whole_target=path == "whole")
                row = {
                    "experiment": "depth",
                    "command": command,
                    "target_path": path,
                    "target_layers": depth,
                    "target_weights_mb": round(sum(sizes.values()) / 2**20),
                    **measured,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        shutil.rmtree(target)  # the next depth's target takes its disk space
    for command in ("eval", "train"):
        for path in ("head", "whole") if whole else ("head",):
            points = [r for r in rows if r["command"] == command and r["target_path"] == path]
            rss = [p["peak_rss_mb"] for p in points]
            print(
                json.dumps(
                    {
                        "experiment": "depth",
                        "command": command,
                        "target_path": path,
                        "target_layers": depths,
                        "peak_rss_mb": rss,
                        "growth_percent": round(100 * (rss[-1] / rss[0] - 1), 1),
                        "wall_s": [p["wall_s"] for p in points],
                    }
                )
            )


def tiny_experiment(root: Path) -> None:
    """Offline eval of 5 prompts x 15 blocks on the built-in target: seconds of `main` (after the
    interpreter and torch started), against the whole-target path and the interpreter start."""
    from flashdraft.cli import main as flashdraft
    from flashdraft.drafter.checkpoint import save_drafter
    from flashdraft.drafter.init import new_drafter_for_target
    from flashdraft.target.weights import TargetHead

    save_drafter(
        new_drafter_for_target(TargetHead.load("tiny"), choices=DrafterChoices(num_layers=1, block_size=16)),
        root / "tiny-drafter",
    )
    assert (
        flashdraft(
            [
                "generate",
                "--target-model",
                "tiny",
                "--prompts",
                "builtin:code:heldout",
                "--num-prompts",
                "5",
                "--out",
                str(root / "tiny.json"),
                "--max-new-tokens",
                "64",
            ]
        )
        == 0
    )
    assert (
        flashdraft(
            [
                "cache",
                "--target-model",
                "tiny",
                "--completions",
                str(root / "tiny.json"),
                "--out",
                str(root / "tiny-cache"),
                "--draft-config",
                str(root / "tiny-drafter"),
            ]
        )
        == 0
    )
    argv = offline_commands(Path("tiny"), root / "tiny-drafter", root / "tiny-cache", root / "tiny-run")["eval"]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, flashdraft.cli"], check=True)
    startup = time.perf_counter() - start
    for path in ("head", "whole"):
        measured = run_measured(argv, root / f"tiny-eval-{path}.log", whole_target=path == "whole", again=True)
        print(
            json.dumps(
                {
                    "experiment": "tiny",
                    "command": "eval",
                    "target_path": path,
                    "prompts": 5,
                    "blocks": 15,
                    "interpreter_and_torch_start_s": round(startup, 2),
                    **measured,
                }
            ),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", choices=["records", "depth", "tiny", "all"], default="all")
    parser.add_argument("--records", default="100,300,1000", help="record counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per record (prompt + completion)")
    parser.add_argument("--depths", default="4,16,48", help="target layer counts for --experiment depth")
    parser.add_argument("--no-whole", action="store_true", help="depth: skip the whole-target (before) path")
    parser.add_argument("--workdir", default=None, help="keep the files here (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        if args.experiment in ("records", "all"):
            records_experiment(root, sorted(int(x) for x in args.records.split(",")), args.tokens)
        if args.experiment in ("tiny", "all"):
            tiny_experiment(root)
        if args.experiment in ("depth", "all"):
            depth_experiment(root, sorted(int(x) for x in args.depths.split(",")), not args.no_whole)


if __name__ == "__main__":
    main()
