"""The chat mode through training and evaluation, on the Qwen3-style thinking template of the tests: the loss covers
the target's own tokens only (never the empty think block a non-thinking template writes), the drafter records the
mode mix it was trained on, `eval` reports τ by segment and the mode and warns when the mode differs from the trained
one, and `doctor --serving` and the export README state the trained mode with the server settings that serve it."""

from __future__ import annotations

import json

import pytest

from flashdraft.evaluation.modes import by_segment
from flashdraft.evaluation.records import EvalRecord
from flashdraft.evaluation.results import EvalResult, PromptResult
from tests.conftest import CHAT_WORDS, make_chat_tokenizer, run_cli, save_chat_target

THINK, END = CHAT_WORDS["<think>"], CHAT_WORDS["</think>"]


def test_tau_by_segment_counts_each_step_in_the_segment_of_its_first_token():
    # a thinking record: reasoning is completion tokens 0..3 (the </think> at 3), the answer 4..9
    record = EvalRecord("r", [1, THINK], [5, 6, 7, END, 8, 9, 10, 11, 12, 13])
    result = EvalResult("offline", 4, [0, 2], 2, [PromptResult("r", [3, 2, 4, 1], prompt_length=2)])
    segments = by_segment(result, [record], make_chat_tokenizer())
    # steps start at tokens 0, 3 (reasoning) and 5, 9 (answer)
    assert segments["reasoning"] == {"tau": 2.5, "steps": 2, "tokens": 5, "token_share": 0.5}
    assert segments["answer"] == {"tau": 2.5, "steps": 2, "tokens": 5, "token_share": 0.5}
    off = EvalRecord("r", [1, THINK, END], list(range(5, 15)))  # thinking off: every token is answer
    segments = by_segment(result, [off], make_chat_tokenizer())
    assert segments["answer"] == {"tau": 2.5, "steps": 4, "tokens": 10, "token_share": 1.0}
    assert segments["reasoning"]["tokens"] == 0
    plain = EvalRecord("r", [1, 2], list(range(5, 15)))  # no thinking template in the prompt: not segmented
    assert by_segment(result, [plain], make_chat_tokenizer()) is None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A drafter trained online on non-thinking completions of the chat target."""
    d = tmp_path_factory.mktemp("modes")
    target = save_chat_target(d / "target")
    (d / "p.jsonl").write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"t{i} t{i + 3} t{i + 7}"}) + "\n" for i in range(4))
    )
    from flashdraft.cli import main

    common = ["--target-model", str(target)]
    assert (
        main(
            [
                "generate",
                *common,
                "--prompts",
                str(d / "p.jsonl"),
                "--out",
                str(d / "off.json"),
                "--max-new-tokens",
                "16",
                "--disable-thinking",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                *common,
                "--completions",
                str(d / "off.json"),
                "--out",
                str(d / "run"),
                "--draft-layers",
                "1",
                "--block-size",
                "4",
                "--target-layer-ids",
                "0,2",
                "--batch-size",
                "2",
                "--max-steps",
                "2",
                "--num-anchors",
                "4",
            ]
        )
        == 0
    )
    return d, target


def test_the_loss_covers_the_targets_own_tokens_never_the_think_block_the_template_wrote(trained):
    from flashdraft.target.model import TargetModel
    from flashdraft.train.run import load_training_records

    d, target = trained
    records, _ = load_training_records(TargetModel.load(str(target)), [0, 2], None, str(d / "off.json"))
    rows = json.loads((d / "off.json").read_text())["records"]
    for sequence, row in zip(records.records, rows, strict=True):
        prompt = len(row["prompt_ids"])
        assert row["prompt_ids"][-2:] == [THINK, END]  # the template's empty think block ends the prompt
        assert not sequence.loss_mask[:prompt].any() and sequence.loss_mask[prompt:].all()
        assert int(sequence.loss_mask.sum()) == len(row["completion_ids"])


def test_eval_in_another_mode_than_trained_warns_and_reports_tau_by_segment(capsys, trained, tmp_path):
    d, target = trained
    config = json.loads(next((d / "run").glob("checkpoints/*/drafter/config.json")).read_text())
    assert config["trained_chat_mode"]["records_per_kwargs"] == [
        {"chat_template_kwargs": {"enable_thinking": False}, "records": 4}
    ]
    rc, out, err = run_cli(
        capsys,
        "eval",
        "--checkpoint",
        d / "run",
        "--target-model",
        target,
        "--prompts",
        d / "p.jsonl",
        "--enable-thinking",
        "--max-new-tokens",
        "12",
        "--json",
        tmp_path / "e.json",
    )
    assert rc == 0, err
    summary = json.loads((tmp_path / "e.json").read_text())
    assert summary["chat_mode"]["records_per_kwargs"] == [
        {"chat_template_kwargs": {"enable_thinking": True}, "records": 4}
    ]
    assert "warning: evaluated in another chat mode than the drafter was trained on" in out
    segments = summary["by_segment"]  # thinking on: every completion starts in its reasoning
    assert segments["reasoning"]["steps"] > 0
    assert segments["reasoning"]["steps"] + segments["answer"]["steps"] == summary["num_steps"]
    assert "by segment: reasoning τ" in out
    rc, out, _ = run_cli(
        capsys,
        "eval",
        "--checkpoint",
        d / "run",
        "--target-model",
        target,
        "--prompts",
        d / "p.jsonl",
        "--disable-thinking",
        "--max-new-tokens",
        "12",
    )
    assert rc == 0 and "another chat mode" not in out


def test_doctor_and_the_export_readme_state_the_trained_mode_and_its_server_settings(capsys, trained, tmp_path):
    d, target = trained
    rc, out, _ = run_cli(capsys, "export", "--checkpoint", d / "run", "--out", tmp_path / "x", "--target-model", target)
    assert rc == 0
    readme = (tmp_path / "x" / "README.md").read_text()
    setting = "--default-chat-template-kwargs '{\"enable_thinking\": false}'"
    assert "## Chat mode" in readme and setting in readme
    rc, out, _ = run_cli(capsys, "doctor", tmp_path / "x", "--serving", "--target-model", target)
    assert 'chat mode trained for: {"enable_thinking": false}: 4 records' in out and setting in out


def test_tau_by_segment_tells_tool_calls_apart_where_the_template_marks_them_and_says_so_where_not():
    from tests.data.test_reasoning import characters_tokenizer, ids_of

    tok = characters_tokenizer("{{ messages }}<tool_call>")
    completion = ids_of(tok, "ab<tool_call>x</tool_call>cd")  # tokens 2..25 are the call
    record = EvalRecord("r", ids_of(tok, "hi"), completion, tools=[{"type": "function"}])
    lengths = [2, 13, 11, 2]  # steps start at tokens 0 (answer), 2 and 15 (tool call), 26 (answer)
    result = EvalResult("offline", 16, [0], 1, [PromptResult("r", lengths, prompt_length=2)])
    segments = by_segment(result, [record], tok)
    assert segments["tool_call"]["steps"] == 2 and segments["tool_call"]["tokens"] == 24
    assert segments["answer"]["steps"] == 2 and segments["reasoning"]["steps"] == 0
    unmarked = characters_tokenizer("{% if enable_thinking %}<think>{% endif %}{{ messages }}")
    thinking = EvalRecord("r", ids_of(unmarked, "hi<think>"), ids_of(unmarked, "ab</think>cd"), tools=[{}])
    short = EvalResult("offline", 16, [0], 1, [PromptResult("r", [4, 4, 4], prompt_length=9)])
    figures = by_segment(short, [thinking], unmarked)
    assert "tool_call" not in figures and "markers are unknown" in figures["tool_call_note"]


def test_eval_json_reports_a_tool_call_segment_on_completions_that_call_tools(capsys, tmp_path):
    """End to end: completions of an agent step whose target writes Qwen3's <tool_call> words (single tokens of its
    tokenizer) give `by_segment.tool_call` in `eval --json`, every step counted in one segment."""
    from flashdraft.target.model import TargetModel
    from tests.conftest import EOS, make_tool_call_tokenizer, save_target

    target = save_target(tmp_path / "target", "qwen3")
    tok = make_tool_call_tokenizer()
    tok.save_pretrained(target)
    prompt_ids = [1, 2, 9]
    completions = [[3, 50, 4, 5, 6, 51, 7, 8, EOS], [50, 4, 51, 5, 6, 7, 8, 10, 11, 12, EOS]]
    records = [
        {
            "id": f"a/step{k + 1}",
            "prompt": "t1 t2 t9",
            "prompt_ids": prompt_ids,
            "completion_ids": ids,
            "completion": tok.decode(ids, skip_special_tokens=True),
            "stop_reason": "eos",
            "messages": [{"role": "user", "content": "t1 t2"}],
            "chat_template_kwargs": {},
            "tools": [{"type": "function", "function": {"name": "grep"}}],
        }
        for k, ids in enumerate(completions)
    ]
    loaded = TargetModel.load(str(target))
    header = {"format": "flashdraft.completions", "version": 1, "generation": {"prompts": "p", "chat_template": True}}
    header["target"] = {"fingerprint": loaded.fingerprint(), "vocab_size": loaded.vocab_size, "path": str(target)}
    (tmp_path / "c.json").write_text(json.dumps(header | {"records": records}))
    init = ["init", "--target-model", target, "--out", tmp_path / "drafter", "--draft-layers", "1"]
    assert run_cli(capsys, *init, "--block-size", "4", "--target-layer-ids", "0,2")[0] == 0
    rc, out, err = run_cli(
        capsys,
        "eval",
        "--checkpoint",
        tmp_path / "drafter",
        "--target-model",
        target,
        "--completions",
        tmp_path / "c.json",
        "--json",
        tmp_path / "e.json",
    )
    assert rc == 0, err
    summary = json.loads((tmp_path / "e.json").read_text())
    segments = summary["by_segment"]
    assert segments["tool_call"]["steps"] > 0 and "by segment: " in out and "tool_call τ" in out
    assert sum(s["steps"] for s in segments.values()) == summary["num_steps"]
