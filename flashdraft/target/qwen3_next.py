"""Qwen3-Next's Gated DeltaNet (Qwen3-Coder-Next): the recurrence of Qwen3.5's layer with other projections.

Qwen3.5/3.6 project with four matrices (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); Qwen3-Next with
two (`in_proj_qkvz`, `in_proj_ba`) whose rows are grouped per key head: for each key head its query, key, the
values and gates of the value heads it serves, then its b and a. Once those are regrouped into Qwen3.5's layout
(query | key | value channels for the conv, z, b, a per value head), the conv, the gated delta rule, the gated
norm and the state layout in the cache are the same, so `flashdraft.target.linear_attention`'s short-block path
and its rollback records serve both.
"""

from __future__ import annotations

import torch
from torch import nn


def qwen3_next_projections(layer: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed qkv [B, T, 2 * key_dim + value_dim], z [B, T, Hv, dv], b [B, T, Hv], a [B, T, Hv]) of a
    Qwen3NextGatedDeltaNet, regrouped by the layer's own `fix_query_key_value_ordering` as its forward does."""
    query, key, value, z, b, a = layer.fix_query_key_value_ordering(
        layer.in_proj_qkvz(hidden_states), layer.in_proj_ba(hidden_states)
    )
    batch, seq_len = hidden_states.shape[:2]
    mixed_qkv = torch.cat([x.reshape(batch, seq_len, -1) for x in (query, key, value)], dim=-1)
    return mixed_qkv, z, b, a
