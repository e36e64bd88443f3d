"""`flashdraft bench`: the served speed-up through vLLM's own client, both servers' outputs the target's greedy
ones, τ from the counters equal to eval --served's for the same requests, the predicted speed-up beside the
measured one; its options by name, its contradictions one line, its two servers alike but for the drafter."""

from __future__ import annotations

import json

import pytest

from flashdraft.drafter.run_dir import load_any_drafter
from flashdraft.evaluation.bench import BenchConfig, plan_servers
from flashdraft.target.model import TargetModel
from tests.conftest import run_cli


def test_bench_options_are_the_bench_config_fields_by_name():
    from flashdraft.cli import build_parser

    dests = {a.dest for a in build_parser().commands["bench"]._actions if a.dest != "help"}
    assert dests - {"json", "report"} == set(BenchConfig.option_names())


def test_contradicting_options_are_one_line_errors(capsys, engine_models):
    m = engine_models
    common = ["bench", "--target-model", m["target"], "--checkpoint", m["drafter"], "--prompts", m["prompts"]]
    rc, _, err = run_cli(capsys, *common, "--server", "http://127.0.0.1:1")
    assert rc == 2 and "--server URL and --baseline-server URL go together" in err and len(err.splitlines()) == 1
    rc, _, err = run_cli(capsys, *common, "--num-prompts", "2", "--concurrency", "1,4")
    assert rc == 2 and "2 requests cannot keep 4 in flight (--concurrency)" in err and len(err.splitlines()) == 1
    rc, _, err = run_cli(capsys, *common, "--concurrency", "1,1")
    assert rc == 2 and "expected distinct positive integers" in err


@pytest.mark.engine  # reads the engine's environment (which vLLM it has), starts nothing
def test_the_two_servers_started_differ_only_by_the_drafters_speculative_config(engine_models, tmp_path):
    m = engine_models
    target = TargetModel.load(str(m["target"]))
    drafter = load_any_drafter(m["drafter"], target).drafter
    cfg = BenchConfig(str(m["target"]), str(m["drafter"]), [str(m["prompts"])])
    servers = plan_servers(cfg, drafter, target, tmp_path)["servers"]
    base, spec = servers["baseline"].command(), servers["speculative"].command()
    at = spec.index("--speculative-config")
    spec_config = json.loads(spec[at + 1])
    assert spec_config["method"] == "dflash" and spec_config["num_speculative_tokens"] == 7
    assert (tmp_path / "drafter" / "config.json").is_file()  # the export the server reads
    strip_port = lambda cmd: [a for i, a in enumerate(cmd) if "--port" not in cmd[i - 1 : i + 1]]  # noqa: E731
    assert strip_port(spec[:at] + spec[at + 2 :]) == strip_port(base)
    assert base[base.index("--host") + 1] == "127.0.0.1" == spec[spec.index("--host") + 1]


@pytest.mark.engine
def test_the_served_speedup_is_measured_lossless_with_the_tau_eval_served_reads(
    capsys, engine_models, overfit_server, baseline_server, tmp_path
):
    m = engine_models
    requests = [
        "--target-model",
        m["target"],
        "--checkpoint",
        m["overfit"],
        "--prompts",
        m["prompts"],
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "16",
    ]
    rc, out, err = run_cli(
        capsys,
        "bench",
        *requests,
        "--concurrency",
        "1,2",
        "--repeats",
        "2",
        "--warmups",
        "1",
        "--server",
        overfit_server.base_url,
        "--baseline-server",
        baseline_server.base_url,
        "--json",
        tmp_path / "b.json",
        "--report",
        tmp_path / "report",
    )
    assert rc == 0, err
    summary = json.loads((tmp_path / "b.json").read_text())
    assert summary["engine"].startswith("vllm") and summary["cpu_engine"] and "a CPU's" in summary["note"]
    assert summary["lossless"] is True and "lossless: true" in out and "a CPU's" in out
    (s,) = summary["sets"]
    assert (
        s["first_difference"] is None
        and s["outputs"]["speculative"]["greedy"] == s["outputs"]["speculative"]["records"]
    )
    for row in s["by_concurrency"]:
        assert row["baseline"]["output_tok_s"] > 0 and row["speculative"]["output_tok_s"] > 0
        assert row["speedup_output_tok_s"]["value"] > 0 and row["speedup_output_tok_s"]["error"] is not None
        assert row["speedup_tpot"]["error"] is not None and row["tau"] > 2
        assert row["predicted"]["output_tok_s"] > 0 and row["predicted"]["break_even_tau"] > 0
        assert len(row["position_acceptance"]) == 7
    # τ at concurrency 1 is what eval --served reads from the same engine for the same requests
    rc, _, err = run_cli(
        capsys,
        "eval",
        *requests,
        "--served",
        "vllm",
        "--server",
        overfit_server.base_url,
        "--json",
        tmp_path / "eval.json",
    )
    assert rc == 0, err
    served = json.loads((tmp_path / "eval.json").read_text())["served"]
    assert s["by_concurrency"][0]["tau"] == pytest.approx(served["tau"])
    assert s["by_concurrency"][0]["tau_delivered"] == pytest.approx(served["tau_delivered"])
    assert s["flashdraft_tau"] == pytest.approx(served["flashdraft"]["tau"])
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == [
        "position_acceptance.png",
        "report.md",
        "speedup_by_concurrency.png",
        "tau_by_set.png",
    ]
