"""The drafter's decoding state in fixed shapes: a context cache preallocated per layer and written at a position held
on the device, and a one-block pass that reads all of it under a mask, so both compile once
(`torch.compile(fullgraph=True, dynamic=False)`; on CUDA, graphs) whatever the step's accepted length and position.

The eager `DrafterCache` grows by `torch.cat` every step, so every step's attention has a new shape. Here:
- `StaticDrafterCache`: per layer K and V [1, kv_heads, C + B, d]: C context slots (after k_norm and RoPE, as the
  eager cache holds them), then B rows the block pass rewrites with the block's own K/V each time (so attention reads
  one buffer, never a concatenation); `positions` [1, C] the position of each context slot, PAD_POSITION where nothing
  is written, and `length` [1] (on the device) the slots written. A context row is visible to a block query by the
  same rule as eagerly (`attention_mask`: its position before the anchor, within the window of a sliding layer), so
  unwritten and padding slots (PAD_POSITION) are never seen and no length needs to reach the mask.
- `write_context`: a step's new context (the a + 1 committed tokens) through `fc`, `hidden_norm` and each layer's
  k/v projection, written at slots `length ..` (vLLM's `precompute_and_store_context_kv`). Its rows come padded to a
  fixed R (the most a step commits) with PAD_POSITION positions, so one graph serves every accepted length; the
  padding's slots lie past the written ones and the next write overwrites them. Kept as a graph of its own rather
  than outside one (vLLM's choice): on a GPU the projection of every drafter layer is then one replay, not ~10
  kernel launches a layer. A longer context (the prompt, or a hybrid's context kept over skipped steps) is written
  by the same function uncompiled, in one pass at its own length.
- `block_hidden`: the drafter's forward over one block [anchor, mask x (B - 1)] at a position given as a tensor,
  attending to the whole buffer (rows past `length` masked by their positions).
There is no rollback: the drafter caches committed context only, so its position just advances.
"""

from __future__ import annotations

import torch

from flashdraft.drafter.model import PAD_POSITION, DFlashDrafter, attention_mask
from flashdraft.errors import FlashdraftError


class StaticDrafterCache:
    """The committed context of one sequence in fixed buffers (see the module docstring), for `capacity` context
    tokens and blocks of `block` tokens. Buffers keep their storage for the cache's life (`reset` starts a new
    sequence in them), so a CUDA graph that reads them stays valid."""

    def __init__(self, drafter: DFlashDrafter, capacity: int, block: int, device, dtype: torch.dtype) -> None:
        cfg = drafter.config
        self.capacity, self.block = capacity, block
        shape = (1, cfg.num_key_value_heads, capacity + block, cfg.head_dim)  # context slots, then the block's rows
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in drafter.layers]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in drafter.layers]
        self.positions = torch.full((1, capacity), PAD_POSITION, dtype=torch.long, device=device)  # [1, C]
        self.length = torch.zeros(1, dtype=torch.long, device=device)  # [1]: context slots written
        for buffer in (*self.keys, *self.values, self.positions, self.length):
            # the same storage every call: CUDA graphs read and write it in place, never through a copy
            torch._dynamo.mark_static_address(buffer)

    def buffers(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values, self.positions, self.length]

    def reset(self) -> None:
        """An empty cache, in the same buffers (the K/V rows need no clearing: their positions mask them)."""
        self.positions.fill_(PAD_POSITION)
        self.length.zero_()

    def keys_and_values(self, layer: int, context_kv: tuple, block_kv: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The block pass's keys and values: the block's own K/V [1, kv_heads, B, d] written over the buffer's last
        B rows, the whole buffer returned [1, kv_heads, C + B, d]. The context was written by `write_context`, so
        context_kv holds no rows."""
        if context_kv[0].shape[2] != 0:
            raise ValueError("a static drafter cache takes new context through write_context, not the block pass")
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, self.capacity :].copy_(block_kv[0])
        values[:, :, self.capacity :].copy_(block_kv[1])
        return keys, values


def write_context(
    drafter: DFlashDrafter, cache: StaticDrafterCache, features: torch.Tensor, positions: torch.Tensor
) -> None:
    """Append context to the cache: features [1, R, n_ctx * H] (raw target features, before fc) at positions
    [1, R]; rows whose position is PAD_POSITION are padding (written past the others, never visible, overwritten by
    the next write). The caller keeps length + R <= capacity (`StaticDraftState` checks it on the host)."""
    rows = features.shape[1]
    slots = cache.length + torch.arange(rows, device=features.device)  # [R]
    context = drafter.hidden_norm(drafter.fc(features))  # [1, R, H]
    # padding rows rotate as position 0: a RoPE that reads the largest position (longrope) then sees the real ones'
    rope_positions = positions.masked_fill(positions == PAD_POSITION, 0).clamp(
        max=drafter.config.max_position_embeddings
    )
    rope = drafter.rotary_emb(context, rope_positions)
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn._kv(context, *rope)  # [1, kv_heads, R, d] each
        cache.keys[i].index_copy_(2, slots, k)
        cache.values[i].index_copy_(2, slots, v)
    cache.positions.index_copy_(1, slots, positions)
    cache.length.add_((positions != PAD_POSITION).sum())


def block_hidden(
    drafter: DFlashDrafter, cache: StaticDrafterCache, block_embeds: torch.Tensor, anchor_position: torch.Tensor
) -> torch.Tensor:
    """The drafter's final hidden states [1, B, H] over one block: block_embeds [1, B, H] (the anchor's and the
    masks' embeddings), the anchor at anchor_position [1, 1], attending to every written context slot before it (and
    within a sliding layer's window), as `DFlashDrafter.forward` with an eager cache computes them."""
    block = block_embeds.shape[1]
    if block != cache.block:
        raise FlashdraftError(f"a block of {block} tokens; this static drafter cache was made for {cache.block}")
    scale = drafter.config.reference_option("input_embedding_scale")
    if scale != 1.0:
        block_embeds = block_embeds * scale
    query_anchor = anchor_position.expand(1, block)  # [1, B]
    query_positions = query_anchor + torch.arange(block, device=block_embeds.device)  # [1, B]
    query_block = torch.zeros(block, dtype=torch.long, device=block_embeds.device)  # [B]: one block
    block_rope = drafter.rotary_emb(block_embeds, query_positions)
    masks = {  # [1, 1, B, C + B] per kind of layer (full / sliding, causal or not)
        attention: attention_mask(query_positions, query_block, query_anchor, cache.positions, attention)
        for attention in {layer.attention for layer in drafter.layers}
    }
    x = block_embeds
    for layer in drafter.layers:
        x = layer(x, None, masks, block, block_rope=block_rope, context_rope=None, cache=cache)
    return drafter.norm(x)
