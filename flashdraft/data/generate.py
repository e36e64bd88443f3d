"""`flashdraft generate`, one rank of the command: its options checked, the target loaded, the engine's server
started when asked (`--engine vllm`), the completions generated (`completions.generate_completions`), then how many
were cut at max_new_tokens, and an engine's checked against the target.

A module of its own, apart from the completions format: checking an engine's completions reads the evaluation's
teacher-forced figures (`flashdraft.decoding.target_samples`), a later stage than the completions the evaluation reads.
"""

from __future__ import annotations

import json
import random
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from flashdraft.data.chat_mode import check_engine_render, describe_mix, resolve_mode
from flashdraft.data.completions import GenerationSettings
from flashdraft.data.completions_writer import generate_completions
from flashdraft.data.images import message_images
from flashdraft.data.openai_client import OpenAIClient
from flashdraft.data.prompts import LONG_PROMPT_POLICIES, has_chat_template, ignored_tools_note, load_prompts
from flashdraft.data.reasoning import unknown_reasoning_note
from flashdraft.decoding.serving_rules import (
    NO_FILTERS,
    SamplingFilters,
    greedy_filters_note,
    greedy_in_effect_note,
    resolve_filters,
)
from flashdraft.decoding.target_samples import EngineOutput, greedy_agreement, sampling_fidelity
from flashdraft.distributed import Dist, init_distributed, load_dtype, lock_on_main, pick_device
from flashdraft.errors import FlashdraftError
from flashdraft.target.image_files import ENGINE_WITHOUT_IMAGES, check_target_reads_images
from flashdraft.target.model import TargetModel, resolve_target_path


def _start_engine(engine: str, python: str | None, target: TargetModel, out: Path, target_dtype: str | None):
    """The engine's server for `generate --engine` (not yet entered): the target alone, in the dtype asked for
    (default float32: outputs equal to flashdraft's local fp32 generation)."""
    from flashdraft.serving.engine import VllmServer, engine_info, engine_python

    if engine != "vllm":
        raise FlashdraftError(f"--engine {engine}: expected vllm")
    py = engine_python(python)
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(target_dtype or "", "float32")
    server = VllmServer(
        py,
        str(resolve_target_path(target.path)),
        out.with_name(out.name + ".vllm.log"),
        dtype=dtype,
        info=engine_info(py),
    )
    print(f"starting {server.info.describe()}: {' '.join(server.command())}")
    return server


def check_engine_completions(
    target: TargetModel, path: Path, settings: GenerationSettings, filters: SamplingFilters, share: float
) -> None:
    """The engine's completions checked, not trusted: a `share` of them (at least one) teacher-forced through the
    target: at T = 0 each token its argmax (near-ties aside), at T > 0 samples of its filtered p; refused otherwise
    (the file stays, for inspection)."""
    records = json.loads(path.read_text()).get("records", [])
    picks = random.Random(0).sample(records, min(len(records), max(1, round(share * len(records)))))
    outputs = [EngineOutput(r["id"], r["prompt_ids"], r["completion_ids"]) for r in picks]
    if settings.temperature <= 0:
        found = greedy_agreement(target, outputs)
        print(
            f"checked {len(outputs)} of {len(records)} completions against the target: {found['greedy']} its "
            f"greedy output, {found['near_ties']} past a near-tie (logits within "
            f"{found['tie_margin']:g})"
        )
    else:
        found = sampling_fidelity(target, outputs, settings.temperature, filters)
        print(
            f"checked {len(outputs)} of {len(records)} completions against the target: log-likelihood score "
            f"z = {found['log_likelihood_z']:+.2f} over {found['tokens']} tokens (samples of its p: |z| <= "
            f"{found['z_limit']:g})"
        )
    if found["problems"]:
        raise FlashdraftError(
            f"{path}: {settings.engine_version}'s completions are not the target's: "
            f"{found['problems'][0]}"
            + (f" (and {len(found['problems']) - 1} more)" if len(found["problems"]) > 1 else "")
        )


def report_truncated(path: Path) -> None:
    """How many completions stopped at max_new_tokens rather than at a stop token: training on them is fine, but
    a share near 1 says the budget cuts answers short."""
    data = json.loads(path.read_text())
    records = data.get("records", [])
    cut = sum(r.get("stop_reason") == "length" for r in records)
    print(
        f"{cut} of {len(records)} completions truncated at max_new_tokens (stop_reason length), "
        f"{len(records) - cut} ended by a stop token"
    )
    if data.get("chat_mode"):
        print(f"chat mode: {describe_mix(data['chat_mode'])}")


def _check_options(
    backend: str, base_url: str | None, server_model: str | None, engine: str | None, long_prompts: str
) -> None:
    """Refuse options that contradict each other, before the target loads."""
    if backend == "openai" and not base_url:
        raise FlashdraftError("--backend openai needs --base-url (the server, e.g. http://localhost:8000/v1)")
    if backend != "openai" and (base_url or server_model):
        raise FlashdraftError("--base-url and --server-model are for --backend openai; this run generates locally")
    if engine is not None and (backend != "local" or base_url):
        raise FlashdraftError(f"--engine {engine} starts its own server: drop --backend openai and --base-url")
    if long_prompts not in LONG_PROMPT_POLICIES:
        raise FlashdraftError(f"--long-prompts {long_prompts}: expected one of {', '.join(LONG_PROMPT_POLICIES)}")


def _check_image_prompts(target: TargetModel, prompts, c) -> None:
    """Prompts with images need a target that reads them, decoded locally: refused before anything is written."""
    with_images = [p.id for p in prompts if message_images(p.conversation([""] * (len(p.turns) - 1)))]
    if with_images:
        check_target_reads_images(target, True, f"--prompts {c.prompts}: prompt {with_images[0]!r}")
    if with_images and (c.engine or c.backend == "openai"):
        raise FlashdraftError(f"--prompts {c.prompts}: prompt {with_images[0]!r} has images; {ENGINE_WITHOUT_IMAGES}")


def _use_chat_template(target: TargetModel, chat_template: bool | None, device, dist: Dist) -> bool:
    """--chat-template, or (None) whether the target's tokenizer has one."""
    has_template = has_chat_template(target.tokenizer)
    if chat_template and not has_template:
        raise FlashdraftError(f"{target.path}: the tokenizer has no chat template; drop --chat-template")
    use_template = has_template if chat_template is None else chat_template
    if dist.is_main:
        print(
            f"target {target.path} on {device}: "
            + ("chat template applied" if use_template else "no chat template, prompts used as plain text")
        )
    return use_template


def _sampling_filters(
    target: TargetModel,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    use_generation_config: bool,
    dist: Dist,
) -> SamplingFilters:
    """The filters applied to the target's p at temperature > 0 (none when greedy, saying so when some were given)."""
    note = greedy_filters_note(top_k, top_p, min_p) if temperature <= 0 else None
    if note and dist.is_main:
        print(note)
    if temperature <= 0:
        return NO_FILTERS
    filters = resolve_filters(target.path, top_k, top_p, min_p, use_generation_config)
    if dist.is_main and greedy_in_effect_note(temperature, filters):
        print(greedy_in_effect_note(temperature, filters))
    if dist.is_main:
        settings_line = ", ".join(f"{k} {v} ({filters.source[k]})" for k, v in filters.active().items())
        print(f"sampling: temperature {temperature}, {settings_line or 'no filters'}")
    return filters


def _engine_render_check(server, client: OpenAIClient, target: TargetModel):
    """The check each prompt gets with an engine: rendered by it as its chat clients' requests are, equal to
    flashdraft's (`chat_mode.check_engine_render`)."""

    def check(record_id: str, messages: list, kwargs: dict, ids: list[int], tools: list | None = None) -> None:
        engine = server.info.describe()
        check_engine_render(
            client,
            engine,
            record_id,
            messages=messages,
            kwargs=kwargs,
            prompt_ids=ids,
            tokenizer=target.tokenizer,
            tools=tools,
        )

    return check


@dataclass(frozen=True)
class GenerateConfig:
    """The inputs of `flashdraft generate` (its flags; the API's keyword arguments), built once."""

    target_model: str
    prompts: str  # a .jsonl/.parquet file, a dataset directory or builtin:code[:heldout]
    out: str
    num_prompts: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 8
    backend: str = "local"  # "local" or "openai" (a server given by base_url)
    base_url: str | None = None
    server_model: str | None = None
    chat_template: bool | None = None  # None: the target's template where it has one
    device: str | None = None
    target_dtype: str | None = None
    # a prompt longer than the context minus max_new_tokens: "error", "skip" or "truncate"
    long_prompts: str = "error"
    min_prompt_tokens: int = 0  # turns with shorter prompts are left out (long-context data from any dataset)
    # T > 0: filters of the target's p; None: generation_config.json's values (as the servers apply them) unless
    # use_generation_config is off; greedy decoding needs none
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    use_generation_config: bool = True
    # "vllm": the completions come from a vLLM server started for this run (engine_python's environment, on
    # 127.0.0.1, stopped at the end), every prompt rendered by it too and refused where it differs
    engine: str | None = None
    engine_python: str | None = None
    verify_share: float = 0.05  # the share of an engine's completions checked against the target
    # the template's mode (a JSON object or its text; enable_thinking its shorthand); None: its defaults, a prompt
    # row's own kwargs over them
    chat_template_kwargs: str | dict | None = None
    enable_thinking: bool | None = None
    # local decoding on the target's static cache, one compiled 1-token step at the batch size's width
    # (`decoding.batched.CompiledBatch`; on CUDA a CUDA graph); off: the eager loop
    compile: bool = False


def run_generate(config: GenerateConfig) -> Path:
    """`flashdraft generate`, one rank of it under torchrun; returns the completions file."""
    c = config
    _check_options(c.backend, c.base_url, c.server_model, c.engine, c.long_prompts)
    if c.compile and (c.backend != "local" or c.engine):
        raise FlashdraftError("--compile decodes locally on a static cache: drop --backend openai and --engine")
    dist = init_distributed()
    lock = None
    stack = ExitStack()  # the engine's server, when this run started one: stopped on every way out
    try:
        # before the target loads (minutes for a large one): a second writer of OUT is refused at once
        lock = lock_on_main(dist, Path(c.out).with_name(Path(c.out).name + ".lock"), Path(c.out), "flashdraft generate")
        dev = pick_device(dist, "cpu" if c.backend == "openai" or c.engine else c.device)
        target = TargetModel.load(c.target_model, dev, load_dtype(dev, c.target_dtype))
        prompt_list = load_prompts(c.prompts, c.num_prompts, quiet=not dist.is_main)
        _check_image_prompts(target, prompt_list, c)
        use_template = _use_chat_template(target, c.chat_template, dev, dist)
        say = print if dist.is_main else lambda _: None
        kwargs = resolve_mode(
            target.tokenizer, use_template, c.chat_template_kwargs, c.enable_thinking, prompt_list, say
        )
        if use_template and unknown_reasoning_note(target.tokenizer):
            say(f"note: {unknown_reasoning_note(target.tokenizer)}")
        if use_template and ignored_tools_note(target.tokenizer, prompt_list, kwargs):
            say(f"note: {ignored_tools_note(target.tokenizer, prompt_list, kwargs)}")
        server = _start_engine(c.engine, c.engine_python, target, Path(c.out), c.target_dtype) if c.engine else None
        backend, base_url = c.backend, c.base_url
        if server is not None:
            stack.enter_context(server)
            print(f"{server.info.describe()} ready after {server.startup_seconds:.1f} s at {server.base_url}")
            backend, base_url = "openai", server.base_url
        client = OpenAIClient(base_url, c.server_model) if backend == "openai" else None
        filters = _sampling_filters(
            target,
            c.temperature,
            c.top_k,
            top_p=c.top_p,
            min_p=c.min_p,
            use_generation_config=c.use_generation_config,
            dist=dist,
        )
        settings = GenerationSettings(
            prompts=c.prompts,
            max_new_tokens=c.max_new_tokens,
            temperature=c.temperature,
            seed=c.seed,
            chat_template=use_template,
            chat_template_kwargs=kwargs,
            backend=backend if server is None else c.engine,
            base_url=base_url if server is None else None,
            server_model=client.model if client and server is None else None,
            long_prompts=c.long_prompts,
            min_prompt_tokens=c.min_prompt_tokens,
            **filters.active(),
            engine_version=server.info.describe() if server is not None else None,
        )
        check_render = _engine_render_check(server, client, target) if server is not None else None
        path = generate_completions(
            target,
            prompt_list,
            c.out,
            settings,
            batch_size=c.batch_size,
            dist=dist,
            client=client,
            check_render=check_render,
            compile=c.compile,
        )
        if dist.is_main:
            report_truncated(path)
            if server is not None:
                check_engine_completions(target, path, settings, filters, c.verify_share)
        return path
    finally:
        stack.close()
        if lock is not None:
            lock.release()
        dist.close()
