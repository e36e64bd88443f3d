"""The compiled training step (`train --compile`, inductor) against the eager one, on CPU, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compiled_train.py [--steps 6] [--packed/--no-packed]

The tiny target's 1-layer drafter (block 16, every supervised pair an anchor) on benchmarks/packing.py's chat-docs
mix (24 short chats, 8 long documents, 48 completion tokens each), packed at 1024 tokens (one batch shape) or
unpacked (one shape per length bucket). Two drafters from the same seed train side by side, one eager and one
compiled, their steps interleaved (a loaded machine slows both alike) after the compiled one's first step (its
compile, timed apart). One JSON line: the compile's seconds, each step's mean wall and CPU seconds, the ratio
eager / compiled (above 1: compiled is faster), the graphs compiled and recompiled after the first step, and the
largest relative difference of the two drafters' losses over the steps.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from packing import BATCH, CHAT_DOCS_PACK_LENGTH, _config, _drafter, chat_docs_mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    from flashdraft.distributed import Dist
    from flashdraft.target.model import TargetModel
    from flashdraft.train.compiled import CompiledStep
    from flashdraft.train.loop import recorded_config
    from flashdraft.train.optim import build_optimizers
    from flashdraft.train.packing import pack_plan
    from flashdraft.train.step import global_batch, loss_spec, optimizer_step, packed_units

    torch.manual_seed(0)
    target = TargetModel.load("tiny")
    records = chat_docs_mix(target, 0)
    sides = {}
    for name in ("eager", "compiled"):
        drafter = _drafter(target, 0).train()
        settings = dict(num_anchors=512, batch_size=BATCH, max_steps=args.steps + 1)
        cfg = recorded_config(_config(records, args.packed, CHAT_DOCS_PACK_LENGTH, **settings), drafter, target)
        plan = pack_plan(records, cfg.pack_length, cfg.num_anchors, None, BATCH) if args.packed else None
        units = packed_units(cfg, plan, 1) if args.packed else len(records)
        compiled = CompiledStep(drafter, backend=args.backend) if name == "compiled" else None
        optimizer = build_optimizers(drafter, cfg, args.steps + 1)
        sides[name] = dict(drafter=drafter, cfg=cfg, plan=plan, spe=units // BATCH, opt=optimizer, compiled=compiled)
        sides[name] |= dict(spec=loss_spec(cfg, drafter), wall=0.0, cpu=0.0, losses=[])
    compile_s, after_warmup = 0.0, 0
    with tempfile.TemporaryDirectory() as run_dir:
        for step in range(args.steps + 1):
            for name, side in sides.items():
                batch = global_batch(side["cfg"], records, step, side["spe"], Dist(), side["plan"])
                wall, cpu = time.perf_counter(), time.process_time()
                result, _ = optimizer_step(
                    side["drafter"],
                    target,
                    side["opt"],
                    batch,
                    side["spec"],
                    1.0,
                    Dist(),
                    Path(run_dir),
                    side["compiled"],
                )
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                side["losses"].append(result.loss)
                if step == 0:
                    compile_s += wall if name == "compiled" else 0.0
                    after_warmup = sides["compiled"]["compiled"].compiles if name == "compiled" else after_warmup
                    continue
                side["wall"] += wall
                side["cpu"] += cpu
    compiled = sides["compiled"]["compiled"]
    eager, fast = sides["eager"], sides["compiled"]
    print(
        json.dumps(
            {
                "packed": args.packed,
                "backend": args.backend,
                "steps": args.steps,
                "first_step_with_compile_s": round(compile_s, 1),
                "eager_step_s": round(eager["wall"] / args.steps, 3),
                "compiled_step_s": round(fast["wall"] / args.steps, 3),
                "eager_over_compiled_wall": round(eager["wall"] / fast["wall"], 2),
                "eager_over_compiled_cpu": round(eager["cpu"] / fast["cpu"], 2),
                "graphs_compiled": compiled.compiles,
                "graphs_after_first_step": compiled.compiles - after_warmup,
                "recompiles": compiled.recompiles,
                "batch_shapes": len(compiled.shapes),
                "max_relative_loss_difference": max(
                    abs(a - b) / abs(a) for a, b in zip(eager["losses"], fast["losses"], strict=True)
                ),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
