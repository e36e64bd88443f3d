"""Training fed by the serving engine: vLLM prefills each training sequence with its `extract_hidden_states`
method and its KV-transfer connector hands the drafter layers' states to the trainer through hs-connectors (the file
backend on one node), so no hidden-state cache is written.

The trainer asks for the samples in the order the loop will read them (a function of seed, epoch and step, and packed,
of the rows: see `step.stream_order`), at most `prefetch` ahead, over one or several engines (round-robin). Every sample
is checked as `cache --engine` checks a capture (length, token ids, finite and non-zero states); the known-answer probe
and a share of the samples are recomputed by the target's own forward before training starts (the trainer then frees the
target's decoder layers: it keeps only its embeddings and LM head). A failed check, or an engine that stops answering,
stops the run in one line naming the sample, layer and engine.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashdraft.data.cache import DEFAULT_TOLERANCE, DTYPE_NAMES
from flashdraft.data.engine_capture import (
    PROBE,
    aux_layer_ids,
    check_sample,
    compare_with_target,
    probe_tokens,
    refuse_mismatch,
    verify_picks,
)
from flashdraft.errors import FlashdraftError
from flashdraft.serving.engine import VllmServer, engine_python
from flashdraft.target.image_files import refuse_engine_images

DEFAULT_PREFETCH = 8  # samples asked of the engines ahead of the trainer
REQUEST_TIMEOUT_S = 600.0
STAGING_DIR = "engine-states"  # under the run directory: the file backend's bounded buffer


class EngineLost(FlashdraftError):
    """An engine stopped answering mid-run: the loop checkpoints and stops."""


@dataclass(frozen=True)
class EngineFeedConfig:
    """How the engines feed training."""

    servers: tuple[str, ...] = ()  # given engines' base URLs; empty: flashdraft starts one on 127.0.0.1
    prefetch: int = DEFAULT_PREFETCH
    fp8: bool = False  # states quantized to FP8 on the wire (hs-connectors' per-token scales)
    verify_share: float = 0.05  # of the samples recomputed by the target before training starts
    python: str | None = None  # the engine's Python (`make engine`'s .venv-engine by default)


def hidden_states_transfer(staging: Path, fp8: bool):
    """hs-connectors' reader for the file backend (FP8: dequantized to float32 as it is read)."""
    try:
        from hs_connectors import FileTransfer, FP8Transfer
    except ImportError:
        raise FlashdraftError(
            "train --engine needs hs-connectors (Python >= 3.11): pip install -c constraints.txt hs-connectors"
        ) from None

    return FP8Transfer(staging, dequantize_dtype=torch.float32) if fp8 else FileTransfer(staging)


def engine_server(python: Path, target_path: str, dtype: str, layer_ids: list[int], staging: Path, fp8: bool):
    """A vLLM server on 127.0.0.1 that writes each request's states for `layer_ids` under `staging` (the CPU
    build's synchronous connector, or hs-connectors' FP8 one; vLLM's own on a GPU)."""
    import torch.cuda

    on_cpu = not torch.cuda.is_available()
    connector = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "flashdraft_vllm_capture"}
    if not on_cpu:
        connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if fp8:
        module = "flashdraft_vllm_capture" if on_cpu else "hs_connectors.fp8_hidden_states_connector"
        name = "CpuFP8HiddenStatesConnector" if on_cpu else "FP8HiddenStatesConnector"
        connector = {"kv_connector": name, "kv_connector_module_path": module}
    kv_transfer = connector | {
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging)},
    }
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(layer_ids)}},
    }
    return VllmServer(
        python=python,
        model=target_path,
        log_path=staging.parent / "engine.log",
        dtype=dtype,
        speculative_config=speculative,
        # prefix caching gives fewer states than tokens (vLLM #44485)
        extra_args=["--kv-transfer-config", json.dumps(kv_transfer), "--no-enable-prefix-caching"],
    )


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


@dataclass
class Engine:
    """One engine the trainer asks: its base URL and the model name it serves."""

    url: str
    model: str = ""

    def join(self) -> Engine:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as answer:
                self.model = json.loads(answer.read())["data"][0]["id"]
        except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as e:
            raise FlashdraftError(f"engine {self.url}: no model served at /v1/models ({e})") from None
        return self

    def prefill(self, tokens: list[int], name: str) -> dict:
        """The engine prefills `tokens`; returns its kv_transfer_params (where the connector put the states)."""
        body = {"model": self.model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0}
        try:
            answer = _post(self.url + "/v1/completions", body, REQUEST_TIMEOUT_S)
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise EngineLost(f"engine {self.url} stopped answering at sample {name}: {e}") from None
        params = answer.get("kv_transfer_params")
        if not params:
            raise FlashdraftError(
                f"engine {self.url}: no kv_transfer_params for sample {name}; expected an engine started with "
                f"--speculative-config extract_hidden_states and a hidden-states KV connector"
            )
        return params


@dataclass
class EngineSample:
    """A training sequence with the states the engine gave for it (a `TrainRecord`)."""

    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool
    context_features: torch.Tensor  # [T, n_layers * H]
    target_topk: None = None


@dataclass
class EngineRecords:
    """Training records whose context features the engines compute as the loop reads them, in the order it reads
    them (`start`), at most `prefetch` ahead. `wait_seconds` is the time the loop waited for states."""

    records: list  # SequenceRecord-likes: input_ids, loss_mask (and an id)
    engines: list[Engine]
    layer_ids: list[int]
    hidden_size: int
    transfer: object  # hs-connectors' HiddenStatesTransfer
    prefetch: int = DEFAULT_PREFETCH
    wait_seconds: float = 0.0
    _order: deque = field(default_factory=deque)
    _pending: deque = field(default_factory=deque)  # (index, future) in the loop's order
    _pool: ThreadPoolExecutor | None = None
    _asked: int = 0  # samples asked so far: spreads them over the engines

    def __len__(self) -> int:
        return len(self.records)

    @property
    def feature_dim(self) -> int:
        """The width of a sample's context features (`fetch`): its layers' states side by side."""
        return len(self.layer_ids) * self.hidden_size

    def start(self, order: list[int]) -> None:
        """The record indices the loop will read, in order (this rank's share of the steps still to run)."""
        self.close()
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.prefetch), thread_name_prefix="engine-feed")
        self._order = deque(order)
        self._fill()

    def _fill(self) -> None:
        while self._order and len(self._pending) < max(1, self.prefetch):
            index = self._order.popleft()
            engine = self.engines[self._asked % len(self.engines)]
            self._asked += 1
            self._pending.append((index, self._pool.submit(self.fetch, index, engine)))

    def name(self, index: int) -> str:
        """The request's name at the engine: the record's index in the stream (unique, whatever its id)."""
        return str(index)

    def fetch(self, index: int, engine: Engine) -> EngineSample:
        """Sample `index`'s states from `engine`, checked (`check_sample`), the engine's files removed."""
        record, name = self.records[index], self.name(index)
        tokens = record.input_ids.tolist()
        states = fetch_states(engine, self.transfer, tokens, name, self.layer_ids, self.hidden_size)
        features = states.float().reshape(states.shape[0], -1)  # [T, n_layers * H]: layer blocks side by side
        return EngineSample(record.input_ids, record.loss_mask, features)

    def __getitem__(self, index: int) -> EngineSample:
        if not self._pending:
            raise FlashdraftError(f"record {index} read outside the engine's stream (EngineRecords.start not called)")
        expected, future = self._pending.popleft()
        if expected != index:
            raise FlashdraftError(f"record {index} read where the engine's stream has record {expected} next")
        started = time.monotonic()
        try:
            sample = future.result()
        except BaseException:
            self.close()
            raise
        self.wait_seconds += time.monotonic() - started
        self._fill()
        return sample

    def close(self) -> None:
        """Stops asking: the samples in flight are dropped (their files too)."""
        if self._pool is not None:
            for _, future in self._pending:
                future.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()


def fetch_states(
    engine: Engine, transfer, tokens: list[int], name: str, layer_ids: list[int], hidden_size: int
) -> torch.Tensor:
    """The engine's states [T, n_layers, H] for `tokens`, read through hs-connectors and checked; the engine's file
    is deleted once read (the staging directory holds only what is in flight)."""
    params = engine.prefill(tokens, name)
    sample = transfer.get_generated(params)
    handle = params.get("hidden_states_path") or params.get("handle")
    if sample is None:
        raise FlashdraftError(f"engine {engine.url}: sample {name}'s states are not at {handle}")
    transfer.delete(handle)
    try:
        check_sample(name, tokens, sample["hidden_states"], sample["token_ids"].tolist(), layer_ids, hidden_size)
    except FlashdraftError as e:
        raise FlashdraftError(f"{e} (engine {engine.url})") from None
    return sample["hidden_states"]


def verify_engines(target, records: EngineRecords, share: float, seed: int = 0, fp8: bool = False, log=print) -> dict:
    """Before training: the known-answer probe on every engine and a `share` of the samples (at least one) against
    the target's own forward, per layer (`refuse_mismatch`: off by one named). FP8 states are held to their
    measured error against FP8's rounding (2^-4 relative), not to the dtype's. Returns the figures."""
    if not 0 <= share <= 1:
        raise FlashdraftError(f"--verify-share {share}: expected a share in [0, 1]")
    tolerance = 0.07 if fp8 else DEFAULT_TOLERANCE[DTYPE_NAMES[target.dtype]]
    picks = verify_picks(len(records), share, seed)
    count = len(picks)
    probe = probe_tokens(target.vocab_size)
    jobs = [(engine, PROBE, probe) for engine in records.engines]
    jobs += [
        (records.engines[k % len(records.engines)], records.name(i), records.records[i].input_ids.tolist())
        for k, i in enumerate(picks)
    ]
    matches = []
    for engine, name, tokens in jobs:
        states = fetch_states(engine, records.transfer, tokens, name, records.layer_ids, records.hidden_size)
        found = compare_with_target(target, name, tokens, states.float(), records.layer_ids)
        try:
            refuse_mismatch(found, tolerance)
        except FlashdraftError as e:
            raise FlashdraftError(f"{e} (engine {engine.url})") from None
        matches += found
    worst = max(matches, key=lambda m: m.relative_error)
    log(
        f"engine states verified before training: the probe on {len(records.engines)} engine(s) and {count} samples "
        f"recomputed by the target: worst relative error {worst.relative_error:.2e} (sample {worst.sample} layer "
        f"{worst.layer}; tolerance {tolerance:.0e}{', FP8 on the wire' if fp8 else ''}); every sample is checked "
        f"for length, token ids, finite and non-zero states as it arrives"
    )
    return {"samples_recomputed": [n for _, n, _ in jobs], "worst_relative_error": worst.relative_error}


def buffer_bytes(records: EngineRecords, bytes_per_value: int = 4) -> int:
    """What the prefetch holds at most: `prefetch` of the longest sequences' states, in the trainer's memory."""
    longest = max((len(r.input_ids) for r in records.records), default=0)
    return max(1, records.prefetch) * longest * len(records.layer_ids) * records.hidden_size * bytes_per_value


def staging_directory(run_dir: Path) -> Path:
    staging = Path(run_dir) / STAGING_DIR
    staging.mkdir(parents=True, exist_ok=True)
    return staging


@contextlib.contextmanager
def engine_fed(
    feed: EngineFeedConfig, online, target_path: str, layer_ids: list[int], run_dir: Path, dtype, main: bool
):
    """`online` (the completions as training sequences) as `EngineRecords`: the engines started (or joined),
    verified against the target before training starts (loaded whole for that on the CPU, then freed), and
    stopped on every way out (errors, Ctrl-C, SIGTERM)."""
    from flashdraft.target.model import TargetModel, resolve_target_path

    refuse_engine_images(online.records, "train --engine vllm")  # before the engine starts
    log = print if main else (lambda _: None)
    staging = staging_directory(run_dir)
    with contextlib.ExitStack() as stack:
        urls = list(feed.servers)
        if not urls:
            server = engine_server(
                engine_python(feed.python),
                str(resolve_target_path(target_path)),
                DTYPE_NAMES[dtype],
                layer_ids,
                staging,
                feed.fp8,
            )
            log(f"starting the engine ({server.python}) on 127.0.0.1:{server.port}; log {server.log_path}")
            urls.append(stack.enter_context(server).base_url)
        verifier = TargetModel.load(target_path, torch.device("cpu"), dtype)
        records = EngineRecords(
            records=online.records,
            engines=[Engine(url.rstrip("/")).join() for url in urls],
            layer_ids=layer_ids,
            hidden_size=verifier.hidden_size,
            transfer=hidden_states_transfer(staging, feed.fp8),
            prefetch=feed.prefetch,
        )
        stack.callback(records.close)
        verify_engines(verifier, records, feed.verify_share, fp8=feed.fp8, log=log)
        del verifier  # the trainer keeps only the target's embeddings and LM head
        log(
            f"fed by {len(records.engines)} engine(s) ({', '.join(urls)}) through hs-connectors' file backend"
            f"{' (FP8 states)' if feed.fp8 else ''}; prefetch {records.prefetch} samples: at most "
            f"{buffer_bytes(records) / 2**20:.1f} MiB of states held ahead of the trainer"
        )
        yield records
