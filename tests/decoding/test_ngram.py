import json

import pytest
import torch

from flashdraft.decoding.generate import SpeculativeConfig, autoregressive_generate, speculative_generate
from flashdraft.decoding.ngram import NGramProposer, lookup
from flashdraft.decoding.serving_rules import SamplingParams
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.offline import WalkConfig, evaluate_offline
from flashdraft.evaluation.records import EvalRecord
from flashdraft.evaluation.run import records_from_prompts
from tests.conftest import VOCAB, make_drafter, make_target, run_cli, save_target, write_word_prompts

# the second prompt repeats itself, so prompt lookup has something to find from the start
PROMPTS = [[5, 9, 17, 3, 22, 40, 11, 8, 30, 2, 14, 27], [1, 2, 3, 1, 2, 3, 1, 2], [44, 12, 7, 33, 19, 50, 8, 21]]


def greedy_records(target, max_new_tokens: int = 48) -> list[EvalRecord]:
    return records_from_prompts(target, [(f"r{i}", p) for i, p in enumerate(PROMPTS)], max_new_tokens)


# -- the lookup -----------------------------------------------------------------------------


def test_longest_suffix_match_wins_over_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]  # [2, 3] last occurred before 8; [1, 2, 3] before 9
    assert lookup(tokens, 3) == [9, 5, 2]
    assert lookup(tokens, 3, max_ngram=2) == [8, 1, 2]  # without 3-grams, the most recent 2-gram


def test_most_recent_of_equally_long_matches_wins():
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert lookup(tokens, 2) == [8, 1]


def test_copy_continues_through_copied_tokens_when_the_match_is_near_the_end():
    assert lookup([4, 5, 6, 4, 5, 6], 7) == [4, 5, 6, 4, 5, 6, 4]
    assert lookup([1, 2, 7, 1, 2, 8, 1, 2], 5) == [8, 1, 2, 8, 1]
    assert lookup([7, 7, 7], 4) == [7, 7, 7, 7]  # overlapping occurrences count


def test_no_match_or_only_shorter_matches_than_the_minimum():
    assert lookup([1, 2, 3, 4], 3) is None  # 4 never occurred before
    assert lookup([1, 2, 3], 3) is None  # a single token: nothing before it
    assert lookup([5, 1, 6, 1], 2) == [6, 1]
    assert lookup([5, 1, 6, 1], 2, min_ngram=2) is None  # only the 1-gram [1] recurs
    assert lookup([5, 1, 6, 5, 1], 2, min_ngram=2) == [6, 5]


def test_proposer_returns_one_hot_logits_and_no_drafts_without_a_match():
    proposer = NGramProposer(VOCAB)
    positions = torch.arange(3)[None]
    logits = proposer.propose([1, 2, 3, 1, 2], 4, None, positions, block=5)
    assert logits.shape == (4, VOCAB) and logits.argmax(-1).tolist() == [3, 1, 2, 3]
    assert torch.equal(torch.softmax(logits, -1), torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())
    assert proposer.propose([1, 2, 3, 4], 3, None, positions, block=4).shape == (0, VOCAB)  # a plain greedy step
    assert proposer.context_layer_ids == []


def test_impossible_ngram_range_is_refused():
    with pytest.raises(FlashdraftError, match="expected 1 <= min <= max"):
        NGramProposer(VOCAB, max_ngram=2, min_ngram=3)


# -- decoding and the offline walk ----------------------------------------------------------


@pytest.mark.parametrize("block", [4, 16])
def test_greedy_speculative_decoding_with_ngram_is_lossless(any_target, block):
    proposer = NGramProposer(any_target.vocab_size)
    taus = []
    for prompt in PROMPTS:
        plain = autoregressive_generate(any_target, prompt, 48)
        spec = speculative_generate(any_target, proposer, prompt, 48, speculative=SpeculativeConfig(block_size=block))
        assert spec.output_ids == plain.output_ids
        assert sum(spec.acceptance_lengths) == len(spec.output_ids) - 1 and max(spec.acceptance_lengths) <= block
        taus.append(spec.tau)
    assert max(taus) > 1.5  # random targets fall into loops: the lookup must find them


def test_target_computes_no_features_for_an_empty_layer_list(hybrid_target):
    hybrid_target.set_context_layers([])
    out = hybrid_target.forward(torch.tensor([PROMPTS[0]]), hybrid_target.new_cache())
    assert out.context_features is None and out.logits.shape == (1, len(PROMPTS[0]), VOCAB)


@pytest.mark.parametrize("kind", ["qwen3", "hybrid", "llama"])
@pytest.mark.parametrize("block", [4, 16])
def test_offline_tau_equals_online_tau_for_ngram(kind, block):
    target = make_target(kind)
    proposer = NGramProposer(target.vocab_size)
    records = greedy_records(target)
    offline = evaluate_offline(proposer, target, records, walk=WalkConfig(block_size=block))
    online = [
        speculative_generate(
            target, proposer, r.prompt_ids, len(r.completion_ids), speculative=SpeculativeConfig(block_size=block)
        )
        for r in records
    ]
    assert [o.output_ids for o in online] == [r.completion_ids for r in records]
    assert [p.acceptance_lengths for p in offline.per_prompt] == [o.acceptance_lengths for o in online]
    assert offline.tau > 1.5 and offline.context_layers is None and offline.target_layer_ids == []


def test_offline_ngram_walk_honours_max_blocks():
    target = make_target("qwen3")
    proposer = NGramProposer(target.vocab_size)
    records = greedy_records(target)
    full = evaluate_offline(proposer, target, records, walk=WalkConfig(block_size=8))
    cut = evaluate_offline(proposer, target, records, walk=WalkConfig(block_size=8, max_blocks=3))
    assert [p.acceptance_lengths for p in cut.per_prompt] == [p.acceptance_lengths[:3] for p in full.per_prompt]


def test_sampling_with_ngram_one_hot_drafts():
    # q is exactly one-hot (-inf elsewhere): the accept/resample rule must stay finite and accept
    target = make_target("llama")
    lengths = []
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        out = speculative_generate(
            target,
            NGramProposer(VOCAB),
            PROMPTS[1],
            40,
            sampling=SamplingParams(temperature=0.3),
            speculative=SpeculativeConfig(block_size=8),
            generator=gen,
        )
        assert sum(out.acceptance_lengths) == len(out.output_ids) - 1
        assert all(0 <= t < VOCAB for t in out.output_ids)
        lengths += out.acceptance_lengths
    assert max(lengths) > 1


# -- the eval command ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("target"), "qwen3")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_word_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", 4)


JSON_KEYS = {
    "tau",
    "tau_prompt_mean",
    "histogram",
    "position_acceptance",
    "num_steps",
    "mode",
    "context_layers",
    "per_prompt",
    "lossless",
    "speedup",
    "checkpoint",
    "drafter_type",
}


def test_eval_ngram_offline_and_online_json(capsys, tmp_path, target_dir, prompts_file):
    common = [
        "eval",
        "--drafter",
        "ngram",
        "--target-model",
        target_dir,
        "--prompts",
        prompts_file,
        "--max-new-tokens",
        40,
    ]
    rc, out, err = run_cli(capsys, *common, "--json", tmp_path / "off.json", "--report", tmp_path / "report")
    assert rc == 0, err
    off = json.loads((tmp_path / "off.json").read_text())
    assert JSON_KEYS <= set(off) and off["mode"] == "offline" and off["drafter_type"] == "ngram"
    assert off["context_layers"] is None and off["target_layer_ids"] == [] and off["drafter_path"] is None
    assert off["block_size"] == 16 and len(off["histogram"]) == 16 and off["num_prompts"] == 4
    assert off["tau"] > 1 and off["target_forwards_offline"] == 0
    assert "no context features" in out and "no context features" in (tmp_path / "report" / "report.md").read_text()
    rc, out, err = run_cli(capsys, *common, "--online", "--check-consistency", "--json", tmp_path / "on.json")
    assert rc == 0, err
    on = json.loads((tmp_path / "on.json").read_text())
    assert on["mode"] == "online" and on["lossless"] is True and on["speedup"] > 0
    assert on["consistency"]["identical"] and on["consistency"]["offline_tau"] == on["consistency"]["online_tau"]
    assert on["consistency"]["offline_tau"] == off["tau"]


def test_eval_with_ngram_reference_uses_the_drafter_block_size(capsys, tmp_path, target_dir, prompts_file):
    from flashdraft.drafter.checkpoint import save_drafter

    save_drafter(make_drafter(), tmp_path / "d")  # block size 8
    rc, out, err = run_cli(
        capsys,
        "eval",
        "--checkpoint",
        tmp_path / "d",
        "--target-model",
        target_dir,
        "--prompts",
        prompts_file,
        "--max-blocks",
        4,
        "--reference",
        "ngram",
        "--json",
        tmp_path / "out.json",
    )
    assert rc == 0, err
    summary = json.loads((tmp_path / "out.json").read_text())
    ref = summary["reference"]
    assert ref["checkpoint"] == "ngram" and ref["block_size"] == 8 and ref["context_layers"] is None
    assert summary["drafter_type"] == "dflash" and summary["context_layers"] == 2
    assert summary["difference"]["tau"] == pytest.approx(summary["tau"] - ref["tau"])


@pytest.mark.parametrize("argv", [["--drafter", "ngram", "--checkpoint", "tiny-drafter"], []])
def test_eval_needs_exactly_one_of_checkpoint_and_ngram(capsys, target_dir, prompts_file, argv):
    rc, out, err = run_cli(capsys, "eval", "--target-model", target_dir, "--prompts", prompts_file, *argv)
    assert rc == 2 and "--drafter ngram" in err and len(err.strip().splitlines()) == 1
