"""The drafter's step eager against compiled (fixed shapes, `flashdraft.decoding.static_proposer`), in one run.

    .venv/bin/python benchmarks/draft_step.py [--target-model tiny] [--families dflash,dflash2,dspark]
        [--layers 5] [--steps 64] [--prompt-length 200] [--threads 1] [--backend inductor] [--device cpu]

For each family, a fresh drafter for the target (the published layer shape: sliding x (L - 1), then full, window
2048) drafts the same sequence of steps twice: eagerly (`DFlashProposer`, its cache grown by `torch.cat`) and through
`StaticDFlashProposer` compiled with `--backend` (on CUDA: CUDA graphs). A step writes a + 1 new context rows (a
cycling through 0 .. B, so every accepted length occurs) and drafts one block; the context features are random (the
target's forward is not timed: this is the drafter's part of a speculative step). Steps alternate eager and compiled,
so a slow-down of a shared machine hits both alike. Prints one JSON line per family: the median step in ms of each,
their ratio, the first compiled step (compile time included), the graphs compiled (after warm-up: must stay at the
count of the warm-up) and graph breaks (0: the graphs are `fullgraph`), and the greatest difference of the two
paths' draft logits.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from flashdraft.decoding.proposers import DFlashProposer, as_proposer
from flashdraft.decoding.static_proposer import CompiledDraft
from flashdraft.drafter.init import DrafterChoices, new_drafter_for_target
from flashdraft.target.model import TargetModel


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure(target: TargetModel, family: str, args) -> dict:
    layer_types = ["sliding_attention"] * (args.layers - 1) + ["full_attention"]
    context_layers = list(range(1, target.num_layers - 1))[: args.layers]  # below the final layer, as init requires
    choices = DrafterChoices(
        layer_types=layer_types, sliding_window=2048, family=family, target_layer_ids=context_layers
    )
    drafter = new_drafter_for_target(target, choices).to(target.device).eval()
    block, width, device = drafter.config.block_size, drafter.fc.in_features, target.device
    max_length = args.prompt_length + args.steps * (block + 1) + 1
    eager = DFlashProposer(drafter, target)
    static = as_proposer(drafter, target, compiled=CompiledDraft(max_length=max_length, backend=args.backend))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, args.prompt_length, width, generator=gen).to(device)
    steps = [(prompt, torch.arange(args.prompt_length, device=device)[None])]
    position = args.prompt_length
    for i in range(args.steps):
        count = i % (block + 1) + 1  # a + 1 committed: every accepted length 0 .. B in turn
        steps.append((torch.randn(1, count, width, generator=gen).to(device), position + torch.arange(count)[None]))
        position += count
    times = {"eager": [], "compiled": []}
    largest_difference = 0.0
    first_compiled_ms = None
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    with torch.no_grad():
        for i, (features, positions) in enumerate(steps):
            anchor_pos = int(positions[0, -1]) + 1
            tokens = [i % target.vocab_size]
            rows = {}
            for name, proposer in (("eager", eager), ("compiled", static)):
                t0 = _clock(device)
                rows[name] = proposer.propose(tokens, anchor_pos, features, positions.to(device), block)
                elapsed = (_clock(device) - t0) * 1000
                if i == 1 and name == "compiled":
                    first_compiled_ms = elapsed
                if i > 2:  # the prompt's step and the two compiling ones left out
                    times[name].append(elapsed)
            if i == 2:
                warmed_compiles = static.compiles
            # the drafter's logits and the rows proposed (a walk's are -inf off its candidates: compared where finite)
            logits = [p.block_distributions(0)[1] for p in (eager, static)]
            finite = rows["eager"].isfinite()
            if not torch.equal(finite, rows["compiled"].isfinite()):
                raise SystemExit(f"{family}: the compiled rows' candidates differ from eager's at step {i}")
            differences = [(logits[0] - logits[1]).abs().max(), (rows["eager"] - rows["compiled"])[finite].abs().max()]
            largest_difference = max(largest_difference, *(d.item() for d in differences))
    eager_ms, compiled_ms = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {
        "family": family,
        "block": block,
        "layers": args.layers,
        "steps_timed": len(times["eager"]),
        "eager_step_ms": round(eager_ms, 3),
        "compiled_step_ms": round(compiled_ms, 3),
        "eager_over_compiled": round(eager_ms / compiled_ms, 3),
        "first_compiled_step_ms": round(first_compiled_ms, 1),
        "compiles": static.compiles,
        "recompiles_after_warmup": static.compiles - warmed_compiles,
        "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks_before,
        "max_logit_difference": largest_difference,
        "backend": args.backend,
        "mode": static.state.settings.compile_mode(torch.device(device)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-model", default="tiny")
    ap.add_argument("--families", default="dflash,dflash2,dspark")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-length", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.target_model, device=args.device)
    machine = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "device": args.device}
    for family in args.families.split(","):
        print(json.dumps(measure(target, family, args) | machine), flush=True)


if __name__ == "__main__":
    main()
