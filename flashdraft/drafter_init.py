"""A fresh, untrained drafter shaped for a given target (`flashdraft init`)."""

from __future__ import annotations

import torch

from flashdraft.config import DEFAULT_BLOCK_SIZE, DrafterConfig, default_target_layer_ids
from flashdraft.errors import FlashdraftError
from flashdraft.model import DFlashDrafter
from flashdraft.target import TargetModel


def pick_mask_token(target: TargetModel) -> int:
    """The tokenizer's mask token, else its pad token, else an unused special token."""
    tok = target.tokenizer
    for attr in ("mask_token_id", "pad_token_id"):
        token_id = getattr(tok, attr, None)
        if token_id is not None and token_id not in target.stop_token_ids:
            return int(token_id)
    for token, token_id in sorted(tok.get_added_vocab().items(), key=lambda kv: kv[1]):
        if token_id not in target.stop_token_ids and ("unused" in token or "reserved" in token):
            return int(token_id)
    raise FlashdraftError(
        f"{target.path}: the tokenizer has no mask, pad or unused special token; give --mask-token-id"
    )


def new_drafter_for_target(
    target: TargetModel,
    num_layers: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
) -> DFlashDrafter:
    tc = target.config
    if mask_token_id is None:
        mask_token_id = pick_mask_token(target)
    elif not 0 <= mask_token_id < target.vocab_size:
        raise FlashdraftError(
            f"--mask-token-id {mask_token_id} is outside the target's vocabulary (0..{target.vocab_size - 1})"
        )
    if block_size < 2:
        raise FlashdraftError(f"--block-size {block_size}: expected at least 2 (the anchor plus one draft)")
    ids = target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)
    if target.num_layers - 1 in ids:
        raise FlashdraftError(
            f"target_layer_ids {ids} include the target's final layer {target.num_layers - 1}, whose output "
            f"produces the labels: the drafter would be fed the answer"
        )
    heads = tc.num_attention_heads
    cfg = DrafterConfig(
        hidden_size=tc.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        intermediate_size=tc.intermediate_size,
        vocab_size=target.vocab_size,
        num_target_layers=target.num_layers,
        target_layer_ids=ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=(getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 1e6),
        max_position_embeddings=tc.max_position_embeddings,
    )
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(seed)
    # The drafter's output goes through the target's LM head: start its final norm at the
    # target's, so the first logits have the target's scale (a unit norm over a tied
    # embedding gives logits far too large, and the first hundred steps only shrink them).
    final_norm = target.final_norm_weight()  # [hidden] what the target's norm multiplies by
    if final_norm is not None:
        with torch.no_grad():
            drafter.norm.weight.copy_(final_norm)
    return drafter


def copy_target_layers(drafter: DFlashDrafter, target, layer_ids: list[int]) -> None:
    """Start drafter layer j from the target's full-attention layer `layer_ids[j]` (attention,
    MLP and norms; the drafter's fc and norms stay as they are). `target` is a `TargetHead`.
    Every tensor must match the drafter's shape: a mismatch is an error, never a partial copy."""
    if len(layer_ids) != len(drafter.layers):
        raise FlashdraftError(
            f"--layers-from-target {','.join(map(str, layer_ids))}: {len(layer_ids)} target layers for a drafter "
            f"of {len(drafter.layers)} layers; expected one per drafter layer"
        )
    for j, layer_id in enumerate(layer_ids):
        own = drafter.layers[j].state_dict()
        for name, tensor in target.attention_layer_weights(layer_id).items():
            if name not in own or own[name].shape != tensor.shape:
                found = list(own[name].shape) if name in own else "no such tensor"
                raise FlashdraftError(
                    f"target layer {layer_id} '{name}' is {list(tensor.shape)}; drafter layer {j} has {found}: "
                    f"the drafter cannot start from this target layer"
                )
            with torch.no_grad():
                own[name].copy_(tensor)
