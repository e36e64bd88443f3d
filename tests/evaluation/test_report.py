import json
import re

from flashdraft.evaluation.report import PLOTS, format_summary, write_report
from flashdraft.evaluation.results import EvalResult, PromptResult, difference, expected_tau_figures

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def summary(online: bool = False, reference: bool = False) -> dict:
    mode = "online" if online else "offline"
    prompts = [
        PromptResult("a", [1, 4, 2], [1, 2, 3, 4, 5, 6, 7, 8], True if online else None),
        PromptResult("b", [3, 1], [1, 2, 3, 4, 5], True if online else None),
    ]
    result = EvalResult(mode, 4, [0, 2], 2, prompts, 0.0, 30.0 if online else None, 10.0 if online else None)
    if online:  # 8 ms per step for τ 2.2 tokens that plain decoding makes in 22 ms: bound 2.75x
        result.draft_ms, result.verify_ms, result.greedy_step_ms, result.speedup_bound = 2.0, 6.0, 10.0, 2.75
    s = result.to_json() | {"checkpoint": "run/d", "target": "tiny", "records_source": "test", "max_blocks": 15}
    if reference:
        ref = EvalResult(
            mode,
            8,
            [1],
            1,
            [PromptResult("a", [1, 1, 1]), PromptResult("b", [2, 8])],
            0.0,
            20.0 if online else None,
            10.0 if online else None,
        ).to_json()
        s |= {"reference": ref | {"checkpoint": "ref"}, "difference": difference(s, ref)}
    return s


def test_report_writes_markdown_and_every_plot(tmp_path):
    path = write_report(summary(), tmp_path / "report")
    text = path.read_text()
    assert path.name == "report.md"
    for name in PLOTS.values():
        assert (tmp_path / "report" / name).read_bytes().startswith(PNG_MAGIC)
        assert f"]({name})" in text
    assert "| τ (pooled) | 2.200 |" in text and "| steps committing 4 | 1 |" in text
    assert "| a | 3 | 2.333 |" in text


def test_report_with_a_reference_shows_both_and_the_difference(tmp_path):
    s = summary(online=True, reference=True)
    text = write_report(s, tmp_path).read_text()
    assert "| τ (pooled) | 2.200 | 2.600 | -0.400 |" in text
    assert "| speed-up | 3.000 | 2.000 | +1.000 |" in text
    assert "| speed-up bound | 2.750 | - | - |" in text and "| speed-up / bound | 1.091 | - | - |" in text
    assert "| t(verify) ms per step | 6.000 | - | - |" in text
    assert "| steps committing 8 | - | 1 | -1 |" in text  # block sizes 4 and 8 side by side
    assert "| a | 3 | 2.333 | yes | 3 | 1.000 | +1.333 |" in text
    assert all((tmp_path / name).stat().st_size > 0 for name in PLOTS.values())


def test_terminal_summary_lists_every_figure_and_prompt():
    text = format_summary(summary(online=True, reference=True))
    for figure in [
        "steps",
        "τ (pooled)",
        "τ (mean of prompts)",
        "lossless",
        "speed-up",
        "steps committing 4",
        "draft 3 accepted",
        "ref τ",
    ]:
        assert figure in text, figure
    assert "\nb " in text


def test_summary_and_report_name_the_sampling_rule_and_show_expected_tau_at_a_temperature(tmp_path):
    prompts = [
        PromptResult("a", [1, 4, 2], expected_lengths=[1.5, 3.0, 2.0]),
        PromptResult("b", [3, 1], expected_lengths=[2.5, 1.0]),
    ]
    result = EvalResult("offline", 4, [0, 2], 2, prompts, 0.6)
    s = (
        result.to_json()
        | expected_tau_figures(result)
        | {
            "checkpoint": "d",
            "serving_rule": "sglang",
            "sampling": {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": None},
        }
    )
    text = format_summary(s)
    assert "sampled at temperature 0.6, top-k 20, top-p 0.95, under the sglang serving rule" in text
    assert re.search(r"expected τ given the drafts +2.000\n  its standard error +0.200", text)
    report = write_report(s, tmp_path).read_text()
    assert "| expected τ given the drafts | 2.000 |" in report and "under the sglang serving rule" in report
    greedy = summary()
    assert "greedy decoding" in format_summary(greedy) and "expected τ" not in format_summary(greedy)


def test_report_can_be_rebuilt_from_the_saved_json(tmp_path):
    s = summary(reference=True)
    (tmp_path / "out.json").write_text(json.dumps(s))
    assert (
        write_report(json.loads((tmp_path / "out.json").read_text()), tmp_path / "r").read_text()
        == write_report(s, tmp_path / "r2").read_text()
    )


def test_report_and_summary_show_tau_by_context_for_drafter_and_reference(tmp_path):
    s = summary(reference=True)  # empty prompts: contexts 0, 1, 5 (a) and 0, 3 (b) fall in [0, 2), [2, 4), [4, 8)
    text = write_report(s, tmp_path).read_text()
    assert "## By context length" in text and "| 0-2 | 3 | 2.667 | 0.667 | 0.667 | 0.333 | 1.333 |" in text
    assert "by context length" in format_summary(s) and "ref τ" in format_summary(s)
