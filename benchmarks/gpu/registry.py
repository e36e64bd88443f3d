"""The checks gpu_check runs, in the order they run: `CHECKS`, one `Check` each.

Adding a check is one function and one entry in `CHECKS`:

1. Write the check in the module of its family (parity, verify_cost, decoding_loop, tiny_pipeline, training,
   matmul, trees, engine), or in a new module of this package: a function taking what it needs (a target, the
   widths, the device) and returning its row, a dict with "check" (its name), "case" and its figures, "passed"
   where it can fail, "skipped" (a reason) where it cannot run here; or a list of rows. A check that raises is
   recorded as an error row and the run goes on; past its cap it is stopped the same way.
2. Register it in `CHECKS` where it should run: `Check(name, cap, cases, summary)`. `cap` is its seconds on one
   H200, per case (the core checks' caps add up to `CORE_SECONDS`, which must stay within the 6 minutes: see
   tests/test_gpu_check.py); `cases` turns the `Run` (device, widths, what checks share) into the cases to run,
   each announced, capped and timed on its own (`one(label, fn)` for a check of one case); `summary` gives a row's
   figure in the closing table. `uses_slice=True` where it reads the shared Qwen3.6-27B-shaped slice
   (`run.slice_target(dtype)`: built on first use, released before the first check after it that does not use it);
   `engine=True` where it needs vLLM (outside `CORE_SECONDS`; its cases `on_engine(...)`, a line where vLLM is not).
3. Where its shapes differ between a GPU and --dry-run, add a field to `Widths` (shapes.py) with both values:
   --dry-run must carry every check on CPU, and tests/test_gpu_check.py's CHECKS must name it.

A check that runs only when asked (`--checks NAME`: `asked_only=True`) stays outside `CORE_SECONDS`, as
static_decode does (eager against compiled decoding on the slice: its compile would not fit the 6 minutes beside the
core checks; move it into the core by rebalancing the caps once a GPU has measured it).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from flashdraft.target.model import TargetModel

from . import decoding_loop, engine, matmul, parity, tiny_pipeline, training, trees, verify_cost
from .models import build_slice
from .shapes import BLOCK, Widths
from .timing import free

Rows = dict | list[dict]


@dataclass
class Run:
    """What the checks are given: the device, the widths (the published shapes, or tiny in --dry-run), the checks
    asked for, and what checks share: the target slice, figures measured earlier, the engine checks' directory."""

    device: torch.device
    widths: Widths
    dry_run: bool
    wanted: set[str] | None  # --checks; None: all
    measured: dict = field(default_factory=dict)  # matmul_rate's "flops_per_s", a share of which training reports
    built: list[TargetModel] = field(default_factory=list)  # the slice, once built

    @property
    def serving(self) -> torch.dtype:
        """The dtype a target serves in here: bf16 on a GPU, fp32 on CPU."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def slice_target(self, dtype: torch.dtype | None = None) -> TargetModel:
        """The Qwen3.6-27B-shaped slice (fp32 when built), built on first use and then shared; cast to `dtype`."""
        if not self.built:
            self.built.append(build_slice(self.widths, self.device))
        if dtype is not None:
            self.built[0].model.to(dtype)
        return self.built[0]

    def release_slice(self) -> None:
        """Free the slice (and the device's cached memory) before the checks that build their own models."""
        self.built.clear()
        free(self.device)

    def asked(self, name: str) -> bool:
        """Named in --checks (not only run as one of all)."""
        return self.wanted is not None and name in self.wanted

    @cached_property
    def work(self) -> str:
        """The engine checks' directory: targets, drafters and their runs, shared between them."""
        return tempfile.mkdtemp(prefix="gpu-check-engine-")

    @cached_property
    def no_engine(self) -> str | None:
        """Why the engine checks cannot run here, or None (--dry-run: the CPU engine, its checks only when asked)."""
        return None if self.dry_run else engine.engine_missing()


@dataclass(frozen=True)
class Case:
    """One capped, timed run of a check: `label` is announced ("# name (label): cap N s") and is an error row's case."""

    label: str
    run: Callable[[], Rows]


@dataclass(frozen=True)
class Check:
    name: str  # its rows' "check"
    cap: int  # seconds per case on one H200 (past it, the case is stopped and reported)
    cases: Callable[[Run], list[Case]]
    summary: Callable[[dict], str]  # a row's figure in the closing table (errors and skips are said by the runner)
    uses_slice: bool = False
    engine: bool = False  # runs on vLLM: its cap is outside CORE_SECONDS
    asked_only: bool = False  # runs only when named in --checks: its cap is outside CORE_SECONDS


def one(label: str, fn: Callable[[Run], Rows]) -> Callable[[Run], list[Case]]:
    """The cases of a check that runs once."""
    return lambda run: [Case(label, lambda: fn(run))]


def skipped(name: str, case: str, why: str) -> Case:
    """A case that runs nothing: one row saying why."""
    return Case(case, lambda: {"check": name, "case": case, "skipped": why})


def on_engine(run: Run, name: str, case: str, fn: Callable[[], Rows]) -> Case:
    """A case run on vLLM, or one line saying why it cannot run here."""
    return skipped(name, case, run.no_engine) if run.no_engine else Case(case, fn)


LARGEST = "qwen3.6-27b-drafter"  # the drafter shape the decoding and flex checks use


def train_step_cases(run: Run) -> list[Case]:
    """Each drafter shape, then the largest on 2 processes (on CPU in --dry-run, over gloo) where 2 devices exist."""

    def train_step(name: str) -> dict:  # at the matmul rate measured before it
        rate = run.measured.get("flops_per_s")
        return training.check_train_step(name, run.widths, run.device, rate, CAPS["train_step"])

    def two_processes() -> dict:
        return training.check_train_step_2proc(LARGEST, run.widths, run.device, CAPS["train_step"])

    cases = [Case(name, lambda n=name: train_step(n)) for name in run.widths.drafters]
    if run.device.type == "cpu" or torch.cuda.device_count() >= 2:
        cases.append(Case("2 processes", two_processes))
    else:
        cases.append(skipped("train_step", "2 processes", "one GPU"))
    return cases


def served_cases(run: Run) -> list[Case]:
    """Each family the GPU engine serves; in --dry-run only the CPU engine's (plain DFlash), and only when asked."""
    cases = []
    for case in engine.SERVED_CASES:
        if run.dry_run and case in engine.GPU_ONLY_CASES:
            cases.append(skipped("served", case, "needs a GPU engine (V2 model runner)"))
        elif run.dry_run and not run.asked("served"):
            cases.append(skipped("served", case, "starts vLLM: --checks served"))
        else:
            cases.append(on_engine(run, "served", case, lambda c=case: engine.check_served(c, run.work)))
    return cases


def bench_cases(run: Run) -> list[Case]:
    label = engine.BENCH_CONCURRENCY
    if run.dry_run and not run.asked("bench"):
        why = "starts vLLM twice: --checks bench"
        return [Case(label, lambda: {"check": "bench", "case": f"concurrency {label}", "skipped": why})]
    return [on_engine(run, "bench", label, lambda: engine.check_bench(run.work))]


def static_decode_cases(run: Run) -> list[Case]:
    """Eager against compiled (CUDA graphs) decoding on the slice, when asked: `--checks static_decode`."""
    if not run.asked("static_decode"):
        return [skipped("static_decode", "eager vs compiled", "compiles the slice's decoding: --checks static_decode")]
    return [
        Case(
            "eager vs compiled",
            lambda: decoding_loop.check_static_decode(
                run.slice_target(run.serving), run.widths.drafters[LARGEST], run.widths, run.dry_run
            ),
        )
    ]


def engine_capture_cases(run: Run) -> list[Case]:
    if run.dry_run:
        return [skipped("engine_capture", "hybrid bf16", "the CPU engine runs no exact hybrid target")]
    return [on_engine(run, "engine_capture", "hybrid bf16", lambda: engine.check_engine_capture(run.work))]


def engine_feed_cases(run: Run) -> list[Case]:
    if run.dry_run and not run.asked("engine_feed"):
        return [skipped("engine_feed", "dense bf16", "starts vLLM twice: --checks engine_feed")]
    return [on_engine(run, "engine_feed", "dense bf16", lambda: engine.check_engine_feed(run.work))]


CHECKS = [
    Check(
        "linear_attention_parity",
        35,
        one("fp32/bf16", lambda run: parity.check_linear_attention_parity(run.slice_target(), run.widths, run.dry_run)),
        parity.summary,
        uses_slice=True,
    ),
    Check(
        "target_verify_cost",
        15,
        one(
            f"{BLOCK} vs 1 tokens",
            lambda run: verify_cost.check_target_verify_cost(run.slice_target(run.serving), run.widths),
        ),
        verify_cost.summary,
        uses_slice=True,
    ),
    Check(
        "spec_loop_overhead",
        40,  # both rollback modes
        one(
            "per step",
            lambda run: decoding_loop.check_spec_loop_overhead(
                run.slice_target(run.serving), run.widths.drafters[LARGEST], run.widths
            ),
        ),
        decoding_loop.summary,
        uses_slice=True,
    ),
    Check(
        "static_decode",
        90,  # eager, then compiled: two warm-up generations (the compiled one compiles three graphs) and two timed
        static_decode_cases,
        decoding_loop.summary_static,
        uses_slice=True,
        asked_only=True,
    ),
    Check(
        "draft_tree_hybrid",
        5,
        one("hybrid refusal", lambda run: trees.check_tree_refusal(run.slice_target(run.serving))),
        trees.summary_refusal,
        uses_slice=True,
    ),
    Check(
        "tiny_decode",
        15,
        one("built-in tiny", lambda run: tiny_pipeline.check_tiny_decode(run.widths, run.device)),  # fp32: no near-ties
        tiny_pipeline.summary,
    ),
    Check(
        "flex_vs_dense",
        35,
        one(
            "forward+grad",
            lambda run: training.check_flex_vs_dense(run.widths.drafters[LARGEST], run.widths, run.device),
        ),
        training.summary_flex_vs_dense,
    ),
    Check(
        "matmul_rate",
        5,
        one("bf16", lambda run: matmul.check_matmul_rate(run.widths, run.device, run.measured)),
        matmul.summary,
    ),
    # per drafter shape: building it, a warm-up step (flex compiles), 2 timed (none begun after 24 s)
    Check("train_step", 40, train_step_cases, training.summary_train_step),
    Check(
        "packing",
        50,  # two windows (unpacked, packed) of at most 6 steps, no step begun after 20 s each
        one(
            "long-tailed",
            lambda run: training.check_packing(
                run.widths, run.device, run.measured.get("flops_per_s"), CAPS["packing"]
            ),
        ),
        training.summary_packing,
    ),
    Check(
        "draft_tree",
        40,  # greedy, the chain and 3 budgets of 32 tokens, then the step costs (7 rounds)
        one("ddtree dense", lambda run: trees.check_draft_tree(run.widths, run.device)),
        trees.summary,
    ),
    Check("served", 120, served_cases, engine.summary_served, engine=True),
    Check("bench", 240, bench_cases, engine.summary_bench, engine=True),
    Check("engine_capture", 120, engine_capture_cases, engine.summary_engine_capture, engine=True),
    Check("engine_feed", 180, engine_feed_cases, engine.summary_engine_feed, engine=True),
]
# Seconds each check may take on one H200, per case (a case past its cap is stopped and reported, and the run goes
# on); read when a case runs. The core checks' caps add up to CORE_SECONDS (320 s, one GPU: train_step twice, its
# 2-process case skipped), 6 minutes with the start-up (imports, CUDA's initialisation: about 30 s); the engine
# checks (vLLM, when installed) come on top.
CAPS = {check.name: check.cap for check in CHECKS}
ENGINE_CHECKS = tuple(check.name for check in CHECKS if check.engine)
CORE_SECONDS = sum(check.cap for check in CHECKS if not (check.engine or check.asked_only)) + CAPS["train_step"]
