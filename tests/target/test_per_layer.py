"""Config fields that vary by decoder layer (transformers' per_layer_config, Gemma 4's head_dim): read per layer and
as most layers have them, where reading the whole config's raises."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from flashdraft.target.per_layer import common_value, layer_value, varies_by_layer
from tests.target.tiny_families import COMMON, MORE_TYPES


def test_a_per_layer_field_is_read_per_layer_and_as_most_layers_have_it():
    fields = {k: v for k, v in (COMMON | MORE_TYPES["gemma4_text"]).items() if v is not None}
    config = AutoConfig.for_model("gemma4_text", **fields)
    with pytest.raises(Exception, match="per-layer attribute"):
        _ = config.head_dim  # what init once died of
    assert varies_by_layer(config, "head_dim") and not varies_by_layer(config, "hidden_size")
    widths = [layer_value(config, "head_dim", i) for i in range(config.num_hidden_layers)]
    assert widths[0] == widths[2] == 64 and widths[1] == widths[3] != 64  # sliding layers, then full ones
    assert common_value(config, "head_dim") == 64  # a tie: the smaller
    assert common_value(config, "hidden_size") == layer_value(config, "hidden_size", 1) == 128


def test_most_layers_win_over_the_smaller_value():
    fields = {k: v for k, v in (COMMON | MORE_TYPES["gemma4_text"]).items() if v is not None}
    fields["layer_types"] = ["full_attention", "full_attention", "full_attention", "sliding_attention"]
    config = AutoConfig.for_model("gemma4_text", **fields)
    assert common_value(config, "head_dim") == max(layer_value(config, "head_dim", i) for i in range(4))
