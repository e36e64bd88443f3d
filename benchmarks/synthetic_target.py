"""Synthetic targets, caches and drafters written straight to disk, for the memory benchmarks
(`memory.py --experiment depth`, `target_27b_shape.py`): random bf16 weights of a real
architecture's shapes, optionally with only some decoder layers written, without building
the model in memory (tensor names and shapes come from the model on the meta device).
Measurements run `flashdraft` in a subprocess each, for a clean peak RSS.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashdraft.data.cache import CacheSpec
from flashdraft.target.weights import LANGUAGE_MODEL_PREFIX


def write_tokenizer(directory: Path, vocab_size: int, eos: int, pad: int) -> None:
    """A word-level tokenizer over ids t0..t{vocab_size - 1} (its size is what matters here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=f"t{pad}"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos}", pad_token=f"t{pad}").save_pretrained(directory)


def fill_random(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Normal(0, 0.02) values into `t`, 4 M at a time (no fp32 copy of a large tensor)."""
    for block in t.view(-1).split(1 << 22):
        block.copy_(torch.randn(block.numel(), generator=gen) * 0.02)
    return t


def write_random_target(
    directory: Path, config, layers_written: int | None = None, shard_bytes: int = 2 << 30, seed: int = 0
) -> dict[str, int]:
    """Random bf16 weights (normal, std 0.02) for `config`, in shards of about `shard_bytes` with
    model.safetensors.index.json, as published checkpoints are. Only decoder layers below
    `layers_written` are written (None: all). A vision-language config (Qwen3.5/3.6) stores the
    text model under model.language_model. Returns bytes written per kind (embedding, LM head,
    layers, other). One shard's tensors are in memory at a time."""
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    nested = config.get_text_config() is not config
    shapes = {}
    for name, t in model.state_dict().items():
        layer = re.search(r"\.layers\.(\d+)\.", name)
        if layers_written is not None and layer and int(layer.group(1)) >= layers_written:
            continue
        stored = LANGUAGE_MODEL_PREFIX + name[len("model.") :] if nested and name.startswith("model.") else name
        shapes[stored] = tuple(t.shape)
    gen = torch.Generator().manual_seed(seed)
    sizes = {"embedding": 0, "lm_head": 0, "layers": 0, "other": 0}
    shards: list[list[str]] = [[]]
    total = 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and total + nbytes > shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += nbytes
        kind = "embedding" if "embed_tokens" in name else "lm_head" if "lm_head" in name else None
        sizes[kind or ("layers" if ".layers." in name else "other")] += nbytes
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            tensors[name] = fill_random(torch.empty(shapes[name], dtype=torch.bfloat16), gen)
            weight_map[name] = file
        save_file(tensors, directory / file, metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sizes


class RandomFeatureTarget:
    """Stands in for the whole target when `build_cache` writes a cache: the head's facts and
    fingerprint, random context features (the benchmarks measure memory, not acceptance)."""

    def __init__(self, head, seed: int = 0) -> None:
        self.head, self.gen = head, torch.Generator().manual_seed(seed)
        self.model = type("Weights", (), {"dtype": head.dtype})()
        self.layer_ids: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.head, name)

    def set_context_layers(self, layer_ids: list[int]) -> None:
        self.head.set_context_layers(layer_ids)
        self.layer_ids = list(layer_ids)

    def forward(self, input_ids: torch.Tensor, cache=None):
        from flashdraft.target.model import TargetOutput

        n, t = input_ids.shape
        features = torch.randn(n, t, len(self.layer_ids) * self.head.hidden_size, generator=self.gen)
        return TargetOutput(hidden=None, context_features=features)


def write_random_cache(
    directory: Path, head, layer_ids: list[int], records: int, prompt_tokens: int, completion_tokens: int, seed: int = 0
) -> Path:
    """A bf16 hidden-state cache of `records` random token sequences for the target `head`."""
    from flashdraft.data.cache import build_cache
    from flashdraft.data.completions import CompletionRecord, Completions

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(records):
        ids = torch.randint(0, head.vocab_size, (prompt_tokens + completion_tokens,), generator=gen).tolist()
        rows.append(CompletionRecord(f"r{i}", "", ids[:prompt_tokens], ids[prompt_tokens:], "", "length"))
    completions = Completions(directory.with_suffix(".json"), {"target": {"fingerprint": head.fingerprint()}}, rows, [])
    return build_cache(
        RandomFeatureTarget(head, seed), completions, directory, spec=CacheSpec(layer_ids=layer_ids, dtype="bf16")
    )


def write_random_drafter(directory: Path, cfg, seed: int = 0) -> Path:
    """A drafter of config `cfg` with random bf16 weights (norms at 1), written tensor by tensor."""
    from flashdraft.drafter.checkpoint import expected_shapes, save_drafter_state

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(cfg).items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        state[name] = t.fill_(1.0) if name.endswith("norm.weight") else fill_random(t, gen)
    return save_drafter_state(cfg, state, directory, torch.bfloat16)


# Runs `flashdraft ARGV` and reports, from inside the process, the seconds `main` took (after
# the interpreter and torch started), the bytes it read with read()/pread() (/proc/self/io) and
# its peak RSS (VmHWM: wait4's ru_maxrss would include the parent's pages at fork time).
RUNNER = """
import json, os, sys, time
import torch
from flashdraft.cli import main
if os.environ.get("BENCH_WHOLE_TARGET"):  # the path before TargetHead: offline commands load the whole target
    from flashdraft.target.model import TargetModel
    from flashdraft.target.weights import TargetHead
    TargetHead.load = staticmethod(lambda path, **kw: TargetModel.load(path, **kw))
start = time.perf_counter()
rc = main(sys.argv[1:])
seconds = time.perf_counter() - start
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
again = None
if os.environ.get("BENCH_AGAIN") and rc == 0:  # the same command with every library already imported
    start = time.perf_counter()
    main(sys.argv[1:])
    again = time.perf_counter() - start
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
peak_kb = int(status["VmHWM"].split()[0])
print("RUNNER " + json.dumps({"rc": rc, "main_s": seconds, "again_s": again, "read_bytes": int(io["rchar"]),
                              "peak_kb": peak_kb}))
sys.exit(rc)
"""


def run_measured(argv: list[str], log: Path, whole_target: bool = False, again: bool = False) -> dict:
    """`flashdraft ARGV` in its own process: its peak RSS (MB), wall seconds of the process, seconds
    of `main` and bytes read by it (all from the process itself). `whole_target`: as before
    TargetHead. `again`: also the seconds of a second `main` in the same process (imports done)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    env |= {"BENCH_WHOLE_TARGET": "1"} if whole_target else {}
    env |= {"BENCH_AGAIN": "1"} if again else {}
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, *argv], stdout=out, stderr=subprocess.STDOUT, env=env)
        status = proc.wait()
    wall = time.perf_counter() - start
    if status != 0:
        sys.exit(f"flashdraft {' '.join(argv)} failed; see {log}")
    inner = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("RUNNER "))[7:])
    measured = {
        "peak_rss_mb": round(inner["peak_kb"] / 1024, 1),
        "wall_s": round(wall, 2),
        "main_s": round(inner["main_s"], 2),
        "read_mb": round(inner["read_bytes"] / 2**20, 1),
    }
    return measured | ({"main_again_s": round(inner["again_s"], 2)} if again else {})
