import functools
import json
from pathlib import Path

import pytest

from flashdraft.decoding.generate import SpeculativeConfig, autoregressive_generate
from flashdraft.decoding.proposers import as_proposer
from flashdraft.decoding.tree import TreeRule, tree_generate
from flashdraft.drafter.checkpoint import save_drafter
from flashdraft.drafter.init import dflash2_from_drafter
from flashdraft.drafter.run_dir import load_any_drafter
from flashdraft.evaluation import trees
from flashdraft.evaluation.config import Candidate
from flashdraft.evaluation.offline import offline_acceptance_lengths
from flashdraft.evaluation.records import EvalRecord, FeatureSource, load_eval_records
from flashdraft.evaluation.trees import tree_walk
from flashdraft.target.model import TargetModel
from tests.conftest import make_dflash2_drafter, make_drafter, make_target, run_cli, save_target, write_word_prompts
from tests.evaluation.test_run import greedy_records, overfit

BLOCK = 8
TINY_DRAFTER = Path(__file__).parents[2] / "flashdraft" / "assets" / "tiny-drafter"


@pytest.fixture(scope="module")
def dense():
    """A dense target, its greedy records and drafters overfit on the first (they accept deep, not always)."""
    target = make_target("qwen3")
    records = greedy_records(target, 30)
    return (
        target,
        records,
        overfit(make_drafter(), target, records[0]),
        overfit(make_dflash2_drafter(), target, records[0]),
    )


def _walk(target, drafter, record, rule):
    features = FeatureSource(target)(record, drafter.config.target_layer_ids)
    return tree_walk(as_proposer(drafter, target), rule, record, BLOCK, features, target.device)


@pytest.mark.parametrize(
    "family, rule",
    [
        ("dflash", TreeRule("ddtree", 1)),
        ("dflash", TreeRule("ddtree", 6)),
        ("dflash", TreeRule("topk", 12, width=3)),
        ("dflash2", TreeRule("beam", 4, width=2)),
        ("dflash2", TreeRule("beam", 12, width=3)),
    ],
    ids=str,
)
def test_offline_tree_walk_equals_the_online_tree_loop_step_for_step(dense, family, rule):
    target, records, dflash, dflash2 = dense
    drafter = dflash if family == "dflash" else dflash2
    deep = 0
    for record in records:
        walk = _walk(target, drafter, record, rule)
        online = tree_generate(target, drafter, record.prompt_ids, len(record.completion_ids), rule)
        assert online.output_ids == record.completion_ids
        assert online.acceptance_lengths == walk.lengths and online.nodes_per_step == walk.nodes
        deep = max(deep, *walk.lengths)
    assert deep >= min(rule.budget + 1, 3)  # the drafters accept past their first draft


def test_on_the_built_in_target_the_offline_walk_equals_the_tree_loop_at_several_budgets():
    target = TargetModel.load("tiny")  # a Gated DeltaNet hybrid; the shipped drafter accepts on code
    dflash = load_any_drafter(TINY_DRAFTER, target).drafter
    dflash2, beam = dflash2_from_drafter(dflash), TreeRule("beam", 8, width=2)
    prompt = load_eval_records(target, prompts="builtin:code:heldout", num_prompts=1)[0][0].prompt_ids
    record = EvalRecord("code", prompt, autoregressive_generate(target, prompt, 24).output_ids)
    for drafter, rules in ((dflash, [TreeRule("ddtree", 4), TreeRule("ddtree", 16)]), (dflash2, [beam])):
        for rule in rules:
            features = FeatureSource(target)(record, drafter.config.target_layer_ids)
            walk = tree_walk(as_proposer(drafter, target), rule, record, 16, features, target.device)
            online = tree_generate(target, drafter, prompt, len(record.completion_ids), rule)
            assert online.output_ids == record.completion_ids
            assert online.acceptance_lengths == walk.lengths and max(walk.lengths) > 2


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_one_node_per_depth_is_the_chain_exactly(dense, family):
    target, records, dflash, dflash2 = dense
    drafter = dflash if family == "dflash" else dflash2
    rule = TreeRule("topk" if family == "dflash" else "beam", BLOCK - 1, width=1)
    for record in records:
        features = FeatureSource(target)(record, drafter.config.target_layer_ids)
        chain = offline_acceptance_lengths(
            as_proposer(drafter, target), record.prompt_ids, record.completion_ids, BLOCK, features=features
        )
        assert _walk(target, drafter, record, rule).lengths == chain


def test_a_larger_budget_never_walks_a_shorter_first_step(dense):
    target, records, dflash, _ = dense
    record = records[1]
    firsts = [_walk(target, dflash, record, TreeRule("ddtree", n)).lengths[0] for n in (1, 4, 16, 40)]
    assert firsts == sorted(firsts)  # DDTree's trees grow by adding nodes: a larger one holds every smaller one


def test_eval_tree_reports_tau_per_budget_and_the_best_budget(capsys, tmp_path, dense):
    save_drafter(dense[2], tmp_path / "d")  # trained on the records of this target's weights
    paths = {"--checkpoint": tmp_path / "d", "--target-model": save_target(tmp_path / "target", "qwen3")}
    paths |= {"--prompts": write_word_prompts(tmp_path / "prompts.jsonl", 2), "--json": tmp_path / "out.json"}
    options = "--tree ddtree --tree-budget 1,6 --check-consistency --max-new-tokens 20".split()
    rc, out, err = run_cli(capsys, "eval", *[x for pair in paths.items() for x in pair], *options)
    assert rc == 0, err
    trees = json.loads((tmp_path / "out.json").read_text())["trees"]
    assert [row["budget"] for row in trees["budgets"]] == [1, 6] and trees["best_budget"] in (1, 6)
    for row in trees["budgets"]:
        assert row["online"]["identical"] and row["online"]["lossless"]
        assert row["tau"] == pytest.approx(row["online"]["tau"]) and row["predicted_speedup"] > 0
        assert sum(row["histogram"]) == row["num_steps"] and row["nodes_per_step"] <= row["budget"]
    assert trees["budgets"][0]["histogram"][2:] == [0] * (BLOCK - 2)  # one node: at most 2 tokens a step
    assert trees["step_costs"]["budgets"]["6"]["nodes"] == 6 and "tree ddtree budget 6: tau" in out


def test_tree_options_that_cannot_go_together_are_refused(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "eval", "--drafter", "ngram", "--target-model", "tiny", "--tree-budget", "4")
    assert rc == 2 and "--tree-budget and --tree-width go with --tree" in err
    rc, _, err = run_cli(
        capsys, "eval", "--drafter", "ngram", "--target-model", "tiny", "--tree", "topk", "--tree-budget", "4"
    )
    assert rc == 2 and "--drafter" in err


def test_the_online_tree_check_with_compile_verifies_on_the_static_cache_and_reports_what_compiled(dense, monkeypatch):
    """`eval --tree --online --compile`: every record's tree loop on the static cache, lossless and equal to the
    offline walk, with the compile counts in the row (the static path uncompiled here: its graphs are proven in
    tests/decoding/test_static_tree.py)."""
    target, records, dflash, _ = dense
    rule = TreeRule("ddtree", 6)
    monkeypatch.setattr(trees, "SpeculativeConfig", functools.partial(SpeculativeConfig, compile_backend=None))
    walks = [_walk(target, dflash, record, rule) for record in records]
    greedy = [record.completion_ids for record in records]
    candidate = Candidate("d", dflash, BLOCK, "drafter directory", None)
    online = trees._online(candidate, target, records, rule, walks=walks, greedy=greedy, compile=True)
    assert online["lossless"] and online["identical"]
    assert online["compile"] == {"compiles": 0, "recompiles": 0, "graph_breaks": 0, "compile_seconds": 0.0} | {
        "static": True
    }
