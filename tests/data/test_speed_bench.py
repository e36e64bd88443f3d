"""SPEED-Bench read in both layouts (NeMo-Skills' jsonl, Model Optimizer's parquet): one request per row, its user
turns answered in order, its category and split carried; placeholder rows, a row without a category, a split or a
category not there refused in one line (exit 2)."""

import json

import pytest

from flashdraft.data.prompts import load_prompts
from flashdraft.data.speed_bench import FETCH_COMMAND, PLACEHOLDER
from flashdraft.errors import FlashdraftError
from tests.conftest import run_cli
from tests.data.speed_bench_files import speed_bench_rows, write_model_optimizer, write_nemo_skills


@pytest.fixture(scope="module")
def both_layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("speed")
    splits = {"qualitative": speed_bench_rows(), "throughput_1k": speed_bench_rows(("low_entropy", "high_entropy"))}
    return write_nemo_skills(root / "nemo", splits), write_model_optimizer(root / "modelopt", splits)


def test_both_layouts_read_as_the_same_requests_each_turn_in_order_with_its_category_and_split(both_layouts):
    nemo, modelopt = both_layouts
    a = load_prompts(f"speed-bench:{nemo}", quiet=True)
    b = load_prompts(f"speed-bench:{modelopt}:qualitative", quiet=True)
    rows = speed_bench_rows()
    assert [p.id for p in a] == [p.id for p in b] == [r["question_id"] for r in rows]
    assert [p.turns for p in a] == [p.turns for p in b] == [[m["content"] for m in r["messages"]] for r in rows]
    assert any(len(p.turns) == 2 for p in a) and any(len(p.turns) == 1 for p in a)
    assert {p.meta["category"] for p in a} == {"coding", "math", "writing"}
    assert all(p.meta["split"] == "qualitative" and p.meta["sub_category"].endswith("-sub") for p in a + b)
    # a later turn is asked after the target's own answer to the one before
    two = next(p for p in a if len(p.turns) == 2)
    assert [m["role"] for m in two.conversation(["my answer"])] == ["user", "assistant", "user"]
    # one split's file, and categories chosen
    throughput = load_prompts(f"speed-bench:{modelopt}/data/speed/throughput_1k/test.parquet", quiet=True)
    assert {p.meta["split"] for p in throughput} == {"throughput_1k"}
    assert {p.meta["category"] for p in throughput} == {"low_entropy", "high_entropy"}
    chosen = load_prompts(f"speed-bench:{nemo}:qualitative:math,writing", quiet=True)
    assert [p.meta["category"] for p in chosen] == ["math", "math", "writing", "writing"]
    assert load_prompts(f"speed-bench:{nemo}/throughput_1k.jsonl", quiet=True)[0].meta["split"] == "throughput_1k"


def test_placeholder_rows_are_refused_with_their_count_and_the_command_that_fetches_them(tmp_path, capsys):
    root = write_nemo_skills(tmp_path, {"qualitative": speed_bench_rows(placeholders=2)})
    with pytest.raises(FlashdraftError, match=f"2 of 6 rows hold the placeholder {PLACEHOLDER!r}") as e:
        load_prompts(f"speed-bench:{root}", quiet=True)
    assert FETCH_COMMAND in str(e.value) and "\n" not in str(e.value)
    status, _, err = run_cli(
        capsys,
        "generate",
        "--target-model",
        "tiny",
        "--prompts",
        f"speed-bench:{root}",
        "--out",
        str(tmp_path / "c.jsonl"),
    )
    assert status == 2 and err.count("\n") == 1 and "2 of 6 rows hold the placeholder" in err


def test_a_row_without_category_a_missing_split_or_category_each_exit_2_in_one_line(tmp_path, capsys):
    rows = speed_bench_rows()
    del rows[3]["category"]
    nemo = write_nemo_skills(tmp_path / "a", {"qualitative": rows})
    good = write_nemo_skills(tmp_path / "b", {"qualitative": speed_bench_rows()})
    cases = {
        f"speed-bench:{nemo}": "qualitative.jsonl:4: field 'category' is None; expected a SPEED-Bench category",
        f"speed-bench:{good}:throughput_8k": "no split 'throughput_8k' in",
        f"speed-bench:{good}:qualitative:poetry": "no category 'poetry' in",
        f"speed-bench:{tmp_path / 'none'}": "no such file or directory",
    }
    for spec, message in cases.items():
        argv = ["generate", "--target-model", "tiny", "--prompts", spec, "--out", str(tmp_path / "c.jsonl")]
        status, _, err = run_cli(capsys, *argv)
        assert status == 2 and message in err and err.count("\n") == 1, (spec, err)
    assert "found qualitative" in str(pytest.raises(FlashdraftError, load_prompts, f"speed-bench:{good}:mixed").value)


def test_generate_answers_every_turn_of_a_request_after_its_own_answer(tmp_path, capsys):
    root = write_nemo_skills(tmp_path / "d", {"qualitative": speed_bench_rows(("math",), per_category=2)})
    out = tmp_path / "c.json"
    argv = [
        "generate",
        "--target-model",
        "tiny",
        "--prompts",
        f"speed-bench:{root}",
        "--out",
        str(out),
        "--max-new-tokens",
        "4",
    ]
    assert run_cli(capsys, *argv)[0] == 0
    ids = [r["id"] for r in json.loads(out.read_text())["records"]]
    first, second = speed_bench_rows(("math",), per_category=2)
    assert ids == [first["question_id"], f"{second['question_id']}/turn1", f"{second['question_id']}/turn2"]


def test_a_split_without_categories_is_one_spec_per_category_for_bench(both_layouts):
    from flashdraft.data.speed_bench import per_category_specs

    nemo, modelopt = both_layouts
    specs = per_category_specs(f"speed-bench:{modelopt}:throughput_1k")
    assert specs == [f"speed-bench:{modelopt}:throughput_1k:{t}" for t in ("high_entropy", "low_entropy")]
    assert [len(load_prompts(s, quiet=True)) for s in specs] == [2, 2]
    one_file = per_category_specs(f"speed-bench:{nemo}/qualitative.jsonl")
    assert one_file == [f"speed-bench:{nemo}/qualitative.jsonl::{c}" for c in ("coding", "math", "writing")]
    assert per_category_specs(f"speed-bench:{nemo}::math") == [f"speed-bench:{nemo}::math"]
