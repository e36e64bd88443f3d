"""The drafter's training on the device.

- flex_vs_dense: the drafter's training forward and gradients (many blocks per sequence, 4 sliding-window layers +
  1 full) with compiled flex attention against the dense boolean mask, under bf16 autocast: relative L2 error of
  the output and of every parameter's gradient (forward only on CPU: flex has no CPU backward).
- train_step: `flashdraft train`'s own step (`global_batch`, `optimizer_step`) on a synthetic sequence for the
  Qwen3-8B and Qwen3.6-27B drafter shapes: step time, tokens/s, FLOPs per step counted from the shapes
  (`train_step_flops`) and their share of the matmul rate, peak memory, attention shapes and compiled graphs as
  train logs them; the same step with 2 processes (DDP) when 2 devices exist (on CPU in --dry-run, over gloo).
- packing: benchmarks/packing.py's long-tailed length mix, one window of train unpacked and one packed
  (--pack-length) at equal memory: supervised tokens/s, padding share, recompiles (#58).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from flashdraft.distributed import Dist, init_distributed, wrap_model
from flashdraft.drafter.config import DrafterConfig
from flashdraft.train.blocks import IGNORE
from flashdraft.train.config import TrainConfig
from flashdraft.train.loss import BlockLabels, DraftHeads, LossSpec, block_loss
from flashdraft.train.step import loss_spec  # the loop's own loss

from .models import embedding_target, new_drafter, synthetic_batch, synthetic_records
from .shapes import BF16_TOLERANCE, BLOCK, Widths
from .timing import free, sync


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


# -- flex attention vs the dense mask ---------------------------------------------------------


def check_flex_vs_dense(drafter_fields: dict, widths: Widths, device: torch.device) -> dict:
    """On CPU (--dry-run) flex attention runs eagerly and has no backward: forward only."""
    target = embedding_target(drafter_fields["hidden_size"], drafter_fields["vocab_size"], device)
    drafter = new_drafter(drafter_fields, device)
    batch = synthetic_batch(drafter.config, widths, device)
    with_grads = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    outputs, grads = {}, {}
    for backend in ("flex", "sdpa"):
        drafter.attention_backend = backend
        drafter.zero_grad(set_to_none=True)
        with autocast, torch.set_grad_enabled(with_grads):
            embeds = target.embed(batch.block_ids)  # [1, K * B, H]
            hidden = drafter(
                embeds, batch.anchor_positions, batch.context_features.to(embeds.dtype), batch.context_positions
            )
            head = DraftHeads(target.model.get_output_embeddings())
            parts = block_loss(hidden, BlockLabels(batch.labels), head, LossSpec(BLOCK, gamma=7.0))
        outputs[backend] = hidden.detach()
        if with_grads:
            (parts.weighted_sum / parts.weight_total).backward()
            grads[backend] = {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}
    out_error = relative_error(outputs["flex"], outputs["sdpa"])
    grad_errors = {n: relative_error(grads["flex"][n], grads["sdpa"][n]) for n in grads.get("sdpa", {})}
    worst = max(grad_errors, key=grad_errors.get, default=None)
    worst_error = grad_errors.get(worst, 0.0)
    return {
        "check": "flex_vs_dense",
        "case": "forward+grad" if with_grads else "forward (CPU)",
        "passed": max(out_error, worst_error) <= BF16_TOLERANCE,
        "output_rel_error": round(out_error, 6),
        "max_grad_rel_error": round(worst_error, 6) if with_grads else None,
        "worst_grad": worst,
        "tolerance": BF16_TOLERANCE,
        "compiled": device.type == "cuda",
        "blocks": batch.anchor_positions.shape[1],
        "context_tokens": widths.seq_len,
        "layer_types": drafter.config.layer_types,
    }


def _visible_context(batch, layer_type: str, window: int | None) -> torch.Tensor:
    """[N, K] context tokens each block's queries see in a layer: the real ones before its anchor (a sliding layer:
    within `window` of it), of its own document when packed."""
    positions, anchors = batch.context_positions[:, None, :], batch.anchor_positions[:, :, None]  # [N, 1, T], [N, K, 1]
    seen = positions < anchors
    if layer_type == "sliding_attention" and window:
        seen &= positions > anchors - window
    if batch.documents is not None:
        anchor_documents, context_documents = batch.documents
        seen &= context_documents[:, None, :] == anchor_documents[:, :, None]
    return seen.sum(-1)


def train_step_flops(cfg: DrafterConfig, batch) -> float:
    """The model FLOPs of one training step on `batch`, counted from the shapes (2 per multiply-add; forward x 3 for
    forward + backward): fc over the real context tokens; per drafter layer the key/value projections of the
    context, every projection and the MLP of the trained blocks' tokens, attention over the keys each block sees
    (`_visible_context` + its own block); the LM head over the trained positions. Padding and masked keys are not
    counted: a share of the matmul rate is then the useful share."""
    h, d, b = cfg.hidden_size, cfg.head_dim, cfg.block_size
    q_width, kv_width = cfg.num_attention_heads * d, 2 * cfg.num_key_value_heads * d
    labels = batch.labels.view(*batch.anchor_positions.shape, b)  # [N, K, B]
    trained_blocks = (labels != IGNORE).any(-1)  # [N, K]
    blocks = int(trained_blocks.sum())
    context = int((batch.context_positions < (1 << 40)).sum())
    flops = 2 * context * cfg.num_context_layers * h * h  # fc
    for layer_type in cfg.layer_types:
        flops += 2 * context * h * kv_width  # the context's keys and values
        flops += 2 * blocks * b * (h * (q_width + kv_width) + q_width * h + 3 * h * cfg.intermediate_size)
        keys = _visible_context(batch, layer_type, cfg.sliding_window)[trained_blocks].sum() + blocks * b
        flops += 4 * b * int(keys) * q_width  # scores and values
    flops += 2 * int((labels != IGNORE).sum()) * h * cfg.vocab_size  # LM head
    return 3.0 * flops


@dataclass(frozen=True)
class TrainWindow:
    """A timed window of `flashdraft train`'s steps: at most `steps` after one warm-up step, no further step begun
    once `seconds` are spent since the window's start (building the drafter included; at least one timed step;
    the steps it ran are reported)."""

    steps: int
    seconds: float
    batch_size: int = 1
    pack_length: int | None = None
    num_anchors: int | None = None  # None: the published recipe's (512)


def train_window(name: str, widths: Widths, records: list, window: TrainWindow, dist: Dist, rate=None) -> dict:
    """`flashdraft train`'s own step (`train.step.global_batch` and `optimizer_step`, the recipe's optimizer, the
    attention backend train picks) over `records`, its figures as train logs them (`metrics.Window`,
    `memory_and_compiles`), the step's FLOPs (`train_step_flops`) and their share of the matmul `rate`."""
    from flashdraft.train.loop import recorded_config
    from flashdraft.train.metrics import Window, memory_and_compiles
    from flashdraft.train.optim import build_optimizers
    from flashdraft.train.packing import pack_plan
    from flashdraft.train.step import global_batch, optimizer_step, packed_units

    device, started = dist.device, time.perf_counter()
    target = embedding_target(*widths.target_for[name], device)
    drafter = new_drafter(widths.drafters[name], device).train()
    settings = dict(batch_size=window.batch_size, pack_length=window.pack_length, num_anchors=window.num_anchors)
    cfg = recorded_config(TrainConfig(target_fingerprint="gpu-check", **settings), drafter, target)
    model = wrap_model(drafter, dist, fsdp=False)
    optimizer = build_optimizers(model, cfg, window.steps + 1)
    spec = loss_spec(cfg, drafter)
    plan = pack_plan(records, cfg.pack_length, cfg.num_anchors, None) if cfg.pack_length else None
    units = packed_units(cfg, plan, dist.world) if plan else len(records)
    steps_per_epoch = max(1, units // (cfg.batch_size * dist.world))
    figures = Window(cfg.first_draft_position)
    flops = supervised = 0.0
    shapes = graphs = 0
    with tempfile.TemporaryDirectory() as run_dir:
        for step in range(window.steps + 1):
            if step > 1 and time.perf_counter() - started > window.seconds:
                break
            batch = global_batch(cfg, records, step, steps_per_epoch, dist, plan)
            sync(device)
            t0 = time.perf_counter()
            result, grad_norm = optimizer_step(
                model, target, optimizer, batch, spec, cfg.grad_clip, dist, Path(run_dir)
            )
            sync(device)
            if step == 0:  # warm-up: compilation, optimizer state; the window's figures start after it
                free(device)
                shapes, graphs = (memory_and_compiles(device)[k] for k in ("attention_shapes", "compiled_graphs"))
                figures = Window(cfg.first_draft_position)
                continue
            figures.time(0.0, time.perf_counter() - t0)
            figures.add(result, batch.micro_batches, dist.world)
            flops += sum(train_step_flops(drafter.config, b) for b in batch.micro_batches) * dist.world
            supervised += sum(int(records[i].loss_mask.sum()) for i in batch.indices)
    logged = figures.metrics(optimizer.last_lr(), grad_norm, 0) | memory_and_compiles(device)
    seconds = figures.compute_s  # the steps' own time, summed
    row = {
        "parameters_m": round(sum(p.numel() for p in drafter.parameters()) / 1e6, 1),
        "optimizer": cfg.optimizer,
        "attention": "flex" if device.type == "cuda" else "dense (sdpa)",
        "steps": figures.steps,
        "step_ms": round(1000 * seconds / max(1, figures.steps), 1),
        "context_tokens_per_s": round(figures.tokens / seconds, 1),
        "supervised_tokens_per_s": round(supervised / seconds, 1),
        "tflops_per_step": round(flops / max(1, figures.steps) / 1e12, 6),
        "matmul_share": round(flops / seconds / rate, 4) if rate else None,
        "padding_share": round(logged["padding_share"], 3),
        "peak_memory_gib": round(logged["peak_memory_gib"], 3),
        "attention_shapes": logged["attention_shapes"],  # the run's, since the process started
        "new_attention_shapes": logged["attention_shapes"] - shapes,  # after the warm-up step: recompiles
        "compiled_graphs": logged["compiled_graphs"],
        "new_compiled_graphs": logged["compiled_graphs"] - graphs,
        "processes": dist.world,
    }
    return row


def check_train_step(name: str, widths: Widths, device: torch.device, rate: float | None, cap: int, dist=None) -> dict:
    """One sequence of `widths.seq_len` context tokens (`context_for` sizes a shape down, said in the row), the
    published recipe's 512 anchors per sequence (fewer in --dry-run); no step begun after 0.6 of the `cap` seconds."""
    dist = dist or Dist(device=device)
    tokens = widths.context_for.get(name, widths.seq_len)
    case = f"{name}" + (f" x{dist.world}" if dist.world > 1 else "")
    records = synthetic_records(DrafterConfig(block_size=BLOCK, **widths.drafters[name]), [tokens] * dist.world)
    window = TrainWindow(widths.train_steps, 0.6 * cap, num_anchors=widths.num_anchors)
    try:
        row = train_window(name, widths, records, window, dist, rate)
    except torch.OutOfMemoryError:
        return {"check": "train_step", "case": case, "out_of_memory": True, "context_tokens": tokens}
    finally:
        free(device)
    sized = {"sized_down": f"{tokens} context tokens, not {widths.seq_len}"} if tokens < widths.seq_len else {}
    return {"check": "train_step", "case": case, "context_tokens": tokens} | sized | row


# -- packed against unpacked training (#58) --------------------------------------------------------------------


def check_packing(widths: Widths, device: torch.device, rate: float | None, cap: int) -> list[dict]:
    """benchmarks/packing.py's long-tailed mix (a 16-token prompt and a log-normal completion, median 40 tokens)
    as synthetic records at the Qwen3-8B drafter's shape; one window of `flashdraft train` unpacked (4 records a
    micro-batch, padded to their length bucket) and one packed (4 rows of L = the longest record's bucket: equal
    memory), anchors as train_step's: supervised tokens/s, padding share, attention shapes (recompiles); each window
    stops beginning steps 5 s before half the `cap` seconds."""
    from flashdraft.train.data import length_bucket

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
    from packing import long_tailed_lengths  # benchmarks/packing.py's length mix

    name = "qwen3-8b-drafter"
    cfg = DrafterConfig(block_size=BLOCK, **widths.drafters[name])
    lengths = [16 + n for n in long_tailed_lengths(widths.packing_records, torch.Generator().manual_seed(0))]
    records = synthetic_records(cfg, lengths, prompt=16)
    rows = []
    for pack_length in (None, length_bucket(max(lengths))):
        window = TrainWindow(
            widths.packing_steps, cap / 2 - 5, 4, pack_length, widths.num_anchors
        )  # 512 anchors on the GPU (the recipe's: every supervised pair here), a few in --dry-run
        try:
            row = train_window(name, widths, records, window, Dist(device=device), rate)
        finally:
            free(device)
        rows.append(
            {
                "check": "packing",
                "case": f"packed {pack_length}" if pack_length else "unpacked",
                "records": len(records),
                "median_length": sorted(lengths)[len(lengths) // 2],
                "longest": max(lengths),
            }
            | row
        )
    return rows


def _ddp_worker(
    rank: int, world: int, port: int, name: str, widths: Widths, device_type: str, cap: int, out: str
) -> None:
    os.environ |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
    }
    torch.set_num_threads(1)
    dist = init_distributed(device_type, collectives=True)
    try:
        row = check_train_step(name, widths, dist.device, None, cap, dist)  # flex on GPU, dense on CPU
        if dist.is_main:
            with open(out, "w") as f:
                json.dump(row, f)
    finally:
        dist.close()


def check_train_step_2proc(name: str, widths: Widths, device: torch.device, cap: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        port = 29500 + os.getpid() % 1000
        mp.spawn(_ddp_worker, args=(2, port, name, widths, device.type, cap, out), nprocs=2, join=True)
        with open(out) as f:
            return json.load(f) | {"backend": "nccl" if device.type == "cuda" else "gloo"}


def summary_flex_vs_dense(row: dict) -> str:
    grad = row["max_grad_rel_error"]
    return f"rel error out {row['output_rel_error']:.2e}" + (f", grad {grad:.2e}" if grad is not None else "")


def summary_train_step(row: dict) -> str:
    if row.get("out_of_memory"):
        return "out of memory"
    share = f", {row['matmul_share']:.0%} of matmul" if row.get("matmul_share") is not None else ""
    return (
        f"{row['context_tokens_per_s']:.0f} ctx tok/s, {row['step_ms']} ms/step, {row['tflops_per_step']:.3g} "
        f"TFLOP{share}, peak {row['peak_memory_gib']} GiB, +{row['new_attention_shapes']} shapes"
    )


def summary_packing(row: dict) -> str:
    return (
        f"{row['supervised_tokens_per_s']:.0f} sup tok/s, padding {row['padding_share']:.0%}, "
        f"+{row['new_attention_shapes']} shapes over {row['steps']} steps"
    )


# -- the compiled training step against the eager one, and the cache reader beside it (#63) ---------------------


@dataclass(frozen=True)
class StepSide:
    """One of the two drafters trained side by side: its model, optimizer and (compiled side) `CompiledStep`."""

    drafter: torch.nn.Module
    optimizer: object
    compiled: object | None


def compiled_train_records(cfg: DrafterConfig, widths: Widths, packed: bool, steps: int) -> list:
    """Packed: records of a quarter of `seq_len` or so (about 4 to a row of `seq_len` tokens: one batch shape);
    unpacked: records whose lengths share one length bucket (the bucket under half of `seq_len`: one shape)."""
    gen = torch.Generator().manual_seed(0)
    if packed:
        quarter = widths.seq_len // 4
        lengths = torch.randint(quarter * 3 // 4, quarter, (4 * (steps + 2),), generator=gen)
    else:
        bucket = widths.seq_len // 2  # a power of two: its bucket holds (7/8 bucket, bucket]
        lengths = torch.randint(bucket * 7 // 8 + 1, bucket + 1, (2 * (steps + 2),), generator=gen)
    return synthetic_records(cfg, lengths.tolist())


def _side_step(parts: StepSide, target, batch, spec: LossSpec, run_dir: Path, fail_on_recompile: bool):
    """One `optimizer_step` of a side, timed between two synchronisations: (its loss, its seconds). Under
    `fail_on_recompile` dynamo raises a RuntimeError rather than compile again."""
    from flashdraft.train.step import optimizer_step

    device = next(parts.drafter.parameters()).device
    sync(device)
    started = time.perf_counter()
    with torch.compiler.set_stance("fail_on_recompile" if fail_on_recompile else "default"):
        result, _ = optimizer_step(
            model=parts.drafter,
            target=target,
            optimizer=parts.optimizer,
            batch=batch,
            spec=spec,
            grad_clip=1.0,
            dist=Dist(device=device),
            run_dir=run_dir,
            compiled=parts.compiled,
        )
    sync(device)
    return result.loss, time.perf_counter() - started


def check_compiled_train_step(name: str, widths: Widths, device: torch.device, packed: bool, measured: dict) -> dict:
    """`flashdraft train`'s step eager and compiled (`CompiledStep`, `widths.compile_backend`: inductor on a GPU)
    on two drafters from the same seed fed the same batches: one packed row of `seq_len` tokens a step, or 2
    unpacked records of one length bucket. After one warm-up step each (the compiled one's compile, timed apart)
    `widths.compiled_steps` steps each, the compiled ones under `fail_on_recompile`: step times and their ratio,
    the graphs compiled and recompiled after the warm-up (0 expected: one batch shape), the largest relative loss
    difference. The compiled step's context tokens/s go into `measured` (the cache check reads it beside)."""
    from flashdraft.train.compiled import CompiledStep
    from flashdraft.train.loop import recorded_config
    from flashdraft.train.optim import build_optimizers
    from flashdraft.train.packing import pack_plan
    from flashdraft.train.step import global_batch

    steps, case = widths.compiled_steps, f"{name} {'packed' if packed else 'unpacked bucket'}"
    target = embedding_target(*widths.target_for[name], device)
    records = compiled_train_records(DrafterConfig(block_size=BLOCK, **widths.drafters[name]), widths, packed, steps)
    settings = dict(batch_size=1 if packed else 2, pack_length=widths.seq_len if packed else None)
    sides = {}
    for side in ("eager", "compiled"):
        drafter = new_drafter(widths.drafters[name], device).train()
        cfg = recorded_config(
            TrainConfig(target_fingerprint="gpu-check", num_anchors=widths.num_anchors, **settings), drafter, target
        )
        compiled = CompiledStep(drafter, backend=widths.compile_backend) if side == "compiled" else None
        sides[side] = StepSide(drafter, build_optimizers(drafter, cfg, steps + 1), compiled)
    plan = pack_plan(records, cfg.pack_length, cfg.num_anchors, None) if packed else None
    per_epoch = len(plan.rows) if packed else len(records) // cfg.batch_size
    spec, dist = loss_spec(cfg, sides["eager"].drafter), Dist(device=device)
    seconds, losses, tokens = {"eager": 0.0, "compiled": 0.0}, {"eager": [], "compiled": []}, 0
    compile_s, warm_compiles, recompiled = 0.0, 0, None
    with tempfile.TemporaryDirectory() as run_dir:
        for step in range(steps + 1):
            batch = global_batch(cfg, records, step, per_epoch, dist, plan)
            for side, parts in sides.items():
                try:
                    loss, took = _side_step(parts, target, batch, spec, Path(run_dir), side == "compiled" and step > 0)
                except RuntimeError as e:  # dynamo refused a recompile: said in the row, the check fails
                    if "fail_on_recompile" not in str(e):
                        raise
                    recompiled = " ".join(str(e).split())[:300]  # the message and the guard that failed
                    break
                losses[side].append(loss)
                if step > 0:
                    seconds[side] += took
                elif side == "compiled":  # the warm-up: its compiles, timed apart
                    compile_s, warm_compiles = took, parts.compiled.compiles
            if recompiled:
                break
            if step > 0:
                tokens += sum(int((b.context_positions < (1 << 40)).sum()) for b in batch.micro_batches)
    free(device)
    compiled, timed = sides["compiled"].compiled, len(losses["compiled"]) - 1
    pairs = zip(losses["eager"], losses["compiled"], strict=False)  # a refused step: the compiled side's missing
    loss_difference = max((abs(a - b) / abs(a) for a, b in pairs), default=0.0)
    rate = tokens / seconds["compiled"] if timed > 0 and seconds["compiled"] > 0 else None
    measured[("compiled_train_step", name)] = rate if packed else measured.get(("compiled_train_step", name))
    after = compiled.compiles - warm_compiles
    return {
        "check": "compiled_train_step",
        "case": case,
        "backend": widths.compile_backend,
        "attention": "flex" if device.type == "cuda" else "dense (sdpa)",
        "dtype": "bf16 autocast" if device.type == "cuda" else "float32",
        "passed": recompiled is None and after == 0 and compiled.recompiles == 0 and loss_difference <= BF16_TOLERANCE,
        "steps": timed,
        "eager_step_ms": round(1000 * seconds["eager"] / max(1, timed), 2),
        "compiled_step_ms": round(1000 * seconds["compiled"] / max(1, timed), 2),
        "eager_over_compiled": round(seconds["eager"] / seconds["compiled"], 3) if timed > 0 else None,
        "compile_s": round(compile_s, 2),  # the compiled side's warm-up step, its compiles with it
        "compiled_context_tokens_per_s": round(rate, 1) if rate else None,
        "step_compiles": compiled.compiles,
        "step_compiles_after_warmup": after,
        "step_recompiles": compiled.recompiles,
        "recompiled": recompiled,  # fail_on_recompile's refusal, or None
        "batch_shapes": len(compiled.shapes),
        "max_relative_loss_difference": round(loss_difference, 6),
        "tolerance": BF16_TOLERANCE,
    }


def check_cache_feed(name: str, widths: Widths, device: torch.device, measured: dict) -> dict:
    """benchmarks/cache_read.py's cache (`write_cache`, its records at this drafter's feature width) on this
    machine's disk (the temporary directory): its read rate from the disk (pages dropped first) as records and as
    training batches (2 workers, pinned on CUDA, as train builds them), in context tokens/s, beside the compiled
    packed step's rate (`measured`); then a short packed run of the eager step (a row of `seq_len` tokens a step)
    fed from that cache on disk by train's prefetcher (2 batches ahead, 2 workers, pinned on CUDA): the seconds the
    step waited for its batches (`wait_s`)."""
    from flashdraft.data.cache_reader import HiddenStateCache
    from flashdraft.target.model import TargetModel
    from flashdraft.train.host_memory import FeatureBuffers
    from flashdraft.train.loop import recorded_config
    from flashdraft.train.optim import build_optimizers
    from flashdraft.train.packing import pack_plan
    from flashdraft.train.prefetch import BatchPrefetcher
    from flashdraft.train.step import global_batch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
    from cache_read import drop_pages, read_batches, read_records, write_cache  # benchmarks/cache_read.py

    fields = widths.drafters[name]
    layers, hidden = len(fields["target_layer_ids"]), fields["hidden_size"]
    tiny = TargetModel.load("tiny")  # the cache's token ids are the tiny target's: the vocabulary holds them
    target = embedding_target(hidden, max(widths.target_for[name][1], tiny.vocab_size), device)
    row = {"check": "compiled_train_step", "case": f"{name} cache", "feature_width": layers * hidden, "workers": 2}
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_cache(tiny, layers, hidden, widths.cache_records, widths.cache_tokens, Path(tmp))
        cache = HiddenStateCache(directory)
        pin, workers = device.type == "cuda", 2  # as `flashdraft train` builds its batches (`LoopOptions`)
        batches = lambda cache: read_batches(cache, workers=workers, pin=pin)  # noqa: E731
        for read, fn in (("records", read_records), ("batches", batches)):
            drop_pages(directory)
            started = time.perf_counter()
            tokens = fn(cache)
            row[f"cold_{read}_context_tokens_per_s"] = round(tokens / (time.perf_counter() - started), 1)
        row["cold_read_gb_per_s"] = round(row["cold_records_context_tokens_per_s"] * layers * hidden * 2 / 1e9, 3)
        step_rate = measured.get(("compiled_train_step", name))
        row["compiled_step_context_tokens_per_s"] = round(step_rate, 1) if step_rate else None
        row["read_over_step"] = round(row["cold_batches_context_tokens_per_s"] / step_rate, 2) if step_rate else None
        drafter = new_drafter(fields, device).train()
        cfg = recorded_config(
            TrainConfig(
                target_fingerprint="gpu-check", num_anchors=widths.num_anchors, batch_size=1, pack_length=widths.seq_len
            ),
            drafter,
            target,
        )
        plan = pack_plan(cache, cfg.pack_length, cfg.num_anchors, None)
        steps, dist = len(plan.rows), Dist(device=device)
        optimizer, spec = build_optimizers(drafter, cfg, steps), loss_spec(cfg, drafter)
        drop_pages(directory)
        buffers = FeatureBuffers(pin=pin, keep=2 + 3)  # as train's loop keeps them
        prefetcher = BatchPrefetcher(
            lambda step: global_batch(cfg, cache, step, steps, dist, plan, buffers=buffers),
            range(steps),
            2,
            pin,
            workers,
        )
        waits, computed = [], 0.0
        try:
            for step in range(steps):
                t0 = time.perf_counter()
                batch = prefetcher.get(step)
                waits.append(time.perf_counter() - t0)
                computed += _side_step(StepSide(drafter, optimizer, None), target, batch, spec, Path(tmp), False)[1]
        finally:
            prefetcher.close()
        cache = None  # its mapped shards let go before the directory is removed
    free(device)
    return (
        row
        | {
            "run_steps": steps,
            "wait_s": round(sum(waits), 4),  # the first step's included: nothing is built ahead of the run's start
            "wait_s_after_first": round(sum(waits[1:]), 4),
            "run_step_ms": round(1000 * computed / steps, 1),
        }
    )


def summary_compiled_train_step(row: dict) -> str:
    if "wait_s" in row:
        ratio = f", {row['read_over_step']}x the compiled step" if row["read_over_step"] is not None else ""
        return (
            f"cold read {row['cold_batches_context_tokens_per_s']:.0f} ctx tok/s as batches{ratio}, "
            f"wait {row['wait_s_after_first']:.2f} s after the first of {row['run_steps']} steps"
        )
    if row.get("recompiled"):
        return f"recompiled: {row['recompiled']}"
    return (
        f"{row['eager_step_ms']} -> {row['compiled_step_ms']} ms/step ({row['eager_over_compiled']}x), compile "
        f"{row['compile_s']} s, +{row['step_compiles_after_warmup']} graphs, {row['step_recompiles']} recompiles, "
        f"loss diff {row['max_relative_loss_difference']:.1e}"
    )
