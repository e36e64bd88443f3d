"""Run by the engine's Python (vLLM's own environment), never imported by flashdraft: load runs of `vllm bench
serve`'s client (`vllm.benchmarks.serve.benchmark`: its warm-up, concurrency limit, timing, metrics and
spec-decode counter differences) against running servers, with the requests flashdraft gives by token ids.

    python flashdraft_vllm_bench.py JOB.json OUT.json

JOB.json: {"warmups", "runs": [{"base_url", "concurrency", "requests": [{"id", "prompt_ids", "max_tokens",
"body"}]}]} (body: the request's sampling fields, merged into it; the server's first model is asked for).
OUT.json: {"runs": [{"result": vLLM's result dict, "requests": [{"id", "success", "error", "ttft", "itl",
"latency", "output_tokens", "token_ids", "finish_reason"}]}]}, runs and requests in the order given; "run I done"
on stdout after each (vLLM's own report goes to stderr). One process for every run: importing vLLM takes seconds.

vLLM's completions request function keeps the generated text only; flashdraft checks the tokens themselves (the
target's greedy ones at T = 0), so the one function here is vLLM's `async_request_openai_completions` that also
keeps each streamed chunk's `token_ids` (asked for with `return_token_ids`) and the finish reason. Everything
else is vLLM's.
"""

import asyncio
import contextlib
import json
import sys
import time
import traceback

import aiohttp
from vllm.benchmarks.datasets import SampleRequest
from vllm.benchmarks.lib import endpoint_request_func as funcs
from vllm.benchmarks.serve import TaskType, benchmark, get_first_model_from_server
from vllm.tokenizers import get_tokenizer

ENDPOINT = "flashdraft-completions"


async def completions_with_token_ids(request_func_input, session: aiohttp.ClientSession, pbar=None):
    """vLLM's `async_request_openai_completions`, keeping the streamed token ids and the finish reason."""
    payload = {
        "model": request_func_input.model_name or request_func_input.model,
        "prompt": request_func_input.prompt,
        "repetition_penalty": 1.0,
        "max_tokens": request_func_input.output_len,
        "logprobs": request_func_input.logprobs,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    funcs._update_payload_common(payload, request_func_input)
    headers = funcs._get_headers()
    funcs._update_headers_common(headers, request_func_input)
    output = funcs.RequestFuncOutput()
    output.prompt_len = request_func_input.prompt_len
    ids, finish, text, first = [], None, "", True
    st = time.perf_counter()
    output.start_time = most_recent = st
    try:
        async with session.post(url=request_func_input.api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                output.error = f"HTTP {response.status} {response.reason or ''}: {(await response.text())[:300]}"
                return output
            handler = funcs.StreamedResponseHandler()
            async for chunk_bytes in response.content.iter_any():
                for message in handler.add_chunk(chunk_bytes.strip()) if chunk_bytes.strip() else []:
                    if message.startswith(":") or message.removeprefix("data: ") == "[DONE]":
                        continue
                    data = json.loads(message.removeprefix("data: "))
                    if choices := data.get("choices"):
                        now = time.perf_counter()
                        if first:
                            output.ttft, first = now - st, False
                        else:
                            output.itl.append(now - most_recent)
                        most_recent = now
                        text += choices[0].get("text") or ""
                        ids += choices[0].get("token_ids") or []
                        finish = choices[0].get("finish_reason") or finish
                    elif usage := data.get("usage"):
                        output.output_tokens = usage.get("completion_tokens")
        output.success = bool(ids) or bool(text)
        if not output.success:
            output.error = "no chunk with a token came back"
        output.generated_text = text
        output.latency = most_recent - st
    except Exception:
        output.error = "".join(traceback.format_exception(*sys.exc_info()))
    output.token_ids, output.finish_reason = ids, finish  # what vLLM's output type has no field for
    if pbar:
        pbar.update(1)
    return output


def one_run(base: str, model: str, tokenizer, warmups: int, run: dict) -> dict:
    """One timed run of vLLM's benchmark(): its result and each request's timing and token ids, in the order given."""
    requests = [
        SampleRequest(
            prompt=r["prompt_ids"],
            prompt_len=len(r["prompt_ids"]),
            expected_output_len=r["max_tokens"],
            request_id=r["id"],
            request_overrides=r["body"],
        )
        for r in run["requests"]
    ]
    outputs = {}

    async def recorded(request_func_input, session, pbar=None):  # warm-ups carry no request id
        out = await completions_with_token_ids(request_func_input, session, pbar)
        if request_func_input.request_id is not None:
            outputs[request_func_input.request_id] = out
        return out

    funcs.ASYNC_REQUEST_FUNCS[ENDPOINT] = recorded
    result = asyncio.run(
        benchmark(
            task_type=TaskType.GENERATION,
            endpoint_type=ENDPOINT,
            api_url=base + "/v1/completions",
            base_url=base,
            model_id=model,
            model_name=None,
            tokenizer=tokenizer,
            input_requests=requests,
            logprobs=None,
            request_rate=float("inf"),
            burstiness=1.0,
            disable_tqdm=True,
            num_warmups=warmups,
            profile=False,
            selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"],
            selected_percentiles=[50.0, 99.0],
            ignore_eos=False,
            goodput_config_dict={},
            max_concurrency=run["concurrency"],
            lora_modules=None,
            extra_headers=None,
            extra_body=None,
            ready_check_timeout_sec=600,
        )
    )
    per_request = []
    for r in run["requests"]:
        out = outputs[r["id"]]
        per_request.append(
            {
                "id": r["id"],
                "success": out.success,
                "error": out.error,
                "ttft": out.ttft,
                "itl": out.itl,
                "latency": out.latency,
                "output_tokens": out.output_tokens,
                "token_ids": getattr(out, "token_ids", []),
                "finish_reason": getattr(out, "finish_reason", None),
            }
        )
    result = {k: v for k, v in result.items() if k not in ("generated_texts", "itls", "errors")}
    return {"result": result, "requests": per_request}


def served_model(base: str) -> tuple[str, object]:
    """The server's first model and its tokenizer (only for vLLM's own latency percentiles: a model name without a
    local tokenizer goes without them)."""
    model = asyncio.run(get_first_model_from_server(base))[0]
    try:
        return model, get_tokenizer(model)
    except Exception:
        return model, None


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    models, runs = {}, []
    for i, run in enumerate(job["runs"]):
        with contextlib.redirect_stdout(sys.stderr):  # vLLM's report to the log; stdout says which run is done
            if run["base_url"] not in models:
                models[run["base_url"]] = served_model(run["base_url"])
            runs.append(one_run(run["base_url"], *models[run["base_url"]], job["warmups"], run))
        print(f"run {i} done", flush=True)
    with open(out_path, "w") as f:
        json.dump({"runs": runs}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
