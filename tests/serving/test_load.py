"""Load runs through vLLM's benchmark client: the job it is given, what it answers read back (the counters'
per-position counts from vLLM's rates, timings, token ids), a failed request or a dead client one line naming it.
The client itself runs in the engine tests (tests/evaluation/test_bench.py); here a stand-in Python answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flashdraft.errors import FlashdraftError
from flashdraft.serving.load import LoadPlan, LoadRequest, parse_load, run_load

REQUEST = {
    "id": "p0",
    "success": True,
    "error": "",
    "ttft": 0.02,
    "itl": [0.01, 0.03, 0.01],
    "latency": 0.07,
    "output_tokens": 5,
    "token_ids": [5, 6, 7, 8, 9],
    "finish_reason": "length",
}
RESULT = {
    "duration": 0.5,
    "output_throughput": 10.0,
    "request_throughput": 2.0,
    "spec_decode_num_drafts": 3,
    "spec_decode_draft_tokens": 21,
    "spec_decode_accepted_tokens": 4,
    "spec_decode_per_position_acceptance_rates": [2 / 3, 1 / 3, 1 / 3, 0.0],
}


def test_a_run_reads_back_vllms_figures_the_counters_as_counts_and_each_requests_timing():
    run = parse_load({"result": RESULT, "requests": [REQUEST]}, concurrency=2)
    assert run.output_throughput == 10.0 and run.request_throughput == 2.0 and run.concurrency == 2
    assert run.counters.drafts == 3 and run.counters.accepted == 4
    assert run.counters.accepted_per_position == [2, 1, 1, 0]
    r = run.requests[0]
    assert r.output_ids == [5, 6, 7, 8, 9] and r.tpot == pytest.approx((0.07 - 0.02) / 4)
    assert run.step_seconds == pytest.approx(0.01)  # the median chunk gap
    plain = parse_load(
        {
            "result": {k: RESULT[k] for k in ("duration", "output_throughput", "request_throughput")},
            "requests": [REQUEST],
        },
        concurrency=1,
    )
    assert plain.counters is None  # a server without a drafter: vLLM reports no spec_decode figures


def test_a_failed_request_or_one_without_token_ids_is_one_line_naming_it():
    failed = REQUEST | {"success": False, "error": "Traceback ...\nValueError: prompt too long"}
    with pytest.raises(FlashdraftError, match="request p0 failed at concurrency 4: ValueError: prompt too long"):
        parse_load({"result": RESULT, "requests": [failed]}, concurrency=4)
    with pytest.raises(FlashdraftError, match="request p0 came back without token ids"):
        parse_load({"result": RESULT, "requests": [REQUEST | {"token_ids": []}]}, concurrency=1)


def _fake_python(tmp_path: Path, body: str) -> Path:
    """A stand-in for the engine's Python: runs `body` with JOB and OUT as `job` and `out`."""
    script = tmp_path / "bin" / "python"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\njob = json.load(open(sys.argv[2]))\nout = sys.argv[3]\n{body}\n"
    )
    script.chmod(0o755)
    return script


def test_every_run_goes_to_one_client_which_reports_each_as_it_ends(tmp_path):
    python = _fake_python(
        tmp_path,
        "runs = []\nfor i, run in enumerate(job['runs']):\n"
        "    runs.append({'result': "
        + repr(RESULT)
        + ", 'requests': [dict("
        + repr(REQUEST)
        + ", id=r['id']) for r in run['requests']]})\n    print(f'run {i} done', flush=True)\n"
        "json.dump({'runs': runs}, open(out, 'w'))",
    )
    plans = [
        LoadPlan(url, c, [LoadRequest("a", [1, 2], 5, {"temperature": 0.0})])
        for url, c in (("http://127.0.0.1:1/v1", 1), ("http://127.0.0.1:2/", 2))
    ]
    seen = []
    runs = run_load(python, plans, 2, tmp_path / "work", on_run=seen.append)
    assert seen == [0, 1] and [r.concurrency for r in runs] == [1, 2]
    job = json.loads((tmp_path / "work" / "job.json").read_text())
    assert job["warmups"] == 2 and job["runs"][0]["base_url"] == "http://127.0.0.1:1"
    assert job["runs"][1] == {
        "base_url": "http://127.0.0.1:2",
        "concurrency": 2,
        "requests": [{"id": "a", "prompt_ids": [1, 2], "max_tokens": 5, "body": {"temperature": 0.0}}],
    }


def test_a_client_that_dies_is_one_line_with_its_last_words_and_its_log(tmp_path):
    python = _fake_python(
        tmp_path, "print('aiohttp.ClientConnectorError: cannot connect', file=sys.stderr)\nsys.exit(1)"
    )
    with pytest.raises(
        FlashdraftError,
        match=r"exited with code 1: aiohttp.ClientConnectorError: cannot connect "
        r"\(log: .*client.log\)",
    ):
        run_load(python, [LoadPlan("http://127.0.0.1:1", 1, [])], 0, tmp_path / "work")
