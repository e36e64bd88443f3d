"""Packed (`train --pack-length`) against unpacked training on the built-in tiny target, on CPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packing.py [--records 64] [--epochs 8] [--speed-steps 12] [--data DIR]

Two length mixes, both the tiny target's own greedy continuations of the built-in coding prompts (their first
16 tokens, tokenized as plain text), with their context features from one target forward:
- "long-tailed": completion lengths drawn from a log-normal (median 40 tokens, sigma 1.0; clipped to [8, 480]), as
  chat data runs from a few dozen tokens to many times that;
- "builtin": the demo's data, greedy up to 128 new tokens or the target's stop token;
- "chat-docs": 24 chat prompts of 58-84 tokens and 8 documents of 580-648 tokens, each with 48 completion tokens
  (tokens drawn at random from the tiny target's vocabulary: speed only), packed at --pack-length 1024 (speed only;
  --records does not apply).
The tiny drafter (1 layer, block 16, AdamW, decay weights) trains unpacked (4 records a micro-batch, padded to a
length bucket) and packed (rows of L tokens, L = the mix's longest record, bucketed). One JSON line per figure:
- "speed": supervised (completion) tokens per second over a few steps (packed and unpacked steps interleaved) with
  every supervised pair an anchor (--num-anchors 512, the published recipe's), 4 rows against 4 records, the padding
  share of their context slots and the block slots a step holds; then packed over unpacked tokens/s;
- "profile" (--figures profile): one packed and one unpacked step under torch.profiler after a warm-up, the ops
  that took most of the step's CPU time (self time, shares of the step), per supervised token: where packed loses;
- "tau" (long-tailed mix): the held-out τ after the same epochs (equal supervised tokens), 8 anchors a record,
  packed 1 row a step (about the 4 records of an unpacked step); the noise is the spread over --seeds.
Figures are ratios within one run of this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK, ANCHORS, BATCH, LAYERS = 16, 8, 4, (1, 2, 3)


@dataclass
class Record:  # what training reads of a record (a cache's `CachedRecord`)
    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool: the completion
    context_features: torch.Tensor  # [T, 3 * H]
    target_topk: None = None


def long_tailed_lengths(count: int, generator: torch.Generator) -> list[int]:
    """Completion lengths of the "long-tailed" mix: log-normal (median 40 tokens, sigma 1.0), clipped to [8, 480]
    (benchmarks/gpu_check.py's packing case draws its records from it too)."""
    draws = torch.exp(math.log(40) + torch.randn(count, generator=generator))
    return [int(v) for v in draws.clamp(8, 480)]


def _continuations(target, prompts: list[list[int]], lengths: list[int | None]) -> list[tuple[list[int], list[int]]]:
    from flashdraft.decoding.generate import autoregressive_generate

    out = []
    for prompt, n in zip(prompts, lengths, strict=True):
        result = autoregressive_generate(target, prompt, n or 128)
        completion = result.output_ids
        if n is None:  # the built-in mix: up to the target's stop
            stops = [i for i, t in enumerate(completion) if t in target.stop_token_ids]
            completion = completion[: stops[0] + 1] if stops else completion
        out.append((prompt, completion[: n or 128]))
    return out


CHAT_DOCS = ((24, 58, 84), (8, 580, 648))  # (records, shortest, longest prompt) of the chat-docs mix
CHAT_DOCS_COMPLETION, CHAT_DOCS_PACK_LENGTH = 48, 1024


def chat_docs_mix(target, seed: int) -> list[Record]:
    """The "chat-docs" mix: short chats and long documents, each with 48 completion tokens, tokens at random."""
    gen = torch.Generator().manual_seed(seed)
    target.set_context_layers(list(LAYERS))
    vocab = target.config.vocab_size
    records = []
    for count, shortest, longest in CHAT_DOCS:
        for prompt_length in torch.randint(shortest, longest + 1, (count,), generator=gen).tolist():
            ids = torch.randint(0, vocab - 1, (prompt_length + CHAT_DOCS_COMPLETION,), generator=gen)
            with torch.no_grad():
                features = target.forward(ids[None]).context_features[0]
            records.append(Record(ids, torch.arange(len(ids)) >= prompt_length, features))
    return records


def make_mix(target, name: str, count: int, seed: int):
    """(training records, held-out eval records) of one mix: `count` and count // 4 + 1 records."""
    from flashdraft.data.prompts import load_prompts
    from flashdraft.evaluation.records import EvalRecord

    if name == "chat-docs":
        return chat_docs_mix(target, seed), []

    prompts = [target.tokenizer(p.turns[0])["input_ids"][:16] for p in load_prompts("builtin:code", quiet=True)]
    gen = torch.Generator().manual_seed(seed)
    total = count + count // 4 + 1
    picks = [prompts[int(i)] for i in torch.randint(0, len(prompts), (total,), generator=gen)]
    lengths: list[int | None] = [None] * total
    if name == "long-tailed":
        lengths = long_tailed_lengths(total, gen)
    target.set_context_layers(list(LAYERS))
    pairs = _continuations(target, picks, lengths)
    records, held_out = [], []
    for i, (prompt, completion) in enumerate(pairs):
        ids = torch.tensor(prompt + completion)
        with torch.no_grad():
            features = target.forward(ids[None]).context_features[0]
        if i < count:
            records.append(Record(ids, torch.arange(len(ids)) >= len(prompt), features))
        else:
            held_out.append(EvalRecord(f"h{i}", prompt, completion, features, list(LAYERS)))
    return records, held_out


def _drafter(target, seed: int):
    from flashdraft.drafter.init import DrafterChoices, new_drafter_for_target

    choices = DrafterChoices(num_layers=1, block_size=BLOCK, target_layer_ids=list(LAYERS))
    return new_drafter_for_target(target, choices, seed=seed)


def _config(records, packed: bool, pack_length: int | None = None, **settings):
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.data import length_bucket

    longest = max(len(r.input_ids) for r in records)
    if pack_length is not None:
        longest = pack_length
    return TrainConfig(
        lr=6e-3,
        optimizer="adamw",
        loss_weighting="decay",
        loss_decay_gamma=7.0,
        save_every=10**6,
        log_every=1,
        pack_length=length_bucket(longest) if packed else None,
        **settings,
    )


class _SpeedRun:
    """One side of the speed comparison: a fresh drafter training on the mix, packed or not, step by step."""

    def __init__(self, target, records, packed: bool, steps: int, pack_length: int | None) -> None:
        from flashdraft.train.loop import recorded_config
        from flashdraft.train.optim import build_optimizers
        from flashdraft.train.packing import pack_plan
        from flashdraft.train.step import loss_spec, packed_units

        self.target, self.records, self.packed = target, records, packed
        self.drafter = _drafter(target, 0).train()
        settings = dict(num_anchors=512, batch_size=BATCH, max_steps=steps + 1)
        self.cfg = recorded_config(_config(records, packed, pack_length, **settings), self.drafter, target)
        self.plan = pack_plan(records, self.cfg.pack_length, self.cfg.num_anchors, None, BATCH) if packed else None
        self.steps_per_epoch = (packed_units(self.cfg, self.plan, 1) if packed else len(records)) // BATCH
        self.optimizer = build_optimizers(self.drafter, self.cfg, steps + 1)
        self.spec = loss_spec(self.cfg, self.drafter)
        self.seconds = self.cpu_seconds = self.supervised = self.real = self.slots = self.block_slots = 0

    def step(self, step: int, run_dir: Path, counted: bool) -> None:
        from flashdraft.distributed import Dist
        from flashdraft.train.step import global_batch, optimizer_step

        batch = global_batch(self.cfg, self.records, step, self.steps_per_epoch, Dist(), self.plan)
        started, cpu_started = time.perf_counter(), time.process_time()
        optimizer_step(self.drafter, self.target, self.optimizer, batch, self.spec, 1.0, Dist(), run_dir)
        if not counted:
            return
        self.seconds += time.perf_counter() - started
        self.cpu_seconds += time.process_time() - cpu_started
        self.supervised += sum(int(self.records[i].loss_mask.sum()) for i in batch.indices)
        for b in batch.micro_batches:
            self.real += int((b.context_positions < (1 << 40)).sum())
            self.slots += b.context_positions.numel()
            self.block_slots += b.block_ids.numel()

    def row(self, steps: int) -> dict:
        return {
            "packed": self.packed,
            "pack_length": self.cfg.pack_length,
            "steps": steps,
            "supervised_tokens_per_s": round(self.supervised / self.seconds, 1),
            "supervised_tokens_per_cpu_s": round(self.supervised / self.cpu_seconds, 1),
            "padding_share": round(1 - self.real / self.slots, 3),
            "context_slots_per_step": self.slots // steps,
            "block_slots_per_step": self.block_slots // steps,
        }


def speed(target, records, steps: int, pack_length: int | None = None) -> list[dict]:
    """Supervised (completion) tokens per second of `steps` training steps unpacked and packed, their steps
    interleaved (a loaded machine slows both alike) after one warm-up step each, with every supervised pair an anchor
    (--num-anchors 512, the published recipe's, is more than these records have), and the slots a step holds:
    context slots (4 rows of L against 4 records padded to a bucket of theirs) and block slots (each a block token
    through the drafter's layers) as the batches make them; the last row their ratios, by wall-clock and by this
    process's CPU seconds (what a machine shared with other work measures fairly: one thread, its own time only)."""
    runs = [_SpeedRun(target, records, packed, steps, pack_length) for packed in (False, True)]
    with tempfile.TemporaryDirectory() as run_dir:
        for step in range(steps + 1):
            for run in runs:
                run.step(step, Path(run_dir), counted=step > 0)
    rows = [run.row(steps) for run in runs]
    ratios = {
        f"packed_over_unpacked_{figure}": round(rows[1][figure] / rows[0][figure], 2)
        for figure in ("supervised_tokens_per_s", "supervised_tokens_per_cpu_s")
    }
    return rows + [ratios]


def profile(target, records, pack_length: int | None = None, top: int = 8) -> list[dict]:
    """One packed and one unpacked step (after a warm-up step each) under torch.profiler: the step's CPU time per
    supervised token and the `top` ops by self CPU time, each with its share of the step and its time per token."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiled

    runs = [_SpeedRun(target, records, packed, 2, pack_length) for packed in (False, True)]
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        for run in runs:
            run.step(0, Path(run_dir), counted=False)
        for run in runs:
            with profiled(activities=[ProfilerActivity.CPU]) as prof:
                run.step(1, Path(run_dir), counted=True)
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in events)  # microseconds
            ops = [
                {
                    "op": e.key,
                    "share": round(e.self_cpu_time_total / total, 3),
                    "us_per_token": round(e.self_cpu_time_total / run.supervised, 1),
                }
                for e in events[:top]
            ]
            rows.append(
                {"packed": run.packed, "supervised": run.supervised, "us_per_token": round(total / run.supervised)}
                | {"top_ops": ops}
            )
    return rows


def held_out_tau(target, records, held_out, packed: bool, epochs: int, seed: int) -> dict:
    """The held-out τ after `epochs` epochs (every record as often: equal supervised tokens), 8 anchors a record;
    packed 1 row of L a step (about the 4 records an unpacked step holds, so the optimizer steps compare)."""
    from flashdraft.train.held_out import evaluate_tau
    from flashdraft.train.loop import train

    cfg = _config(records, packed, num_anchors=8, batch_size=1 if packed else BATCH, epochs=epochs, seed=seed)
    with tempfile.TemporaryDirectory() as run_dir:
        with contextlib.redirect_stdout(sys.stderr):  # the run's own lines: stdout stays JSON
            trained = train(cfg, _drafter(target, seed), target, records, Path(run_dir))
        steps = len((Path(run_dir) / "metrics.jsonl").read_text().splitlines())
    tau = evaluate_tau(trained, target, held_out, max_blocks=10**6)["eval_tau"]
    supervised = epochs * sum(int(r.loss_mask.sum()) for r in records)
    return {
        "packed": packed,
        "seed": seed,
        "steps": steps,
        "supervised_tokens": supervised,
        "held_out_tau": round(tau, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--speed-steps", type=int, default=12)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--mixes", default="long-tailed,builtin")
    parser.add_argument("--figures", default="speed,tau")
    parser.add_argument("--data", default=None, help="keep the generated mixes here and reuse them")
    args = parser.parse_args()
    from flashdraft.target.model import TargetModel

    torch.manual_seed(0)
    target = TargetModel.load("tiny")
    figures = args.figures.split(",")
    for mix in args.mixes.split(","):
        saved = None if args.data is None else Path(args.data) / f"{mix}-{args.records}.pt"
        if saved is not None and saved.exists():  # the greedy continuations take minutes: reuse them
            records, held_out = torch.load(saved, weights_only=False)
        else:
            records, held_out = make_mix(target, mix, args.records, seed=0)
            if saved is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                torch.save((records, held_out), saved)
        lengths = sorted(len(r.input_ids) for r in records)
        print(json.dumps({"mix": mix, "records": len(records), "lengths": lengths}), flush=True)
        if "speed" in figures:
            pack_length = CHAT_DOCS_PACK_LENGTH if mix == "chat-docs" else None
            for row in speed(target, records, args.speed_steps, pack_length):
                print(json.dumps({"mix": mix, "figure": "speed"} | row), flush=True)
        if "profile" in figures:
            pack_length = CHAT_DOCS_PACK_LENGTH if mix == "chat-docs" else None
            for row in profile(target, records, pack_length):
                print(json.dumps({"mix": mix, "figure": "profile"} | row), flush=True)
        if mix != "long-tailed" or "tau" not in figures:
            continue
        for seed in (int(s) for s in args.seeds.split(",")):
            for packed in (False, True):
                row = held_out_tau(target, records, held_out, packed, args.epochs, seed)
                print(json.dumps({"mix": mix, "figure": "tau"} | row), flush=True)


if __name__ == "__main__":
    main()
