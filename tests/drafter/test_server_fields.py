"""The table of fields the servers read: each non-neutral value is refused by name, or honoured
(the drafter computes differently, greedy or at T > 0, and offline == online holds)."""

from __future__ import annotations

import json

import pytest
import torch

from flashdraft.drafter.checkpoint import fold_conventions, load_drafter, load_state_dict_drafter, save_drafter
from flashdraft.drafter.config import DrafterConfig
from flashdraft.drafter.server_fields import SERVER_FIELDS, fields_set, value_of
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.offline import evaluate_offline
from tests.conftest import make_drafter, make_target
from tests.evaluation.test_run import greedy_records, online_lengths

# what a field needs beside it to mean something (config changes; tensors the drafter then has)
DELETE = object()
COMPANIONS = {
    "sliding_window": {"layer_types": ["sliding_attention"] * 2, "use_sliding_window": True},
    "dflash_config.swa_window_size": {"dflash_config.use_swa": True},
    "dflash_config.use_swa": {"dflash_config.swa_window_size": 3},
    "dflash_config.causal": {"is_causal": DELETE},  # the top-level is_causal (written by flashdraft) wins over it
    "layer_types": {"sliding_window": 3, "use_sliding_window": True},
    # written in both RoPE schemas: changed in one, the other goes (a disagreement is refused)
    "rope_theta": {"rope_parameters": DELETE},
    "rope_scaling": {"rope_parameters": DELETE},
}
# honoured fields that leave the argmax alone: they only show when sampling
ONLY_WHEN_SAMPLING = {"dflash_config.output_multiplier", "dflash_config.final_logit_softcapping"}


def _with(d: dict, name: str, value) -> dict:
    d = json.loads(json.dumps(d))  # a deep copy
    head, _, rest = name.partition(".")
    if value is DELETE:
        d.pop(head)
    elif rest:
        d[head] = dict(d.get(head) or {}, **{rest: value})
    else:
        d[head] = value
    return d


def _config_with(base: DrafterConfig, field) -> dict:
    d = _with(base.to_dict(), field.name, field.example)
    for name, value in COMPANIONS.get(field.name, {}).items():
        d = _with(d, name, value)
    return d


def _state_for(cfg: DrafterConfig, base_state: dict, seed: int = 1) -> dict:
    """The base drafter's tensors, plus fresh ones for what the field adds (biases, an own head)."""
    fresh = make_drafter(seed, **{k: getattr(cfg, k) for k in ("attention_bias", "draft_vocab_size")})
    state = {k: base_state.get(k, v) for k, v in fresh.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    for key in state:
        if key.endswith("proj.bias"):  # fresh biases are zero: give them values that change something
            state[key] = torch.randn(state[key].shape, generator=gen)
    if "d2t" in state:
        state["d2t"] = torch.arange(cfg.draft_vocab_size) * 2 - torch.arange(cfg.draft_vocab_size)  # even ids
    return state


def _logits(drafter, target):
    gen = torch.Generator().manual_seed(0)
    blocks, anchors = torch.randn(1, 16, 64, generator=gen), torch.tensor([[5, 12]])
    ctx, pos = torch.randn(1, 17, 128, generator=gen), torch.arange(17)[None]
    with torch.no_grad():
        return drafter.logits(drafter(blocks, anchors, ctx, pos), target.lm_head).float()  # [1, 16, V]


@pytest.fixture(scope="module")
def setup():
    target = make_target("hybrid")
    base = make_drafter(seed=1)
    with torch.no_grad():  # weights large enough that attention and RoPE move the argmax (at 0.02 they barely do)
        for name, p in base.named_parameters():
            if p.ndim == 2 and name.startswith("layers."):
                p.mul_(10)
    return target, base, greedy_records(target, 24)[:2]


@pytest.mark.parametrize("field", [f for f in SERVER_FIELDS if f.handling == "refused"], ids=lambda f: f.name)
def test_a_refused_field_with_a_non_neutral_value_is_one_error_naming_it_and_its_server(setup, field):
    _, base, _ = setup
    with pytest.raises(FlashdraftError, match=f"field '{field.name}' is .*read by"):
        DrafterConfig.from_dict(_config_with(base.config, field), source="x/config.json")
    for neutral in field.neutral:  # the neutral values load
        if neutral is not None:
            DrafterConfig.from_dict(_with(base.config.to_dict(), field.name, neutral))


@pytest.mark.parametrize(
    "field",
    [f for f in SERVER_FIELDS if f.handling != "refused" and f.name != "architectures" and f.family is None],
    ids=lambda f: f.name,
)
def test_an_honoured_field_changes_what_the_drafter_computes_and_offline_equals_online(setup, field, tmp_path):
    target, base, records = setup
    d = _config_with(base.config, field)
    cfg = DrafterConfig.from_dict(d, source="x/config.json")
    drafter = load_state_dict_drafter(_state_for(cfg, base.state_dict()), cfg, "x")
    assert drafter.config.in_own_conventions  # folded fields are converted on load
    with_field, without = _logits(drafter, target), _logits(base, target)
    q_with, q_without = torch.softmax(with_field, -1), torch.softmax(without, -1)
    assert float((q_with - q_without).abs().max()) > 1e-3, field.name  # T > 0: another distribution
    if field.name not in ONLY_WHEN_SAMPLING:
        assert not torch.equal(with_field.argmax(-1), without.argmax(-1)), field.name  # greedy: other drafts
    offline = evaluate_offline(drafter, target, records)
    assert [p.acceptance_lengths for p in offline.per_prompt] == online_lengths(target, drafter, records)
    # written back in flashdraft's conventions, it reloads as the same drafter
    save_drafter(drafter, tmp_path)
    torch.testing.assert_close(_logits(load_drafter(tmp_path), target), with_field, rtol=1e-5, atol=1e-5)


def test_the_table_lists_every_field_of_section_9_of_the_reference_doc():
    names = {f.name for f in SERVER_FIELDS}
    for name in (
        "rope_parameters.partial_rotary_factor",
        "partial_rotary_factor",
        "rope_scaling.rope_dim",
        "is_neox_style",
        "rope_is_neox_style",
        "use_gemma_norm",
        "hidden_act",
        "swiglu_limit",
        "swiglu_alpha",
        "attention_bias",
        "rms_norm_eps",
        "layer_types",
        "sliding_window",
        "is_causal",
        "dflash_config.causal",
        "dflash_config.use_swa",
        "dflash_config.swa_window_size",
        "add_swa_attention_sink_bias",
        "attention_sink_bias",
        "logit_scale",
        "dflash_config.output_multiplier",
        "dflash_config.final_logit_softcapping",
        "dflash_config.input_embedding_scale",
        "draft_vocab_size",
        "architectures",
        "projector_type",
        "dflash_config.attention_value_scale",
    ):
        assert name in names, name
    assert "is_domino" not in names  # SGLang derives it from projector_type: not a field
    assert all(f.handling in ("honoured", "folded", "refused") and f.read_by for f in SERVER_FIELDS)


def test_architectures_of_a_family_flashdraft_does_not_build_is_refused_naming_it(setup):
    _, base, _ = setup
    with pytest.raises(FlashdraftError, match=r"'architectures' is \['Eagle3LlamaForCausalLM'\]"):
        DrafterConfig.from_dict(_with(base.config.to_dict(), "architectures", ["Eagle3LlamaForCausalLM"]), source="x")


def test_folding_gemma_norms_and_gptj_rotation_gives_the_same_drafter_as_the_servers_compute(setup):
    """Written out: a (1 + w) RMSNorm and GPT-J rotation computed directly on the stored weights equal
    the folded drafter's plain norms and NeoX rotation."""
    target, base, _ = setup
    d = base.config.to_dict() | {"use_gemma_norm": True, "is_neox_style": False}
    cfg = DrafterConfig.from_dict(d)
    stored = _state_for(cfg, base.state_dict())
    folded_cfg, folded = fold_conventions(cfg, stored)
    assert folded_cfg.in_own_conventions
    for key in (k for k in stored if k.endswith("norm.weight")):
        torch.testing.assert_close(
            folded[key][torch.argsort(_order(cfg)) if "q_norm" in key or "k_norm" in key else slice(None)],
            stored[key] + 1,
        )
    # GPT-J rotation of (q, k) equals NeoX rotation of the permuted (q, k): the scores agree
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen)
    theta = torch.randn(5, 8, generator=gen)
    gptj = _rotate_gptj(q, theta) @ _rotate_gptj(k, theta).T
    order = _order(cfg)
    neox = _rotate_neox(q[:, order], theta) @ _rotate_neox(k[:, order], theta).T
    torch.testing.assert_close(gptj, neox, rtol=1e-5, atol=1e-5)


def _order(cfg):
    d = cfg.rotary_dim
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2), torch.arange(d, cfg.head_dim)])


def _rotate_gptj(x, theta):
    x1, x2 = x[:, 0::2], x[:, 1::2]
    c, s = theta.cos(), theta.sin()
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(1)


def _rotate_neox(x, theta):
    half = x.shape[1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    c, s = theta.cos(), theta.sin()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], 1)


def test_partial_rotary_spellings_resolve_to_one_width_and_disagreeing_ones_are_refused(setup):
    _, base, _ = setup
    d = base.config.to_dict()
    spellings = (
        {"partial_rotary_factor": 0.5},
        {"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5}},
        {"rope_scaling": {"rope_type": "default", "rope_dim": 8}},
    )
    for spelling in spellings:
        cfg = DrafterConfig.from_dict(d | spelling)
        assert cfg.rotary_dim == 8 and cfg.to_dict()["partial_rotary_factor"] == 0.5
        assert "rope_dim" not in json.dumps(cfg.to_dict())  # written once, as both servers read it
    with pytest.raises(FlashdraftError, match="rope_dim' is 4 but partial_rotary_factor 0.5 gives 8"):
        DrafterConfig.from_dict(
            d | {"partial_rotary_factor": 0.5, "rope_scaling": {"rope_type": "default", "rope_dim": 4}}
        )
    with pytest.raises(FlashdraftError, match="rope_parameters.partial_rotary_factor' is 0.25 but"):
        DrafterConfig.from_dict(
            d | {"partial_rotary_factor": 0.5, "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.25}}
        )


def test_reference_scalings_at_the_top_level_are_read_and_a_conflict_with_dflash_config_is_refused(setup):
    _, base, _ = setup
    d = base.config.to_dict()
    cfg = DrafterConfig.from_dict(d | {"output_multiplier": 2.0})
    assert cfg.reference_option("output_multiplier") == 2.0
    assert cfg.to_dict()["dflash_config"]["output_multiplier"] == 2.0 and "output_multiplier" not in cfg.to_dict()
    with pytest.raises(FlashdraftError, match="'dflash_config.output_multiplier' is 3.0 but the top-level"):
        DrafterConfig.from_dict(_with(d, "dflash_config.output_multiplier", 3.0) | {"output_multiplier": 2.0})


def test_fields_set_lists_what_a_config_changes(setup):
    _, base, _ = setup
    d = base.config.to_dict() | {"use_gemma_norm": True, "partial_rotary_factor": 0.5}
    listed = {f.name: v for f, v in fields_set(d)}
    assert listed["use_gemma_norm"] is True and listed["partial_rotary_factor"] == 0.5
    assert "logit_scale" not in listed and value_of(d, "dflash_config.mask_token_id") is not None


# DSpark's own fields, on a DSpark drafter: each changes its drafts or its confidence, offline == online holds
DSPARK_COMPANIONS = {
    "enable_confidence_head": {"confidence_head_with_markov": False},
    "confidence_head_with_markov": {"enable_confidence_head": True},
}


@pytest.mark.parametrize("field", [f for f in SERVER_FIELDS if f.family == "dspark"], ids=lambda f: f.name)
def test_an_honoured_dspark_field_changes_the_drafts_or_the_confidence_and_offline_equals_online(
    setup, field, tmp_path
):
    from flashdraft.drafter.model import DFlashDrafter
    from tests.conftest import make_dspark_drafter

    target, _, records = setup
    base = make_dspark_drafter(1, confidence_head=False, confidence_head_with_markov=False)
    d = _with(base.config.to_dict(), field.name, field.example)
    for name, value in DSPARK_COMPANIONS.get(field.name, {}).items():
        d = _with(d, name, value)
    cfg = DrafterConfig.from_dict(d, source="x/config.json")
    fresh = make_dspark_drafter(
        2,
        **{
            k: getattr(cfg, k) for k in ("markov_rank", "confidence_head", "confidence_head_with_markov", "draft_top_k")
        },
    )
    state = {
        k: base.state_dict()[k] if k in base.state_dict() and base.state_dict()[k].shape == v.shape else v
        for k, v in fresh.state_dict().items()
    }
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(state)
    drafter.eval()

    def computed(m):
        logits = _logits(m, target)[0, :7]  # the first block's base logits [7, V]
        drafts, _, previous = m.markov_walk(logits[None], torch.tensor([3]))
        if m.confidence_head is not None:
            gen = torch.Generator().manual_seed(0)
            hidden = torch.randn(7, 64, generator=gen)
            return drafts, m.confidence(hidden, previous[0])
        return drafts, None

    with torch.no_grad():
        (drafts, c), (base_drafts, _) = computed(drafter), computed(base)
    assert c is not None or not torch.equal(drafts, base_drafts), field.name
    offline = evaluate_offline(drafter, target, records)
    assert [p.acceptance_lengths for p in offline.per_prompt] == online_lengths(target, drafter, records)
    save_drafter(drafter, tmp_path)
    reloaded = load_drafter(tmp_path).config
    assert all(
        getattr(reloaded, k) == getattr(cfg, k)
        for k in ("markov_rank", "confidence_head", "confidence_head_with_markov", "draft_top_k")
    )


def test_attention_value_scale_in_a_dspark_drafter_is_refused_naming_the_dspark_models_that_ignore_it():
    from tests.conftest import DSPARK, make_drafter_config

    raw = make_drafter_config(**DSPARK).to_dict()
    raw["dflash_config"] = {**raw.get("dflash_config", {}), "attention_value_scale": 0.5}
    with pytest.raises(FlashdraftError, match="dflash_config.attention_value_scale.*qwen3_dspark.py"):
        DrafterConfig.from_dict(raw, source="x")
