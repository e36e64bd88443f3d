"""Load on a running server: one run of `vllm bench serve`'s own client (`engine_scripts/flashdraft_vllm_bench.py`,
run by the engine's Python) at a concurrency, with flashdraft's requests by token ids; what each request and the
run measured, and the engine's speculative-decoding counters over the run.

The client is vLLM's (its warm-up, concurrency limit, clock and metrics), not one written here: its figures are
the ones vLLM's users read. flashdraft adds the one thing vLLM's completions client drops, the output token ids.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.errors import FlashdraftError
from flashdraft.serving.engine import SCRIPTS, SpecCounters, engine_env

BENCH_SCRIPT = SCRIPTS / "flashdraft_vllm_bench.py"
RUN_TIMEOUT_S = 6 * 3600.0  # vLLM's own client's session limit (after its last run's line)


@dataclass(frozen=True)
class LoadRequest:
    """A request as sent: its id, prompt token ids, max_tokens and the sampling fields of its body."""

    id: str
    prompt_ids: list[int]
    max_tokens: int
    body: dict[str, Any]


@dataclass
class RequestTiming:
    """One request as served: time to first token, the gaps between streamed chunks (s), its tokens."""

    id: str
    ttft: float
    chunk_gaps: list[float]  # one per engine step after the first token: a step may deliver several tokens
    latency: float
    output_ids: list[int]
    finish_reason: str | None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, as vLLM computes it: (latency - TTFT) / (tokens - 1)."""
        n = len(self.output_ids)
        return (self.latency - self.ttft) / (n - 1) if n > 1 else None


@dataclass
class LoadRun:
    """One timed run: its requests, vLLM's figures (duration, output tok/s, request throughput, ...) and the
    engine's counters' difference over it (None when the server does not speculate)."""

    concurrency: int
    requests: list[RequestTiming]
    metrics: dict[str, Any] = field(default_factory=dict)
    counters: SpecCounters | None = None

    @property
    def output_throughput(self) -> float:
        return float(self.metrics["output_throughput"])

    @property
    def request_throughput(self) -> float:
        return float(self.metrics["request_throughput"])

    @property
    def step_seconds(self) -> float:
        """The median gap between streamed chunks: one engine step of every sequence in flight (a plain decoding
        step without a drafter; drafting plus verifying k + 1 tokens with one)."""
        gaps = [g for r in self.requests for g in r.chunk_gaps]
        return statistics.median(gaps) if gaps else float("nan")


@dataclass(frozen=True)
class LoadPlan:
    """One timed run to make: its server, its requests, at most `concurrency` in flight."""

    base_url: str
    concurrency: int
    requests: list[LoadRequest]


def run_load(
    python: Path, plans: list[LoadPlan], warmups: int, work: Path, on_run: Callable[[int], None] | None = None
) -> list[LoadRun]:
    """Each plan's requests sent to its server by vLLM's benchmark client (one process for every run, in order),
    each run after `warmups` warm-up requests; `on_run(i)` as run i ends. One line naming the request and the
    engine's error when one failed, or the client's last line when it died."""
    job = {
        "warmups": warmups,
        "runs": [
            {"base_url": _root(p.base_url), "concurrency": p.concurrency, "requests": [r.__dict__ for r in p.requests]}
            for p in plans
        ],
    }
    work.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = work / "job.json", work / "out.json", work / "client.log"
    job_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        client = subprocess.Popen(
            [str(python), str(BENCH_SCRIPT), str(job_path), str(out_path)],
            env=engine_env(python),
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        try:
            for line in client.stdout:
                if on_run is not None and line.startswith("run ") and line.rstrip().endswith(" done"):
                    on_run(int(line.split()[1]))
            client.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if client.poll() is None:  # an error or Ctrl-C here: the client goes with it
                client.kill()
                client.wait()
    if client.returncode != 0 or not out_path.is_file():
        tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
        servers = ", ".join(sorted({p.base_url for p in plans}))
        raise FlashdraftError(
            f"vLLM's benchmark client against {servers} exited with code {client.returncode}: "
            f"{tail[0][:300]} (log: {log_path})"
        )
    runs = json.loads(out_path.read_text())["runs"]
    return [parse_load(out, plan.concurrency, plan.base_url) for out, plan in zip(runs, plans, strict=True)]


def _root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def parse_load(out: dict[str, Any], concurrency: int, base_url: str = "the server") -> LoadRun:
    """The client's OUT.json as a `LoadRun`; a failed request is an error naming it."""
    timings = []
    for r in out["requests"]:
        if not r["success"]:
            raise FlashdraftError(
                f"{base_url}: request {r['id']} failed at concurrency {concurrency}: "
                f"{(r['error'] or 'no reason given').strip().splitlines()[-1][:300]}"
            )
        ids = r["token_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            raise FlashdraftError(f"{base_url}: request {r['id']} came back without token ids (return_token_ids)")
        timings.append(RequestTiming(r["id"], r["ttft"], list(r["itl"]), r["latency"], ids, r["finish_reason"]))
    metrics = out["result"]
    counters = None
    if "spec_decode_num_drafts" in metrics:
        drafts = int(metrics["spec_decode_num_drafts"])
        per_pos = [round(rate * drafts) for rate in metrics.get("spec_decode_per_position_acceptance_rates", [])]
        counters = SpecCounters(
            drafts, int(metrics["spec_decode_draft_tokens"]), int(metrics["spec_decode_accepted_tokens"]), per_pos
        )
    return LoadRun(concurrency, timings, metrics, counters)
