"""Peak memory of `flashdraft cache` and offline `flashdraft eval` against the number of
records: it must stay flat (features are streamed shard by shard when caching and read one
record at a time when evaluating), not grow with the cache.

    .venv/bin/python benchmarks/memory.py [--records 100,300,1000] [--tokens 256] [--workdir DIR]

A random Qwen3-shaped target (hidden 128, 4 layers) and random completions of `--tokens` tokens
each are written once; every (command, record count) point runs as its own process and prints
one JSON line with that process's peak RSS. A last line compares the growth in peak RSS from
the smallest to the largest count with the size of the features that were streamed, which is
what memory would grow by if they were held.

Measured on a 2-core CPU (100 -> 1000 records of 256 tokens): peak RSS +7 MB for cache and
+6 MB for eval while 169 MB more features streamed through. What grows is the token ids of the
records (about 30 bytes per token as Python lists), a thousandth of a real target's features
per token (5 layers x 5120 x 2 bytes = 50 KB).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HIDDEN, LAYERS, VOCAB = 128, 4, 512
CACHE_LAYERS = [0, 1, 2]  # three context layers: 768 bf16 features (1.5 KB) per token


def write_target(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         eos_token_id=VOCAB - 2, pad_token_id=VOCAB - 1)  # fmt: skip
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
    header = {"format": "flashdraft.completions", "version": 1,
              "target": {"fingerprint": fingerprint, "path": str(target_dir), "vocab_size": VOCAB},
              "generation": {"prompts": "synthetic", "max_new_tokens": tokens - prompt_len, "temperature": 0.0},
              "token_ids": "target", "num_records": count}  # fmt: skip
    with open(path, "w") as f:
        f.write(json.dumps(header)[:-1] + ', "records": [\n')
        for i in range(count):
            ids = [rng.randrange(VOCAB - 2) for _ in range(tokens)]
            record = {"id": f"r{i:05d}", "prompt": "", "prompt_ids": ids[:prompt_len],
                      "completion_ids": ids[prompt_len:], "completion": "", "stop_reason": "length"}  # fmt: skip
            f.write(("," if i else "") + json.dumps(record) + "\n")
        f.write("]}\n")


def peak_rss(argv: list[str], log: Path) -> tuple[float, float]:
    """Run `flashdraft ARGV` in its own process: (peak RSS in MB, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flashdraft", *argv], stdout=out, stderr=subprocess.STDOUT,
                                env=env)  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"flashdraft {' '.join(argv)} failed; see {log}")
    return usage.ru_maxrss / 1024, seconds  # ru_maxrss is in KB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", default="100,300,1000", help="record counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per record (prompt + completion)")
    parser.add_argument("--workdir", default=None, help="keep the files here (default: a temporary directory)")
    args = parser.parse_args()
    counts = sorted(int(x) for x in args.records.split(","))

    from flashdraft.checkpoint import save_drafter
    from flashdraft.drafter_init import new_drafter_for_target
    from flashdraft.target import TargetModel

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        write_target(root / "target")
        target = TargetModel.load(root / "target")
        save_drafter(new_drafter_for_target(target, 1, 8, VOCAB - 1, CACHE_LAYERS), root / "drafter")
        rows = []
        for n in counts:
            completions, cache = root / f"c{n}.json", root / f"cache{n}"
            write_completions(completions, root / "target", target.fingerprint(), n, args.tokens)
            cache_cmd = ["cache", "--target-model", str(root / "target"), "--completions", str(completions), "--out",
                         str(cache), "--layers", ",".join(map(str, CACHE_LAYERS)), "--dtype", "bf16"]  # fmt: skip
            eval_cmd = ["eval", "--checkpoint", str(root / "drafter"), "--target-model", str(root / "target"),
                        "--cached-hidden-states", str(cache), "--max-blocks", "2"]  # fmt: skip
            feature_mb = n * args.tokens * len(CACHE_LAYERS) * HIDDEN * 2 / 2**20
            for command, argv in (("cache", cache_cmd), ("eval", eval_cmd)):
                rss, seconds = peak_rss(argv, root / f"{command}{n}.log")
                row = {"command": command, "records": n, "tokens": n * args.tokens, "peak_rss_mb": round(rss, 1),
                       "features_mb": round(feature_mb, 1), "seconds": round(seconds, 1)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        for command in ("cache", "eval"):
            points = [r for r in rows if r["command"] == command]
            first, last = points[0], points[-1]
            print(
                json.dumps(
                    {
                        "command": command,
                        "records": [first["records"], last["records"]],
                        "peak_rss_growth_mb": round(last["peak_rss_mb"] - first["peak_rss_mb"], 1),
                        "features_streamed_growth_mb": round(last["features_mb"] - first["features_mb"], 1),
                    }
                )
            )


if __name__ == "__main__":
    main()
