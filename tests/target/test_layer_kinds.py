"""Support read from the model: every causal-LM model type transformers 5.23 builds is either supported (its layer
kinds all have a rollback rule) or refused in one line naming the model type and the layer kind; a representative
subset of the supported ones generates through flashdraft's cache and rollback exactly as the model itself."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from flashdraft.errors import FlashdraftError
from flashdraft.target.layer_kinds import ROLLBACK, read_support
from flashdraft.target.model import TargetModel
from tests.conftest import EOS, PAD, VOCAB, make_tokenizer, run_cli, write_word_prompts
from tests.target.tiny_families import READ_TYPES, make_family_model

# a small config where the model type takes these fields (most do); its defaults otherwise
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # hybrids put full attention every fourth layer
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    eos_token_id=EOS,
    pad_token_id=PAD,
)


def small_config(model_type: str):
    try:
        return AutoConfig.for_model(model_type, **SMALL)
    except Exception:  # noqa: BLE001 - a type that does not take one of the fields gets its defaults
        return AutoConfig.for_model(model_type)


def test_every_causal_lm_type_transformers_builds_is_supported_or_refused_in_one_line():
    outcomes = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = small_config(model_type)
        except Exception:  # noqa: BLE001 - transformers itself builds no config of it without more fields
            outcomes[model_type] = "no config"
            continue
        try:
            support = read_support(config, "t")
            assert support.layer_kinds and set(support.layer_kinds) <= set(ROLLBACK), model_type
            outcomes[model_type] = "supported"
        except FlashdraftError as e:
            line = str(e)
            assert "\n" not in line and "model type '" in line, (model_type, line)
            outcomes[model_type] = line
    supported = [t for t, o in outcomes.items() if o == "supported"]
    assert len(supported) > 80 and {"qwen2", "mistral", "mixtral", "gemma2", "falcon_h1", "llama4_text"} <= set(
        supported
    )
    assert "'linear_attention (MambaMixer)'" in outcomes["mamba"]  # Mamba-1: no rule
    assert "cross-attention" in outcomes["bart"]  # the decoder of an encoder-decoder model
    assert "'indexed_attention'" in outcomes["deepseek_v32"]  # sparse attention with an indexer cache
    assert "no `layers` list" in outcomes["gpt2"]


# one of each kind of layer and of MLP, beside the pipeline's types (tests/target/test_tiny_families.py)
GENERATED = [
    "llama",
    "gemma",
    "cohere",  # logit_scale
    "cohere2",
    "starcoder2",
    "olmo3",
    "exaone4",
    "phimoe",
    "granitemoe",  # logits_scaling
    "minimax_m2",
    "seed_oss",
    "smollm3",
    "stablelm",
    "vaultgemma",  # final_logit_softcapping
]


@pytest.mark.parametrize("model_type", GENERATED + list(READ_TYPES))
def test_a_supported_type_verifies_and_rolls_back_as_the_model_itself_computes(model_type):
    torch.manual_seed(0)
    if model_type in READ_TYPES:  # windows and chunks of 8: the context runs past them
        model = make_family_model(model_type)
    else:
        model = AutoModelForCausalLM.from_config(small_config(model_type)).float().eval()
    target = TargetModel(model, make_tokenizer(), path=None)
    prompt, block = torch.arange(1, 19)[None], torch.tensor([[20, 21, 22, 23]])
    cache = target.new_cache()
    target.forward(prompt, cache)
    target.forward(block, cache)
    target.rollback(cache, 2)  # two of four tokens accepted
    after = target.forward(torch.tensor([[30]]), cache).logits[0, -1]
    with torch.no_grad():
        own = model(torch.cat([prompt, block[:, :2], torch.tensor([[30]])], 1)).logits[0, -1]
    torch.testing.assert_close(after, own, atol=1e-4, rtol=1e-4)


def test_an_exotic_layer_kind_is_refused_in_one_line_before_the_weights_load(tmp_path, capsys):
    target = tmp_path / "mamba"
    config = AutoConfig.for_model("mamba", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    make_tokenizer().save_pretrained(target)
    (target / "model.safetensors").write_bytes(b"not weights")  # never read: refused before
    write_word_prompts(tmp_path / "p.jsonl", 2)
    for argv in (
        ["generate", "--target-model", target, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "c.json"],
        ["init", "--target-model", target, "--out", tmp_path / "init"],
    ):
        rc, _, err = run_cli(capsys, *argv)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(lines) == 1 and "'mamba'" in lines[0] and "MambaMixer" in lines[0], err
        assert "Traceback" not in err
    assert json.loads((target / "config.json").read_text())["model_type"] == "mamba"


@pytest.mark.parametrize(
    ("model_type", "field", "read_as"),
    [
        ("granite", dict(logits_scaling=4.0), "logits_scaling /4.0"),  # divides
        ("hyperclovax", dict(logits_scaling=4.0), "logits_scaling x4.0"),  # the same field, multiplies
        ("cohere", dict(logit_scale=0.5), "logit_scale x0.5"),
        ("nanochat", dict(final_logit_softcapping=2.0), "final_logit_softcapping 2.0"),
    ],
)
def test_the_targets_logits_are_its_own_whatever_its_causal_lm_does_to_the_lm_heads_output(model_type, field, read_as):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL | field)).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # logits far past the soft cap
    target = TargetModel(model, make_tokenizer(), path=None)
    assert target.logit_transform_name == read_as
    prompt = torch.arange(1, 13)[None]
    with torch.no_grad():
        torch.testing.assert_close(target.forward(prompt).logits, model(prompt).logits, atol=1e-4, rtol=1e-4)


def test_logits_no_configured_transform_gives_are_refused_in_one_line():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("llama")).float().eval()

    def tripled(module, args, output):
        output.logits = output.logits * 3
        return output

    model.register_forward_hook(tripled)
    with pytest.raises(FlashdraftError, match=r"model type 'llama': its logits are not its LM head's output"):
        TargetModel(model, make_tokenizer(), path=None)
