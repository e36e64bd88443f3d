"""benchmarks/gpu_check.py --dry-run: the GPU readiness check's code paths at tiny widths on CPU,
so the command prepared for the first GPU machine cannot rot; its checks' package (benchmarks/gpu/) in process."""

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CHECKS = {
    "linear_attention_parity",
    "target_verify_cost",
    "spec_loop_overhead",
    "draft_tree_hybrid",
    "tiny_decode",
    "flex_vs_dense",
    "matmul_rate",
    "train_step",
    "packing",
    "draft_tree",
    "served",
    "bench",
    "engine_capture",
    "engine_feed",  # skipped in the dry run unless asked (it starts the CPU engine twice)
    "static_decode",  # run only when asked (it compiles the slice's decoding)
    "compiled_train_step",  # run only when asked (it compiles the drafters' training step)
}


def result_rows(stdout: str) -> list[dict]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if "check" in r]  # the first line describes the machine


@pytest.fixture
def gpu(monkeypatch):
    """benchmarks/gpu, imported as gpu_check.py imports it (benchmarks/ on the path)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    importlib.import_module("gpu.runner")  # and with it every check's module
    return importlib.import_module("gpu")


def test_dry_run_prints_every_check_with_figures_and_passes(gpu):
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = result_rows(out.stdout)
    assert {r["check"] for r in rows} == CHECKS and not [r for r in rows if "error" in r]
    parity = [r for r in rows if r["check"] == "linear_attention_parity"]
    assert [r["case"] for r in parity] == ["float32", "bfloat16"] and all(r["passed"] for r in parity)
    # one error per linear layer of the slice (3 of its 4), for prompts and for a continuation after a prefill
    assert all(len(r["errors"][case]["torch_recurrent"]) == 3 for r in parity for case in ("prompt", "continuation"))
    assert parity[1]["floors"]["prompt"][0] > parity[0]["floors"]["prompt"][0]  # bf16's own noise over fp32's
    flex = next(r for r in rows if r["check"] == "flex_vs_dense")
    assert flex["passed"] and flex["blocks"] > 1 and "sliding_attention" in flex["layer_types"]
    verify = next(r for r in rows if r["check"] == "target_verify_cost")
    # the ratio is rounded from the unrounded times: within half a last digit of the rounded times' ratio, plus
    # what rounding the times to 3 decimals can move it
    assert verify["t1_ms"] > 0 and abs(verify["ratio"] - verify["t16_ms"] / verify["t1_ms"]) < 0.01
    loops = [r for r in rows if r["check"] == "spec_loop_overhead"]
    assert [r["rollback_mode"] for r in loops] == ["recompute", "deferred"]
    for loop in loops:
        assert loop["steps"] > 1 and loop["verify_ms"] > 0 and loop["drafter_ms"] > 0
        assert loop["host_transfers_per_step"] == 1 and loop["floor_ms"] > 0 and loop["step_over_floor"] > 0
    tiny = next(r for r in rows if r["check"] == "tiny_decode")
    assert tiny["passed"] and tiny["speculative_tokens_per_s"] > 0 and tiny["tau"] > 1
    for check, cap in gpu_check_caps(gpu).items():  # each check announced with its cap
        assert f"{check} " not in out.stdout or re.search(rf"# {check} \(.*\): cap {cap} s", out.stdout)
    assert_training_rows(rows)
    assert_tree_rows(rows)
    engine = [r for r in rows if r["check"] in ("served", "bench", "engine_capture")]
    # the GPU engine's checks say why they wait for a GPU; the CPU engine's case runs on request (`--checks served`)
    assert {r["case"]: r["skipped"] for r in engine} == {
        "dflash": "starts vLLM: --checks served",
        "dflash2": "needs a GPU engine (V2 model runner)",
        "dspark": "needs a GPU engine (V2 model runner)",
        "dflash-sliding": "needs a GPU engine (V2 model runner)",
        "concurrency 1,8,32": "starts vLLM twice: --checks bench",
        "hybrid bf16": "the CPU engine runs no exact hybrid target",
    }
    assert "all passed" in out.stdout.splitlines()[-1]


def gpu_check_caps(gpu) -> dict:
    # one H200 from a bare machine: the core checks' caps (train_step twice) leave 40 s of the 6 minutes to start
    assert gpu.registry.CORE_SECONDS <= 320
    assert [c.name for c in gpu.registry.CHECKS] == list(gpu.registry.CAPS) and set(gpu.registry.CAPS) == CHECKS
    return gpu.registry.CAPS


def assert_training_rows(rows: list[dict]) -> None:
    """train_step (both drafter shapes and 2 processes) and packing: train's own figures, FLOPs and their share."""
    rate = next(r for r in rows if r["check"] == "matmul_rate")["tflops_per_s"]
    assert rate > 0
    trained = [r for r in rows if r["check"] == "train_step" and "skipped" not in r]
    assert {r["case"] for r in trained} == {"qwen3-8b-drafter", "qwen3.6-27b-drafter", "qwen3.6-27b-drafter x2"}
    for row in trained:
        assert row["steps"] >= 1 and row["step_ms"] > 0 and row["context_tokens_per_s"] > 0
        assert row["peak_memory_gib"] > 0 and row["attention_shapes"] >= 0 and row["compiled_graphs"] >= 0
        assert row["padding_share"] == 0 and "sized_down" not in row  # one sequence of seq_len tokens
        # the share is the step's FLOPs over its time against the matmul rate
        share = row["tflops_per_step"] * 1e12 * row["steps"] / (row["step_ms"] * row["steps"] / 1000) / (rate * 1e12)
        assert row["processes"] == 2 or abs(row["matmul_share"] - share) <= 0.02 * share + 1e-4
    packing = [r for r in rows if r["check"] == "packing"]
    assert [r["case"].split()[0] for r in packing] == ["unpacked", "packed"]
    unpacked, packed = packing
    assert packed["padding_share"] < unpacked["padding_share"]  # rows filled by documents, not padding
    assert all(r["supervised_tokens_per_s"] > 0 and r["new_attention_shapes"] >= 0 for r in packing)
    assert packed["tflops_per_step"] > 0 and unpacked["records"] == packed["records"]


def assert_tree_rows(rows: list[dict]) -> None:
    tree = next(r for r in rows if r["check"] == "draft_tree")
    assert tree["passed"] and tree["lossless"] == {"16": True, "32": True, "64": True} and not tree["differs"]
    assert tree["nodes"] == {"16": 16, "32": 32, "64": 64} and all(v > 0 for v in tree["verify_ms"].values())
    assert str(tree["best_budget"]) in tree["predicted_speedup"] and tree["chain_verify_ms"] > 0
    hybrid = next(r for r in rows if r["check"] == "draft_tree_hybrid")
    assert hybrid["passed"] and hybrid["linear_backend"] == "torch" and not hybrid["refused"]  # fla refuses: GPU


def test_train_step_flops_count_the_visible_keys_and_the_trained_positions(gpu):
    from flashdraft.drafter.config import DrafterConfig
    from flashdraft.train.data import Batch

    cfg = DrafterConfig(block_size=2, **gpu.shapes.TINY | dict(num_hidden_layers=1))
    # one row: 4 context tokens (positions 0..3) and 1 padding slot, 2 blocks anchored at 2 and 4, the second untrained
    batch = Batch(
        [0],
        torch.zeros(1, 5, 3 * 64),
        torch.tensor([[0, 1, 2, 3, 1 << 62]]),
        torch.zeros(1, 4, dtype=torch.long),
        torch.tensor([[2, 4]]),
        torch.tensor([[-100, 7, -100, -100]]),
        None,
    )
    h, q, kv, i, v = 64, 64, 64, 128, 512
    fc = 2 * 4 * 3 * h * h
    context_kv = 2 * 4 * h * kv
    block = 2 * 2 * (h * (q + kv) + q * h + 3 * h * i)  # 1 trained block of 2 tokens
    attention = 4 * 2 * (2 + 2) * q  # it sees 2 context tokens (positions 0, 1) and its own 2
    head = 2 * 1 * h * v  # 1 trained position
    assert gpu.training.train_step_flops(cfg, batch) == 3 * (fc + context_kv + block + attention + head)


def test_the_bench_checks_row_reads_measured_beside_predicted_per_concurrency_and_fails_unless_lossless(
    gpu, monkeypatch, tmp_path
):
    # the check itself starts vLLM twice (`--checks bench`, the GPU machine); here its reading of bench's figures
    row = {
        "concurrency": 1,
        "speedup_output_tok_s": {"value": 1.8123, "error": 0.1},
        "predicted": {"output_tok_s": 1.9},
        "tau": 3.21,
    }
    summary = {
        "engine": "vllm 0.33.0",
        "machine": "1-GPU",
        "lossless": False,
        "sets": [
            {"by_concurrency": [row, row | {"concurrency": 8, "speedup_output_tok_s": {"value": 1.2, "error": None}}]}
        ],
    }

    def fake_bench(argv):
        assert argv[0] == "bench" and argv[argv.index("--concurrency") + 1] == "1,8,32"
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(summary, f)
        return 1

    monkeypatch.setattr(gpu.engine, "_trained_drafter", lambda case, work, prompts_count=8: ("t", "p", "d"))
    monkeypatch.setattr("flashdraft.cli.main", fake_bench)
    result = gpu.engine.check_bench(str(tmp_path))
    assert result["passed"] is False and result["speedup"] == {1: 1.812, 8: 1.2}
    assert gpu.runner.summary(result) == "c1: 1.812x (predicted 1.9x, τ 3.21); c8: 1.2x (predicted 1.9x, τ 3.21)"


def test_linear_attention_drift_fails_the_check_and_exits_1(gpu, monkeypatch, capsys):
    raw_recurrent = inspect.unwrap(qwen3_5.torch_recurrent_gated_delta_rule)

    def drifting(*args, **kwargs):
        out, state = raw_recurrent(*args, **kwargs)
        return out + 0.05 * torch.randn_like(out), state

    monkeypatch.setattr(qwen3_5, "torch_recurrent_gated_delta_rule", drifting)
    torch.manual_seed(0)
    assert gpu.runner.main(["--dry-run", "--checks", "linear_attention_parity"]) == 1
    out = capsys.readouterr().out
    rows = result_rows(out)
    assert [(r["case"], r["passed"]) for r in rows] == [("float32", False), ("bfloat16", False)]
    assert "FAIL" in out and "2 failed" in out.splitlines()[-1]


def test_static_decode_when_asked_compiles_the_slices_decoding_once_and_nothing_after(gpu, capsys):
    # --dry-run traces with dynamo's eager backend (the graphs and guards inductor would compile, none of its cost)
    assert gpu.runner.main(["--dry-run", "--checks", "static_decode"]) == 0
    rows = result_rows(capsys.readouterr().out)
    assert [r["case"] for r in rows] == ["eager", "compiled (eager)"]
    eager, compiled = rows
    assert compiled["passed"] and compiled["warm_up_compiles"] == 2  # the verify and the drafter's step
    assert compiled["compiles_after_warm_up"] == 0 and compiled["graph_breaks"] == 0 and compiled["same_tokens"]
    assert compiled["steps"] == eager["steps"] > 1 and compiled["floor_ms"] == eager["floor_ms"] > 0
    assert compiled["host_transfers_per_step"] == 1


def test_a_check_past_its_cap_is_stopped_and_reported_and_the_run_goes_on(gpu, monkeypatch, capsys):
    monkeypatch.setitem(gpu.registry.CAPS, "target_verify_cost", 1)
    monkeypatch.setattr(gpu.verify_cost, "check_target_verify_cost", lambda target, widths: time.sleep(5))
    assert gpu.runner.main(["--dry-run", "--checks", "target_verify_cost,linear_attention_parity"]) == 1
    out = capsys.readouterr().out
    rows = result_rows(out)
    assert [r["check"] for r in rows] == ["linear_attention_parity"] * 2 + ["target_verify_cost"]
    assert rows[-1]["error"] == "OverCap: over its 1 s cap" and rows[-1]["seconds"] < 3
    assert "# target_verify_cost (16 vs 1 tokens): cap 1 s" in out


def test_a_check_is_one_function_registered_in_the_list_announced_capped_summarised_and_failing_the_run(
    gpu, monkeypatch, capsys
):
    registry = gpu.registry

    def check_two_cases(run) -> list[dict]:  # what a new check is: rows with its name, case and figures
        return [{"check": "new_check", "case": "a", "passed": True, "ms": 1.5}, {"check": "new_check", "case": "b"}]

    def check_failing(run) -> dict:
        return {"check": "new_check", "case": "c", "passed": False, "ms": 9.0}

    def new_check(run):  # two capped cases, the second run as it is asked for
        return [
            registry.Case("first", lambda: check_two_cases(run)),
            registry.Case("second", lambda: check_failing(run)),
        ]

    check = registry.Check("new_check", 7, new_check, lambda row: f"{row.get('ms', 0)} ms")
    monkeypatch.setattr(registry, "CHECKS", [*registry.CHECKS, check])
    monkeypatch.setitem(registry.CAPS, "new_check", check.cap)
    assert gpu.runner.main(["--dry-run", "--checks", "new_check"]) == 1
    out = capsys.readouterr().out
    assert "# new_check (first): cap 7 s" in out and "# new_check (second): cap 7 s" in out
    assert [(r["case"], "seconds" in r) for r in result_rows(out)] == [("a", True), ("b", True), ("c", True)]
    table = out.splitlines()[-4:]
    assert "PASS" in table[0] and "1.5 ms" in table[0] and "ok" in table[1] and "FAIL" in table[2]
    assert "9.0 ms" in table[2] and "1 failed" in table[3]


def test_compiled_train_step_when_asked_matches_eager_with_no_recompile_and_reads_the_cache_beside(gpu, capsys):
    # --dry-run: dynamo's eager backend on the tiny 27B-like drafter (sliding + full layers), one shape
    assert gpu.runner.main(["--dry-run", "--checks", "compiled_train_step"]) == 0
    rows = result_rows(capsys.readouterr().out)
    name = "qwen3.6-27b-drafter"
    assert [r["case"] for r in rows] == [f"{name} packed", f"{name} unpacked bucket", f"{name} cache"]
    for row in rows[:2]:  # one batch shape each: compiled at the warm-up step, nothing after it
        assert row["passed"] and row["backend"] == "eager" and row["steps"] == 2 and row["batch_shapes"] == 1
        assert row["step_compiles"] >= 1 and row["step_compiles_after_warmup"] == row["step_recompiles"] == 0
        assert row["eager_step_ms"] > 0 and row["compiled_step_ms"] > 0 and row["max_relative_loss_difference"] < 1e-4
    packed, cache = rows[0], rows[2]
    assert cache["compiled_step_context_tokens_per_s"] == packed["compiled_context_tokens_per_s"] > 0
    ratio = cache["cold_batches_context_tokens_per_s"] / packed["compiled_context_tokens_per_s"]
    assert abs(cache["read_over_step"] - ratio) <= 0.01 * ratio + 0.01
    assert cache["feature_width"] == 3 * 64 and cache["run_steps"] >= 2 and cache["wait_s"] >= 0


def test_compiled_train_step_fails_when_a_timed_step_would_recompile(gpu, monkeypatch):
    # records in two length buckets: the unpacked timed steps meet a second shape, which fail_on_recompile refuses
    real = gpu.training.compiled_train_records

    def two_buckets(cfg, widths, packed, steps):
        records = real(cfg, widths, packed, steps)
        return records + gpu.models.synthetic_records(cfg, [24] * len(records), seed=1)

    monkeypatch.setattr(gpu.training, "compiled_train_records", two_buckets)
    row = gpu.training.check_compiled_train_step("qwen3-8b-drafter", gpu.shapes.DRY, torch.device("cpu"), False, {})
    assert not row["passed"] and "fail_on_recompile" in row["recompiled"] and row["steps"] < 2
