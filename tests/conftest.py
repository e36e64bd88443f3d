"""Tiny random targets (Qwen3 dense, Qwen3.5 hybrid, Llama) built from configs, seeded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from flashdraft.drafter.config import DrafterConfig
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.target.model import TargetModel

# Tiny models are fastest on one thread, and one thread per test process never
# oversubscribes the CI machine's 2 cores.
torch.set_num_threads(1)

VOCAB = 64
EOS, PAD, MASK = 61, 62, 63


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB - 3)} | {"<eos>": EOS, "<pad>": PAD, "<mask>": MASK}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", mask_token="<mask>")


# A Qwen3-style thinking chat template over the test vocabulary (its words whitespace-separated tokens): the tools'
# names and schemas (`tojson`, as Qwen3's) in a system turn where a request has tools, thinking by
# default (the generation prompt opens <think>), an assistant turn's reasoning from its reasoning_content (as Qwen3's
# template reads it) or its content, tool calls' arguments written as Qwen3's template writes them (text
# as it is, an object with tojson), an empty think block when enable_thinking is false, and the
# reasoning of assistant turns before the last user turn dropped from the history
THINKING_TEMPLATE = (
    "{%- if tools -%}<|im_start|> system {% for t in tools %}{{ t.function.name }} {{ t | tojson }} {% endfor %}"
    "<|im_end|> "
    "{%- endif -%}"
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() -%}"
    "{%- set content = content.split('</think>')[-1].strip() -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and reasoning -%}"
    "<|im_start|> assistant <think> {{ reasoning }} </think> {{ content }}"
    "{%- else -%}<|im_start|> assistant {{ content }}{%- endif -%}"
    "{%- for c in m.tool_calls or [] %} {{ c.function.name }} "
    "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}{% endfor %}"
    " <|im_end|>{{ ' ' }}"
    "{%- else -%}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|> assistant "
    "{%- if enable_thinking is defined and enable_thinking is false %} <think> </think> {% else %} <think> {% endif -%}"
    "{%- endif -%}"
)
# a chat template that reads no keyword argument: one mode whatever is asked
PLAIN_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|> assistant {% endif -%}"
)
CHAT_WORDS = {
    "system": 53,
    "user": 54,
    "assistant": 55,
    "<|im_start|>": 56,
    "<|im_end|>": 57,
    "<think>": 58,
    "</think>": 59,
}


def make_chat_tokenizer(template: str = THINKING_TEMPLATE) -> PreTrainedTokenizerFast:
    """The test tokenizer with chat words in place of t53..t59 and `template` as its chat template."""
    vocab = {f"t{i}": i for i in range(VOCAB - 3) if i not in CHAT_WORDS.values()} | CHAT_WORDS
    vocab |= {"<eos>": EOS, "<pad>": PAD, "<mask>": MASK}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", mask_token="<mask>")
    fast.chat_template = template
    return fast


TOOL_CALL, TOOL_CALL_END = 50, 51  # Qwen3's <tool_call> and </tool_call> in `make_tool_call_tokenizer`


def make_tool_call_tokenizer() -> PreTrainedTokenizerFast:
    """The test tokenizer with Qwen3's tool-call markers as single tokens (in place of t50, t51) and a chat template
    that writes each tool call between them, so a completion's calls are told apart."""
    vocab = {f"t{i}": i for i in range(VOCAB - 3) if i not in (TOOL_CALL, TOOL_CALL_END)}
    vocab |= {"<tool_call>": TOOL_CALL, "</tool_call>": TOOL_CALL_END, "<eos>": EOS, "<pad>": PAD, "<mask>": MASK}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", mask_token="<mask>")
    fast.chat_template = (
        "{% for m in messages %}{{ m.role }} {{ m.content }} {% for c in m.tool_calls or [] %}<tool_call> "
        "{{ c.function.name }} </tool_call> {% endfor %}{% endfor %}{% if add_generation_prompt %}t9{% endif %}"
    )
    return fast


def save_chat_target(directory: Path, template: str = THINKING_TEMPLATE, engine: bool = False) -> Path:
    """A tiny Qwen3 target with a chat template (`make_chat_tokenizer`); `engine`: the one the CPU engine runs."""
    if engine:
        save_engine_target(directory)
    else:
        save_target(directory, "qwen3")
    make_chat_tokenizer(template).save_pretrained(directory)
    return directory


def make_hf_model(kind: str, seed: int = 0, num_layers: int = 4):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_position_embeddings=512,
    )
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "hybrid":
        layer_types = (["linear_attention", "full_attention"] * num_layers)[:num_layers]
        cfg = Qwen3_5TextConfig(
            **common,
            layer_types=layer_types,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
        )
        model = Qwen3_5ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # sharpen the random logits so greedy choices are far from ties; a zero EOS row keeps
    # EOS (logit 0) below the maximum, so random targets run to the length limit
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        model.get_output_embeddings().weight[EOS] = 0.0
    return model.float().eval()


def save_target(directory: Path, kind: str = "hybrid", seed: int = 0, num_layers: int = 4) -> Path:
    """A tiny random target saved as a user would have it: model and tokenizer in a directory."""
    directory.mkdir(parents=True, exist_ok=True)
    make_hf_model(kind, seed, num_layers).save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory


def write_word_prompts(path: Path, count: int, words: int = 8) -> Path:
    """A JSONL prompt file over the test vocabulary (ids p0, p1, ...)."""
    import json

    rows = [{"id": f"p{i}", "prompt": " ".join(f"t{(7 * i + 3 * k) % 60}" for k in range(words))} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`flashdraft ARGV` in-process: (exit code, stdout, stderr)."""
    from flashdraft.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # a failed check (doctor, eval --check-served) exits 1 this way
        rc = int(e.code)
    out, err = capsys.readouterr()
    return rc, out, err


def make_target(kind: str, seed: int = 0, num_layers: int = 4) -> TargetModel:
    return TargetModel(make_hf_model(kind, seed, num_layers), make_tokenizer(), path=None)


def make_flat_target(kind: str, seed: int = 3) -> TargetModel:
    """A target with a flat-ish next-token distribution and no stop token (for sampling laws)."""
    model = make_hf_model(kind, seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1 / 8 * 0.5)
    target = TargetModel(model, make_tokenizer(), path=None)
    target.model.generation_config.eos_token_id = []  # every run yields as many tokens as asked
    return target


@pytest.fixture(params=["qwen3", "hybrid", "llama"])
def any_target(request) -> TargetModel:
    return make_target(request.param)


@pytest.fixture
def hybrid_target() -> TargetModel:
    return make_target("hybrid")


def make_drafter_config(**overrides) -> DrafterConfig:
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        mask_token_id=MASK,
        block_size=8,
    )
    fields.update(overrides)
    return DrafterConfig(**fields)


def make_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    drafter = DFlashDrafter(make_drafter_config(**overrides))
    drafter.init_weights(seed)
    return drafter.eval()


def make_reduced_vocab_drafter(target_ids: list[int], seed: int = 0, **overrides) -> DFlashDrafter:
    """A drafter with its own LM head over `target_ids` (sorted target ids), d2t in vLLM's convention."""
    drafter = make_drafter(seed, draft_vocab_size=len(target_ids), **overrides)
    ids = torch.tensor(sorted(target_ids))
    drafter.d2t.copy_(ids - torch.arange(len(ids)))  # target id = i + d2t[i]
    return drafter


DFLASH2 = dict(family="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def make_dflash2_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    """A DFlash2 drafter whose convolutions and selector are not the neutral start (random, as if
    trained), so each changes what it drafts."""
    drafter = make_drafter(seed, **(DFLASH2 | overrides))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "base_kernel" in name else 0.5))
    return drafter


DSPARK = dict(family="dspark", markov_rank=8, confidence_head=True, confidence_head_with_markov=True, block_size=7)


def make_dspark_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    """A DSpark drafter whose Markov and confidence heads are not the neutral start (random, as if trained), so the
    Markov bias changes what it drafts and the confidence varies."""
    drafter = make_drafter(seed, **(DSPARK | overrides))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith(("markov_head.", "confidence_head.")):
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "markov" in name else 0.3))
    return drafter


# -- the serving engine's tests (`make test` makes its environment, .venv-engine) ------------------------------


def save_engine_target(directory: Path, seed: int = 0) -> Path:
    """A tiny dense Qwen3 target the CPU engine runs: head_dim 32 (vLLM's CPU attention takes 32 to 512)."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            eos_token_id=EOS,
            pad_token_id=PAD,
            max_position_embeddings=512,
        )
    )
    with torch.no_grad():  # sharp logits, no stop: greedy far from ties, every output max_new_tokens long
        model.get_output_embeddings().weight.mul_(8.0)
        model.get_output_embeddings().weight[EOS] = 0.0
    model.float().eval().save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def engine_models(tmp_path_factory) -> dict[str, Path]:
    """What the engine tests serve: the target, 8 prompts with greedy completions of 48 tokens, a drafter trained
    60 steps (mixed acceptance: τ about 3) and one trained 200 steps (near its data: τ about 7 greedy)."""
    from flashdraft.cli import main

    d = tmp_path_factory.mktemp("engine")
    target = save_engine_target(d / "target")
    prompts = write_word_prompts(d / "prompts.jsonl", 8)
    quiet = ["--target-model", str(target)]
    assert (
        main(["generate", *quiet, "--prompts", str(prompts), "--out", str(d / "greedy.json"), "--max-new-tokens", "48"])
        == 0
    )
    assert (
        main(
            [
                "init",
                *quiet,
                "--out",
                str(d / "init"),
                "--draft-layers",
                "1",
                "--target-layer-ids",
                "0,2",
                "--block-size",
                "8",
                "--head-dim",
                "32",
            ]
        )
        == 0
    )
    for name, steps in (("drafter", 60), ("overfit", 200)):
        assert (
            main(
                [
                    "train",
                    *quiet,
                    "--completions",
                    str(d / "greedy.json"),
                    "--out",
                    str(d / name),
                    "--init",
                    str(d / "init"),
                    "--epochs",
                    "1000",
                    "--max-steps",
                    str(steps),
                    "--lr",
                    "3e-3",
                ]
            )
            == 0
        )
    return {
        "target": target,
        "prompts": prompts,
        "completions": d / "greedy.json",
        "drafter": d / "drafter",
        "overfit": d / "overfit",
        "dir": d,
    }


@pytest.fixture(scope="session")
def overfit_server(engine_models, tmp_path_factory):
    """A running vLLM serving the target with the 200-step drafter (eval --server and bench --server read it)."""
    from flashdraft.cli import main
    from flashdraft.drafter.config import DrafterConfig
    from flashdraft.serving.checks import vllm_speculative_config
    from flashdraft.serving.engine import VllmServer, engine_info, engine_python

    d = tmp_path_factory.mktemp("served")
    assert (
        main(
            [
                "export",
                "--checkpoint",
                str(engine_models["overfit"]),
                "--out",
                str(d / "drafter"),
                "--target-model",
                str(engine_models["target"]),
            ]
        )
        == 0
    )
    python = engine_python()
    spec = vllm_speculative_config(DrafterConfig.load(d / "drafter" / "config.json"), str(d / "drafter"))
    with VllmServer(
        python, str(engine_models["target"]), d / "server.log", speculative_config=spec, info=engine_info(python)
    ) as server:
        yield server


@pytest.fixture(scope="session")
def baseline_server(engine_models, tmp_path_factory):
    """A running vLLM serving the target alone, with `overfit_server`'s other settings (bench --baseline-server)."""
    from flashdraft.serving.engine import VllmServer, engine_info, engine_python

    python = engine_python()
    with VllmServer(
        python,
        str(engine_models["target"]),
        tmp_path_factory.mktemp("baseline") / "server.log",
        info=engine_info(python),
    ) as server:
        yield server


@pytest.fixture(scope="session")
def engine_cache(engine_models, tmp_path_factory) -> dict:
    """`flashdraft cache --engine vllm` of `engine_models`' completions (layers 0, 2, the target's fp32, a quarter
    of the samples recomputed), run once for the session (each run starts the engine): its directory, exit code and
    what it printed on stdout and stderr (test_engine_capture checks the cache, test_engine_feed trains from it)."""
    import contextlib
    import io

    from flashdraft.cli import main

    m, out = engine_models, tmp_path_factory.mktemp("engine-cache") / "cache"
    argv = ["cache", "--target-model", m["target"], "--completions", m["completions"], "--layers", "0,2"]
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        rc = main([*argv, "--out", out, "--engine", "vllm", "--verify-share", "0.25"])
    return {"dir": out, "rc": rc, "out": printed.getvalue(), "err": errors.getvalue()}


# -- running the suite on every core (`make test`: pytest -n auto, pytest-xdist) --------------------------------------

ENGINE_FILES = {
    str(p.relative_to(Path(__file__).parent.parent))
    for p in Path(__file__).parent.rglob("test_*.py")
    if "@pytest.mark.engine" in p.read_text()
}


def pytest_xdist_make_scheduler(config, log):
    """The files with the engine's tests together on one worker, first (one vLLM server at a time, `engine_models`
    built once); every other test to whichever worker is free, in collection order (a module's fixtures are built at
    most once a worker). xdist's own loadgroup would group per test, but its marks do not reach pytest 9's node ids."""
    from xdist.scheduler import LoadScopeScheduling

    class EngineFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "engine" if nodeid.split("::", 1)[0] in ENGINE_FILES else nodeid

    return EngineFilesTogether(config, log)


if os.environ.get("PYTEST_XDIST_WORKER") and (os.cpu_count() or 1) > 1:
    # vLLM's CPU worker would spin OpenMP threads on every core, beside the other workers' tests: it gets one core
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str((os.cpu_count() or 1) - 1))


# -- flashdraft doctor: its runner and the files it checks (test_doctor.py, drafter/, train/) --


def doctor(capsys, *argv) -> tuple[int, str, str]:
    """`flashdraft doctor ARGV`: its exit code, stdout and stderr."""
    from flashdraft.cli import main

    try:
        rc = main(["doctor", *map(str, argv)])
    except SystemExit as e:  # problems found: exit 1
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def fail_lines(out: str) -> list[str]:
    lines = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert all("; fix: " in line for line in lines), lines  # every finding says what to do
    return lines


@pytest.fixture(scope="session")
def doctor_files(tmp_path_factory) -> dict[str, Path]:
    """A target, another target, and the completions, cache, run and drafter made from the first, as users make them."""
    import json

    from flashdraft.cli import main
    from flashdraft.drafter.checkpoint import save_drafter

    root = tmp_path_factory.mktemp("doctor")
    target, other = save_target(root / "target", "qwen3"), save_target(root / "other", "qwen3", seed=1)
    prompts = root / "p.jsonl"
    rows = [{"id": f"q{i}", "prompt": f"t{i} t{i + 3} t{i + 7}"} for i in range(4)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        main(
            [
                "generate",
                "--target-model",
                str(target),
                "--prompts",
                str(prompts),
                "--out",
                str(root / "c.json"),
                "--max-new-tokens",
                "10",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "cache",
                "--target-model",
                str(target),
                "--completions",
                str(root / "c.json"),
                "--out",
                str(root / "cache"),
                "--layers",
                "0,2",
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--target-model",
                str(target),
                "--cached-hidden-states",
                str(root / "cache"),
                "--out",
                str(root / "run"),
                "--max-steps",
                "2",
                "--batch-size",
                "2",
                "--num-anchors",
                "4",
                "--block-size",
                "4",
                "--draft-layers",
                "2",
                "--target-layer-ids",
                "0,2",
                "--save-every",
                "1",
            ]
        )
        == 0
    )
    save_drafter(make_drafter(), root / "drafter")  # layers [0, 2] of 4, block size 8
    return {
        "root": root,
        "target": target,
        "other": other,
        "completions": root / "c.json",
        "cache": root / "cache",
        "run": root / "run",
        "drafter": root / "drafter",
    }


@pytest.fixture(autouse=True)
def engine_support_read_only_in_engine_tests(request, monkeypatch):
    """`doctor --serving` reads the engine's support facts by running the engine (about 22 s the first time): a test
    not marked `engine` sees no engine there, and the doctor says it could not check."""
    if request.node.get_closest_marker("engine") is None:
        monkeypatch.setenv("FLASHDRAFT_ENGINE_PYTHON", str(Path(request.config.rootpath) / "no-engine" / "python"))
