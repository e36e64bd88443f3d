"""The DFlash drafter: a few Qwen3 decoder layers whose attention takes queries from a
block of tokens and keys/values from both the target's context features and the block.

Reference: section 2 of `shared/docs/dflash-reference.md`. The parameter names and shapes
are exactly the public checkpoint format (see `checkpoint.py`); the drafter owns no
embedding and no LM head, it borrows the target's.

One forward serves inference (one block per sequence, committed context K/V cached across
steps) and training (many blocks per sequence, each seeing only context strictly before
its own anchor); the mask rule is the same in both, built by `attention_mask`.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from flashdraft.config import DrafterConfig, LayerAttention

# Position given to padding context slots: never before any anchor, so never visible.
PAD_POSITION = 1 << 40


def qwen3_config(cfg: DrafterConfig) -> Qwen3Config:
    """The transformers Qwen3 config equivalent to a drafter config (for RoPE and the MLP)."""
    return Qwen3Config(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        vocab_size=cfg.vocab_size,
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, P, head_dim]; cos/sin: [N, P, head_dim]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def attention_mask(
    query_positions: torch.Tensor,
    query_block: torch.Tensor,
    query_anchor: torch.Tensor,
    context_positions: torch.Tensor,
    attention: LayerAttention,
) -> torch.Tensor:
    """Which keys each block query may see (True = visible).

    query_positions, query_anchor: [N, Q] absolute position of each query and of its anchor
    query_block: [Q] block index of each query; context_positions: [N, C]
    returns [N, 1, Q, C + Q]: context keys strictly before the query's anchor, keys of its own
    block (a causal layer: only those at or before the query), none of another block; a
    sliding window keeps keys with |q - k| < window (section 2 of the reference doc).
    """
    sees_context = context_positions[:, None, :] < query_anchor[:, :, None]  # [N, Q, C]
    same_block = (query_block[:, None] == query_block[None, :]).expand(query_positions.shape[0], -1, -1)
    if attention.causal:
        same_block = same_block & (query_positions[:, None, :] <= query_positions[:, :, None])  # key <= query
    mask = torch.cat([sees_context, same_block], dim=-1)  # [N, Q, C + Q]
    if attention.window is not None:
        key_positions = torch.cat([context_positions, query_positions], dim=-1)  # [N, C + Q]
        distance = query_positions[:, :, None] - key_positions[:, None, :]  # [N, Q, C + Q]
        mask &= distance.abs() < attention.window
    return mask.unsqueeze(1)


def mask_mod_for(
    query_positions: torch.Tensor,
    query_block: torch.Tensor,
    query_anchor: torch.Tensor,
    context_positions: torch.Tensor,
    attention: LayerAttention,
):
    """The rule of `attention_mask` as a flex-attention mask_mod (block-sparse on GPU)."""
    num_context = context_positions.shape[1]
    key_positions = torch.cat([context_positions, query_positions], dim=1)  # [N, C + Q]
    key_block = torch.cat([query_block.new_full((num_context,), -1), query_block])  # [C + Q]
    causal, window = attention.causal, attention.window

    def mask_mod(b, h, q, kv):
        in_block = key_block[kv] == query_block[q]
        if causal:
            in_block = in_block & (key_positions[b, kv] <= query_positions[b, q])
        ok = torch.where(kv < num_context, key_positions[b, kv] < query_anchor[b, q], in_block)
        if window is not None:
            ok = ok & ((query_positions[b, q] - key_positions[b, kv]).abs() < window)
        return ok

    return mask_mod


_compiled_flex = None


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    global _compiled_flex
    if q.device.type != "cuda":  # uncompiled flex is a reference path (tests); real use is on GPU
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


class DrafterCache:
    """Committed context of the drafter, per layer: K/V after k_norm and RoPE, plus the
    positions they sit at. Only context is ever stored; a block's K/V are discarded."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # [N, C]

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=2)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=2)
        return self.keys[layer], self.values[layer]


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.layer_idx = layer_idx

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, p, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, p, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, p, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v  # [N, kv_heads, P, head_dim]

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | BlockMask | None,
        cache: DrafterCache | None,
    ) -> torch.Tensor:
        n, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *block_rope)
        k_block, v_block = self._kv(x, *block_rope)
        if context is not None:
            k_ctx, v_ctx = self._kv(context, *context_rope)
        else:
            k_ctx = v_ctx = x.new_zeros(n, self.num_kv_heads, 0, self.head_dim)
        if cache is not None:  # committed context persists; the block's K/V do not
            k_ctx, v_ctx = cache.append(self.layer_idx, k_ctx, v_ctx)
        k = torch.cat([k_ctx, k_block], dim=2)
        v = torch.cat([v_ctx, v_block], dim=2)
        if isinstance(mask, BlockMask):
            out = _flex_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, qwen3: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(cfg, layer_idx)
        self.mlp = Qwen3MLP(qwen3)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attention = cfg.layer_attention[layer_idx]

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, masks: dict, **attn_kwargs) -> torch.Tensor:
        mask = masks[self.attention]
        x = x + self.self_attn(self.input_layernorm(x), context, mask=mask, **attn_kwargs)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        qwen3 = qwen3_config(cfg)
        self.fc = nn.Linear(cfg.num_context_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, qwen3, i) for i in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3)
        # A reduced vocabulary (draft_vocab_size): an own LM head over draft ids, and d2t mapping
        # them to target ids (target id = i + d2t[i], the EAGLE-3 convention vLLM serves).
        self.lm_head = None
        if cfg.draft_vocab_size is not None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
            if cfg.draft_vocab_size < cfg.vocab_size:
                self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        # "auto": block-sparse flex attention for many-block (training) forwards on GPU, a dense
        # boolean mask otherwise; "sdpa" or "flex" force one.
        self.attention_backend = "auto"

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def init_weights(self, seed: int = 0) -> None:
        """Fresh weights for an untrained drafter (Qwen3's init: normal(0, 0.02), norms at 1)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def target_ids(self) -> torch.Tensor | None:
        """The target id of each draft-vocabulary id [draft_vocab_size]; None with the full vocabulary."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else torch.arange(d2t.shape[0], device=d2t.device) + d2t

    def vocabulary_mask(self) -> torch.Tensor | None:
        """[V] bool: the target ids this drafter can draft (None: all of them)."""
        target_ids = self.target_ids()
        if target_ids is None:
            return None
        mask = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=target_ids.device)
        mask[target_ids] = True
        return mask

    def logits(self, hidden: torch.Tensor, target_lm_head) -> torch.Tensor:
        """The drafter's logits over the target's vocabulary [..., V] from its hidden states [..., H]:
        its own LM head if it has one (draft ids mapped through d2t; target ids outside the draft
        vocabulary get -inf), else the target's; then the reference's output_multiplier and
        final_logit_softcapping."""
        logits = (self.lm_head or target_lm_head)(hidden)
        multiplier = self.config.reference_option("output_multiplier")
        if multiplier != 1.0:
            logits = logits * multiplier
        cap = self.config.reference_option("final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / cap) * cap
        target_ids = self.target_ids()
        if target_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., target_ids] = logits
        return full

    def new_cache(self) -> DrafterCache:
        return DrafterCache(len(self.layers))

    def forward(
        self,
        block_embeds: torch.Tensor,
        anchor_positions: torch.Tensor,
        context_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        cache: DrafterCache | None = None,
    ) -> torch.Tensor:
        """Hidden states of the block positions, after the final norm (feed to the LM head).

        block_embeds: [N, K * b, H] target embeddings of K blocks of b tokens each (anchor, masks...)
        anchor_positions: [N, K] absolute position of each block's anchor
        context_features: [N, C, n_ctx * H] concatenated target layer outputs (raw, before fc)
        context_positions: [N, C] their positions (PAD_POSITION for padding)
        cache: committed context from earlier calls; the new context is appended to it.
        """
        n, q_len, _ = block_embeds.shape
        num_blocks = anchor_positions.shape[1]
        scale = self.config.reference_option("input_embedding_scale")
        if scale != 1.0:
            block_embeds = block_embeds * scale
        b = q_len // num_blocks
        offsets = torch.arange(b, device=block_embeds.device)
        query_anchor = anchor_positions.repeat_interleave(b, dim=1)  # [N, Q]
        query_positions = query_anchor + offsets.repeat(num_blocks)  # [N, Q]
        query_block = torch.arange(num_blocks, device=block_embeds.device).repeat_interleave(b)  # [Q]

        context = None
        context_rope = None
        if context_features is not None:
            context = self.hidden_norm(self.fc(context_features))  # [N, C, H]
            context_rope = self.rotary_emb(context, context_positions.clamp(max=self.config.max_position_embeddings))
        all_context_positions = context_positions
        if cache is not None:
            new = context_positions if context_positions is not None else anchor_positions.new_zeros(n, 0)
            cache.positions = new if cache.positions is None else torch.cat([cache.positions, new], dim=1)
            all_context_positions = cache.positions
        if all_context_positions is None:
            all_context_positions = anchor_positions.new_zeros(n, 0)

        block_rope = self.rotary_emb(block_embeds, query_positions)
        backend = self.attention_backend
        if backend == "auto":
            backend = "flex" if block_embeds.is_cuda and num_blocks > 1 else "sdpa"
        masks = {}
        # Drafting one block after committed context (decoding): in a full non-causal layer every key
        # is visible to every query, so no mask; building one and masking costs ~10% of a CPU drafting step.
        sees_all = (
            backend == "sdpa"
            and num_blocks == 1
            and bool((all_context_positions < anchor_positions).all())
        )  # fmt: skip
        for attention in {layer.attention for layer in self.layers}:
            if sees_all and attention.window is None and not attention.causal:
                masks[attention] = None
            elif backend == "flex":
                rule = mask_mod_for(query_positions, query_block, query_anchor, all_context_positions, attention)
                num_keys = all_context_positions.shape[1] + q_len
                masks[attention] = create_block_mask(rule, n, None, q_len, num_keys, device=block_embeds.device)
            else:
                masks[attention] = attention_mask(
                    query_positions, query_block, query_anchor, all_context_positions, attention
                )
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, masks, block_rope=block_rope, context_rope=context_rope, cache=cache)
        return self.norm(x)
