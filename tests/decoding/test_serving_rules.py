import json
from pathlib import Path

import pytest
import torch

import flashdraft
import flashdraft.decoding.generate as decode
from flashdraft.decoding.generate import SpeculativeConfig, autoregressive_generate, speculative_generate
from flashdraft.decoding.proposers import DFlashProposer
from flashdraft.decoding.serving_rules import (
    NO_FILTERS,
    RULES,
    SamplingFilters,
    SamplingParams,
    acceptance_probabilities,
    check_filters,
    expected_committed,
    filters_for,
    request_filters,
    resolve_filters,
    rule_of_command,
    serving_rule,
    target_probs,
)
from flashdraft.drafter.server_fields import SGLANG
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.records import EvalRecord
from tests.conftest import make_dflash2_drafter, make_drafter, make_dspark_drafter, make_target
from tests.evaluation.test_run import overfit

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _kept(filters: SamplingFilters, temperature: float = 1.0) -> list[int]:
    return (target_probs(LOGITS, temperature, filters) > 0).nonzero()[:, 0].tolist()


def test_each_target_filter_keeps_what_its_definition_keeps():
    p = torch.softmax(LOGITS, -1)  # [0.56, 0.21, 0.13, 0.08, 0.03, 0.004]
    assert _kept(SamplingFilters(top_k=3)) == [0, 1, 2]
    assert _kept(SamplingFilters(top_p=0.7)) == [0, 1]  # 0.56 < 0.7: the head needs the second token
    assert _kept(SamplingFilters(top_p=0.5)) == [0]
    assert _kept(SamplingFilters(min_p=0.1)) == [i for i in range(6) if p[i] >= 0.1 * p[0]]
    # top-p after top-k reads the renormalised top-k mass: 0.56 / (0.56 + 0.21) > 0.7 keeps one token
    assert _kept(SamplingFilters(top_k=2, top_p=0.7)) == [0]
    # temperature first: at T = 4 the distribution is flat enough that top-p 0.7 keeps four tokens
    assert len(_kept(SamplingFilters(top_p=0.7), temperature=4.0)) == 4
    kept = target_probs(LOGITS, 1.0, SamplingFilters(top_k=3))
    assert torch.allclose(kept[:3], p[:3] / p[:3].sum()) and float(kept.sum()) == pytest.approx(1.0)


def test_the_rules_are_the_servers_as_read():
    vllm, probabilistic, sglang = RULES["vllm"], RULES["vllm-probabilistic"], RULES["sglang"]
    assert serving_rule(None) is vllm  # the default: vLLM's draft_sample_method greedy
    assert not any(vllm.samples_drafts(f) for f in ("dflash", "dflash2", "dspark"))
    assert all(probabilistic.samples_drafts(f) for f in ("dflash", "dflash2", "dspark"))
    assert [sglang.samples_drafts(f) for f in ("dflash", "dflash2", "dspark")] == [False, True, True]
    assert not any(r.samples_drafts(None) for r in RULES.values())  # the n-gram's draft is one-hot everywhere
    assert vllm.honours_draft_top_k and not sglang.honours_draft_top_k
    assert "min_p" in vllm.target_filters and "min_p" not in sglang.target_filters
    assert vllm.target_filters[0] == sglang.target_filters[0] == "temperature"
    with pytest.raises(FlashdraftError, match="--serving-rule 'trtllm'"):
        serving_rule("trtllm")


def test_the_generation_config_supplies_the_filters_a_request_leaves_unset(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    filters = resolve_filters(tmp_path, None, 0.8, None)
    assert (filters.top_k, filters.top_p, filters.min_p) == (20, 0.8, None)
    assert filters.source == {"top_p": "given", "top_k": str(tmp_path / "generation_config.json")}
    assert resolve_filters(tmp_path, None, None, None, use_generation_config=False).active() == {}
    tiny = resolve_filters(Path(flashdraft.__file__).parent / "assets" / "tiny", None, None, None)
    assert tiny.active() == {}  # the built-in target's generation config sets no sampling defaults


def test_a_filter_the_rules_server_does_not_apply_is_refused_when_given_and_dropped_from_a_generation_config():
    with pytest.raises(FlashdraftError, match=f"--min-p 0.1: {SGLANG} does not apply min_p"):
        check_filters(SamplingFilters(min_p=0.1, source={"min_p": "given"}), RULES["sglang"])
    from_config = SamplingFilters(top_k=20, min_p=0.1, source={"min_p": "generation_config.json"})
    check_filters(from_config, RULES["sglang"])
    assert filters_for(from_config, RULES["sglang"]).active() == {"top_k": 20}
    assert filters_for(from_config, RULES["vllm"]).active() == {"top_k": 20, "min_p": 0.1}


@pytest.mark.parametrize("cap", [1, 2, 3, 10])
def test_expected_committed_is_the_mean_and_variance_of_the_committed_length(cap):
    alpha = torch.tensor([0.9, 0.5, 0.7])
    # the law of a (accepted drafts) written out: stop at the first rejection
    law_a = [0.1, 0.9 * 0.5, 0.9 * 0.5 * 0.3, 0.9 * 0.5 * 0.7]
    law_n: dict[int, float] = {}
    for a, prob in enumerate(law_a):
        n = min(a + 1, cap)
        law_n[n] = law_n.get(n, 0.0) + prob
    mean = sum(n * p for n, p in law_n.items())
    variance = sum(n * n * p for n, p in law_n.items()) - mean**2
    assert expected_committed(alpha, cap) == pytest.approx((mean, variance))


def test_acceptance_probabilities_are_p_of_the_draft_one_hot_and_min_one_p_over_q_otherwise():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    q = torch.tensor([[0.25, 0.5, 0.25], [0.0, 0.2, 0.8]])
    draft = torch.tensor([1, 1])
    assert torch.allclose(acceptance_probabilities(draft, None, p), torch.tensor([0.3, 0.6]))
    assert torch.allclose(acceptance_probabilities(draft, q, p), torch.tensor([0.6, 1.0]))


FAMILIES = {
    "dflash": lambda: make_drafter(block_size=4),
    "dflash2": lambda: make_dflash2_drafter(block_size=4),
    "dspark": lambda: make_dspark_drafter(block_size=3),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_under_the_vllm_default_rule_drafts_are_the_argmax_walk_at_t1_accepted_with_p_of_the_draft(family, monkeypatch):
    # the acceptance law, not only losslessness: each run's first step is recorded as verified; its drafts must be
    # the greedy walk a fresh proposer drafts on that context, verified with q one-hot, and draft j accepted (all
    # before it accepted) as often as the target's own p(d_j), from an independent target forward, predicts
    target = make_target("qwen3")
    with torch.no_grad():  # a peaked p at T = 1, so argmax drafts are accepted often enough to see the law
        target.model.get_output_embeddings().weight.mul_(3)
    prompt = [5, 9, 17, 3, 22]
    drafter = overfit(
        FAMILIES[family](), target, EvalRecord("o", prompt, autoregressive_generate(target, prompt, 30).output_ids)
    )
    seen: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []
    real_verify = decode.verify

    def recording(draft, q, p, generator=None):
        a, bonus, alpha = real_verify(draft, q, p, generator)
        seen.append((draft, q, a))
        return a, bonus, alpha

    monkeypatch.setattr(decode, "verify", recording)
    gen = torch.Generator().manual_seed(0)
    firsts, steps = [], []
    for _ in range(150):
        del seen[:]
        out = speculative_generate(
            target,
            drafter,
            prompt,
            4,
            sampling=SamplingParams(temperature=1.0),
            speculative=SpeculativeConfig(rule="vllm"),
            generator=gen,
        )
        if seen:  # no step when the first token was the stop token
            firsts.append(out.output_ids[0])
            steps.append(seen[0])
    predicted = observed = variance = 0.0
    with torch.no_grad():
        for first, (draft, q, a) in zip(firsts, steps, strict=True):
            assert q is None  # one-hot
            proposer = DFlashProposer(drafter, target)
            target.set_context_layers(proposer.context_layer_ids)
            context = prompt + [first]
            features = target.forward(torch.tensor([context[:-1]])).context_features
            positions = torch.arange(len(context) - 1)[None]
            rows = proposer.propose(context, len(context) - 1, features, positions, drafter.config.block_size)
            assert torch.equal(draft, rows.argmax(-1))  # the argmax walk, at T = 1
            logits = target.model(torch.tensor([context + draft.tolist()])).logits[0, len(context) - 1 :]
            p_d = torch.softmax(logits.float(), -1)[:-1].gather(-1, draft[:, None])[:, 0]  # [k]
            for j in range(min(a + 1, len(draft))):  # positions the step reached
                predicted, observed = predicted + float(p_d[j]), observed + (j < a)
                variance += float(p_d[j] * (1 - p_d[j]))
    assert abs(observed - predicted) < 4 * variance**0.5, (observed, predicted, variance**0.5)
    assert observed > 30  # drafts were accepted often enough for the law to be seen


def test_a_serving_command_implies_its_servers_rule():
    spec = '{"method": "dflash", "model": "d", "num_speculative_tokens": 7}'
    assert rule_of_command(f"vllm serve Qwen/Qwen3-8B --speculative-config '{spec}'").name == "vllm"
    probabilistic = spec.replace("}", ', "draft_sample_method": "probabilistic"}')
    assert (
        rule_of_command(f"vllm serve Qwen/Qwen3-8B --speculative-config '{probabilistic}'").name == "vllm-probabilistic"
    )
    assert rule_of_command("python -m sglang.launch_server --speculative-algorithm DSPARK").name == "sglang"
    with pytest.raises(FlashdraftError, match="expected a 'vllm serve"):
        rule_of_command("trtllm-serve model")


def test_a_requests_filters_come_from_the_generation_config_and_drop_what_the_rules_server_does_not_apply(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 5, "min_p": 0.1, "temperature": 0.6}))
    filters, dropped = request_filters(tmp_path, 0.7, None, 0.9, None, RULES["sglang"])
    assert (filters.top_k, filters.top_p, filters.min_p) == (5, 0.9, None) and dropped == ["min_p"]
    assert filters.source["top_k"] == str(tmp_path / "generation_config.json") and filters.source["top_p"] == "given"
    filters, dropped = request_filters(tmp_path, 0.7, None, None, None, RULES["vllm"])  # vLLM applies min-p
    assert (filters.top_k, filters.min_p) == (5, 0.1) and dropped == []
    assert request_filters(tmp_path, 0.7, None, None, None, RULES["sglang"], use_generation_config=False) == (
        SamplingFilters(),
        [],
    )
    assert request_filters(tmp_path, 0.0, 3, None, None, RULES["vllm"]) == (NO_FILTERS, [])  # greedy: none
    with pytest.raises(FlashdraftError, match=r"--min-p 0.2: SGLang .* does not apply min_p"):
        request_filters(tmp_path, 0.7, None, None, 0.2, RULES["sglang"])
