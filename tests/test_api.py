"""The Python API (`flashdraft.api`, re-exported by `flashdraft`): documented, light to import,
the same figures and checks as the commands, and the README's example runs."""

from __future__ import annotations

import json
import pydoc
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashdraft
from flashdraft import Drafter, FlashdraftError, Target, TrainConfig
from flashdraft.drafter.checkpoint import save_drafter
from tests.conftest import make_drafter, run_cli, save_target, write_word_prompts

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small random target, a drafter for it, its completions of 3 prompts and their cache."""
    d = tmp_path_factory.mktemp("api")
    save_target(d / "target", "hybrid")
    save_drafter(make_drafter(block_size=4), d / "drafter")
    write_word_prompts(d / "prompts.jsonl", 3)
    flashdraft.generate_completions(d / "target", str(d / "prompts.jsonl"), d / "c.json", max_new_tokens=12)
    flashdraft.cache_hidden_states(d / "target", d / "c.json", d / "cache", layers=[0, 2], dtype="fp32")
    return d


def test_every_api_name_exists_is_documented_and_help_lists_it():
    text = pydoc.render_doc(flashdraft, renderer=pydoc.plaintext)
    for name in flashdraft.__all__:
        obj = getattr(flashdraft, name)
        doc = obj.__doc__ or ""
        assert doc.strip() and not doc.startswith(f"{name}("), name  # a real docstring, not a dataclass signature
        listed = f"class {name}(" if isinstance(obj, type) else f"    {name}("
        assert listed in text, name


def test_import_flashdraft_loads_neither_torch_nor_transformers():
    # the API names load on first use, so `flashdraft --help` and parse errors stay fast
    code = "import sys, flashdraft; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert found.stdout.strip() == "[]", found.stdout


def readme_python_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the README's Python API section holds one python block"
    return blocks[0]


def test_readme_python_example_runs_on_tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example writes api-run/ where it runs
    exec(compile(readme_python_example(), "README.md (Python API)", "exec"), {})
    assert (tmp_path / "api-run" / "run" / "run_config.json").is_file()


def test_drafter_generate_is_lossless_and_its_acceptance_lengths_add_up(files):
    target = Target.from_pretrained(files / "target")
    drafter = Drafter.from_pretrained(files / "drafter", target)
    assert drafter.form == "drafter directory" and drafter.config.block_size == 4
    out = drafter.generate(target, "t1 t2 t3 t4", max_new_tokens=20)
    assert out.output_ids == target.generate("t1 t2 t3 t4", max_new_tokens=20).output_ids
    assert sum(out.acceptance_lengths) == len(out.output_ids) - 1 and max(out.acceptance_lengths) <= 4
    assert out.tau == sum(out.acceptance_lengths) / len(out.acceptance_lengths)


def test_a_drafter_on_another_dtype_than_the_target_is_refused_naming_both(files):
    target = Target.from_pretrained(files / "target")
    drafter = Drafter.from_pretrained(files / "drafter", dtype=torch.bfloat16)
    with pytest.raises(FlashdraftError, match=r"drafter is on cpu in torch.bfloat16, the target on cpu in torch.fl"):
        drafter.generate(target, [1, 2, 3], max_new_tokens=4)


@pytest.mark.parametrize("loaded", [False, True], ids=["by path", "loaded objects"])
def test_evaluate_drafter_returns_what_eval_json_writes(files, tmp_path, capsys, loaded):
    rc, _, err = run_cli(
        capsys,
        "eval",
        "--checkpoint",
        files / "drafter",
        "--target-model",
        files / "target",
        "--cached-hidden-states",
        files / "cache",
        "--max-blocks",
        4,
        "--json",
        tmp_path / "e.json",
    )
    assert rc == 0, err
    target, drafter = files / "target", files / "drafter"
    if loaded:
        target = Target.from_pretrained(target)
        drafter = Drafter.from_pretrained(drafter, target)
    summary = flashdraft.evaluate_drafter(drafter, target, cached_hidden_states=str(files / "cache"), max_blocks=4)
    assert summary == json.loads((tmp_path / "e.json").read_text())


def test_train_drafter_trains_a_loadable_drafter_and_leaves_the_config_as_it_was(files, tmp_path):
    config = TrainConfig(max_steps=2, batch_size=2, num_anchors=4, log_every=1)
    checkpoint = flashdraft.train_drafter(
        config,
        files / "target",
        tmp_path / "run",
        completions=str(files / "c.json"),
        block_size=4,
        target_layer_ids=[0, 2],
    )
    assert config == TrainConfig(max_steps=2, batch_size=2, num_anchors=4, log_every=1)
    trained = Drafter.from_pretrained(checkpoint)
    assert trained.form == "training checkpoint" and trained.config.target_layer_ids == [0, 2]
    assert Drafter.from_pretrained(tmp_path / "run").path == trained.path  # the run: its newest checkpoint


def test_drafter_generate_applies_the_requests_filters_top_k_1_sampling_is_greedy(files):
    # top-k 1 leaves the target one token at each position: sampling at T 1 must then give greedy's tokens
    target = Target.from_pretrained(files / "target")
    drafter = Drafter.from_pretrained(files / "drafter", target)
    greedy = target.generate("t1 t2 t3", max_new_tokens=16).output_ids
    assert target.generate("t1 t2 t3", max_new_tokens=16, temperature=1.0, seed=3, top_k=1).output_ids == greedy
    for rule in ("vllm", "vllm-probabilistic"):
        out = drafter.generate(
            target, "t1 t2 t3", max_new_tokens=16, temperature=1.0, seed=3, top_k=1, serving_rule=rule
        )
        assert out.output_ids == greedy, rule
    unfiltered = [
        drafter.generate(target, "t1 t2 t3", max_new_tokens=16, temperature=1.0, seed=s).output_ids for s in range(3)
    ]
    assert any(ids != greedy for ids in unfiltered)  # without the filter T 1 samples something else


def test_drafter_generate_refuses_a_filter_the_rules_server_does_not_apply_and_an_unknown_rule(files):
    target = Target.from_pretrained(files / "target")
    drafter = Drafter.from_pretrained(files / "drafter", target)
    with pytest.raises(FlashdraftError, match=r"--min-p 0.1: SGLang .* does not apply min_p"):
        drafter.generate(target, [1, 2, 3], max_new_tokens=4, temperature=1.0, min_p=0.1, serving_rule="sglang")
    with pytest.raises(FlashdraftError, match=r"--serving-rule 'vllm-greedy': expected one of"):
        drafter.generate(target, [1, 2, 3], max_new_tokens=4, temperature=1.0, serving_rule="vllm-greedy")


def test_drafter_generate_verifies_at_most_num_speculative_tokens_per_step_and_stays_lossless():
    target = Target.from_pretrained("tiny")
    drafter = Drafter.from_pretrained("tiny-drafter", target)
    prompt = "def add(a, b):"
    unlimited = drafter.generate(target, prompt, max_new_tokens=32)
    assert max(unlimited.acceptance_lengths) > 2  # the shipped drafter gets several drafts accepted in a step
    out = drafter.generate(target, prompt, max_new_tokens=32, num_speculative_tokens=1)
    assert out.output_ids == unlimited.output_ids == target.generate(prompt, max_new_tokens=32).output_ids
    assert max(out.acceptance_lengths) <= 2
