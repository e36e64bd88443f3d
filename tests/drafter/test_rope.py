"""RoPE scaling as the flags give it and as doctor and eval describe it (the config.json schemas: test_config)."""

from types import SimpleNamespace

import pytest

from flashdraft.drafter.config import DrafterConfig
from flashdraft.drafter.init import new_drafter_for_target
from flashdraft.drafter.rope import (
    DRAFTER_THETA,
    describe_scaling,
    parse_rope_scaling,
    rope_fields,
    target_rope,
    target_theta,
)
from flashdraft.errors import FlashdraftError
from tests.conftest import make_target

YARN = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1024}


def test_a_flag_scaling_parses_to_the_dict_written_and_default_means_native():
    assert parse_rope_scaling('{"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024}') == YARN
    assert parse_rope_scaling('{"rope_type": "default"}') == {"rope_type": "default"}
    assert describe_scaling(YARN) == "yarn factor 4, original_max_position_embeddings 1024"
    assert describe_scaling(None) == "native (no scaling)"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("yarn", "is not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"rope_type": "linear", "factor": 2, "rope_theta": 1e6}', "rope_theta is not a scaling key"),
        (
            '{"rope_type": "linear", "factor": 2, "partial_rotary_factor": 0.5}',
            "partial_rotary_factor is the rotary width",
        ),
        ('{"rope_type": "linear", "factor": -2}', "factor -2; expected a positive number"),
    ],
)
def test_a_flag_scaling_that_cannot_be_computed_is_refused_saying_why(text, expected):
    with pytest.raises(FlashdraftError, match=expected):
        parse_rope_scaling(text)


def test_both_schemas_are_written_with_the_same_scaling_and_theta():
    fields = rope_fields(1e7, YARN, 0.25)
    assert fields["rope_scaling"] == YARN and fields["rope_theta"] == 1e7
    assert fields["rope_parameters"] == YARN | {"rope_theta": 1e7, "partial_rotary_factor": 0.25}


def test_a_drafter_for_a_target_starts_from_the_one_reading_of_its_rope_theta():
    # init and the long-context guards read a target's rope_theta alike: per layer type its full-attention layers',
    # a transformers 4 config's top-level field, else the drafter's default
    per_type = SimpleNamespace(
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1.0},
        }
    )
    assert target_theta(per_type) == 5.0 == target_rope(per_type)[0]
    assert target_theta(SimpleNamespace(rope_theta=2e5)) == 2e5
    assert target_theta(SimpleNamespace()) == DRAFTER_THETA == DrafterConfig.__dataclass_fields__["rope_theta"].default
    target = make_target("qwen3")
    assert new_drafter_for_target(target).config.rope_theta == target_rope(target.config)[0]
