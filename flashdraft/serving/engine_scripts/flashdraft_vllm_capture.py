"""Run by the engine's Python (vLLM's own environment), never imported by flashdraft: the target's hidden states
of token sequences, captured with vLLM's `extract_hidden_states` speculative method.

    python flashdraft_vllm_capture.py JOB.json

JOB.json: {"model", "aux_layer_ids" (vLLM's ids: transformers' hidden_states[k]), "dtype", "tensor_parallel_size",
"enable_prefix_caching", "enable_chunked_prefill", "seed", "out_dir", "sequences": [{"name", "token_ids"}]}.
Writes OUT_DIR/NAME.safetensors ("hidden_states" [n_tokens, n_layers, H], "token_ids" [n_tokens]) for each
sequence not already there, and OUT_DIR/engine.json (the engine's version and settings as it ran). Its
`CpuHiddenStatesConnector` is vLLM's `ExampleHiddenStatesConnector` with a synchronous write: the stock one pins
host memory and uses CUDA streams, which fail on a CPU.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
    load_hidden_states,
)


class _Done:
    """Stands for the CUDA event the stock connector polls: the synchronous copy is done when it returns."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        save_file(self._tensors(states.to("cpu").contiguous(), pending.token_ids.clone()), pending.filename)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)  # releases the reader waiting on the file's lock
        self._req_copy_events[pending.req_id] = _Done()

    def _tensors(self, states: torch.Tensor, token_ids: torch.Tensor) -> dict:
        return {"hidden_states": states, "token_ids": token_ids}


class CpuFP8HiddenStatesConnector(CpuHiddenStatesConnector):
    """hs-connectors' FP8 connector on a CPU: float8_e4m3fn states with one float32 scale per token, as its
    `FP8HiddenStatesConnector` writes them (read back by its `FP8Transfer`)."""

    def _tensors(self, states: torch.Tensor, token_ids: torch.Tensor) -> dict:
        from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

        fp8_states, scales = quantize_tensor_to_fp8(states)
        return {"hidden_states": fp8_states, SCALES_KEY: scales, "token_ids": token_ids}


def main(job_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_path).read_text())
    out = Path(job["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    staging = out / "engine-files"
    todo = [s for s in job["sequences"] if not (out / f"{s['name']}.safetensors").is_file()]
    on_cpu = not torch.cuda.is_available()
    settings = {
        "tensor_parallel_size": job.get("tensor_parallel_size", 1),
        "dtype": job["dtype"],
        "enable_prefix_caching": job.get("enable_prefix_caching", False),
        "enable_chunked_prefill": job.get("enable_chunked_prefill"),
    }
    connector = "CpuHiddenStatesConnector" if on_cpu else "ExampleHiddenStatesConnector"
    kv_transfer = {
        "kv_connector": connector,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging)},
    }
    if on_cpu:
        kv_transfer["kv_connector_module_path"] = "flashdraft_vllm_capture"
    llm = LLM(
        model=job["model"],
        seed=job.get("seed", 0),
        enforce_eager=True,
        gpu_memory_utilization=job.get("gpu_memory_utilization", 0.9 if not on_cpu else 0.3),
        tensor_parallel_size=settings["tensor_parallel_size"],
        dtype=job["dtype"],
        enable_prefix_caching=settings["enable_prefix_caching"],
        **(
            {"enable_chunked_prefill": settings["enable_chunked_prefill"]}
            if settings["enable_chunked_prefill"] is not None
            else {}
        ),
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": job["aux_layer_ids"]}},
        },
        kv_transfer_config=kv_transfer,
    )
    start = time.time()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    batch = job.get("batch_size", 16)
    for i in range(0, len(todo), batch):
        chunk = todo[i : i + batch]
        results = llm.generate([TokensPrompt(prompt_token_ids=s["token_ids"]) for s in chunk], params, use_tqdm=False)
        for seq, result in zip(chunk, results, strict=True):
            path = (result.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise SystemExit(f"sequence {seq['name']}: the engine returned no hidden_states_path")
            data = load_hidden_states(path)
            target = out / f"{seq['name']}.safetensors"
            save_file({k: v.contiguous() for k, v in data.items()}, str(target) + ".tmp")
            os.replace(str(target) + ".tmp", target)
            for stale in (path, path + ".lock"):
                if os.path.exists(stale):
                    os.remove(stale)
        print(f"captured {min(i + batch, len(todo))} of {len(todo)} sequences", flush=True)
    info = {
        "engine": "vllm",
        "version": vllm_version,
        "device": "cpu" if on_cpu else "cuda",
        "connector": connector,
        "seconds": time.time() - start,
        **settings,
    }
    (out / "engine.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
