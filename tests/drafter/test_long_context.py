"""The long-context guards: the trained context against the context used, RoPE against the target's, and what
each drafter layer reads per step."""

from types import SimpleNamespace

from flashdraft.decoding.hybrid import HybridDrafter
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.drafter.long_context import context_guards, eval_guards, layer_reads
from flashdraft.drafter.rope import target_rope
from flashdraft.evaluation.records import EvalRecord
from tests.conftest import make_drafter, make_drafter_config, make_target

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def test_a_full_layer_reads_the_whole_context_and_a_sliding_one_at_most_its_window():
    cfg = make_drafter_config(
        num_hidden_layers=3,
        sliding_window=2048,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    assert layer_reads(cfg, 1000) == [1000, 1000, 1000]
    assert layer_reads(cfg, 32768) == [2048, 2048, 32768]


def test_the_trained_context_is_named_covered_warned_past_or_unknown():
    (covered, *_) = context_guards(make_drafter_config(trained_context_length=4096), 4096, "x")
    assert covered.level == "ok" and "4096 tokens (trained_context_length) covers x" in covered.line
    (past, *_) = context_guards(make_drafter_config(trained_context_length=4096), 4097, "x")
    assert past.level == "warn" and "past the 4096 tokens" in past.line and "--rope-scaling" in past.fix
    (unknown, *_) = context_guards(make_drafter_config(), 4097, "x")
    assert unknown.level == "note" and unknown.line.startswith("trained context: unknown")


def test_rope_warns_when_the_target_is_scaled_unlike_the_drafter_and_notes_the_recipe_and_rope_theta():
    def guards(cfg, params):
        return [g for g in context_guards(cfg, 100, "x", SimpleNamespace(rope_parameters=params))[1:-1]]

    native = {"rope_type": "default", "rope_theta": 1e6}
    (warned,) = guards(make_drafter_config(), native | YARN)
    assert warned.level == "warn" and "native (no scaling) differs from the target's yarn factor 4" in warned.line
    (recipe,) = guards(make_drafter_config(rope_scaling=YARN), native)
    assert recipe.level == "note" and "stage 2 of the long-context recipe" in recipe.line
    same, theta = guards(make_drafter_config(rope_scaling=YARN), YARN | {"rope_theta": 1e7})
    assert (
        same.level == "ok"
        and theta.level == "note"
        and "rope_theta: the drafter's 1e+06, the target's 1e+07" in theta.line
    )


def test_a_target_rope_per_layer_type_is_read_from_its_full_attention_layers():
    config = SimpleNamespace(
        rope_parameters={
            "full_attention": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 5.0,
                "original_max_position_embeddings": 1024,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 1.0},
        }
    )
    assert target_rope(config) == (5.0, YARN)
    assert target_rope(make_target("hybrid").config)[1] is None


def test_eval_guards_speak_for_each_dflash_drafter_a_hybrids_included_at_the_longest_record():
    target = make_target("qwen3")
    drafter = make_drafter(trained_context_length=10)
    records = [EvalRecord("a", [1] * 5, [2] * 4), EvalRecord("b", [1] * 7, [])]  # b: online, 6 new tokens
    hybrid = HybridDrafter(drafter, NGramProposer(target.vocab_size))
    lines = eval_guards(
        [("d", drafter), ("h", hybrid), ("ngram", NGramProposer(target.vocab_size))], target, records, 6
    )
    assert any(
        x.startswith(
            "d: warning: trained context: the longest record evaluated (prompt + completion) is 13 tokens, past the 10"
        )
        for x in lines
    )
    assert any(x.startswith("h: warning: trained context") for x in lines)
    assert not any(x.startswith("ngram") for x in lines)
