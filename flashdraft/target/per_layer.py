"""Config fields that vary by decoder layer. transformers 5.23 configs may hold a `per_layer_config` (Gemma 4's full
attention layers have a head_dim of their own): reading such a field on the whole config raises
`AmbiguousGlobalPerLayerAttributeError`, so code reads it here, per layer or as most layers have it."""

from __future__ import annotations

from collections import Counter

_MISSING = object()


def varies_by_layer(config, name: str) -> bool:
    """Whether transformers says `name` may differ between decoder layers of `config`."""
    return name in (getattr(config, "per_layer_attributes", None) or ())


def layer_value(config, name: str, layer: int, default=None):
    """`name` as decoder layer `layer` has it."""
    if varies_by_layer(config, name):
        value = getattr(config.per_layer_config[layer], name, _MISSING)
        return default if value is _MISSING else value
    return getattr(config, name, default)


def common_value(config, name: str, default=None):
    """`name` as most decoder layers have it (the smallest of the most common values on a tie); the config's own
    value where it does not vary by layer."""
    if not varies_by_layer(config, name):
        return getattr(config, name, default)
    values = [layer_value(config, name, i, default) for i in range(config.num_hidden_layers)]
    counts = Counter(values)
    top = max(counts.values())
    return min(v for v, n in counts.items() if n == top)
