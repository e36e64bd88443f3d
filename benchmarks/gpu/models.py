"""The models and data the checks build: the Qwen3.6-27B-shaped target slice, a target lending only its embedding
and LM head, random DFlash drafters drawn on the device, and synthetic cached records and batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

from flashdraft.drafter.config import DrafterConfig
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.target.model import TargetModel
from flashdraft.train.data import BatchSpec, make_batch

from .shapes import BLOCK, Widths


def build_slice(widths: Widths, device: torch.device) -> TargetModel:
    """The target slice with random weights, built on the device (fp32)."""
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(
        num_hidden_layers=len(widths.slice["layer_types"]), eos_token_id=widths.slice["vocab_size"] - 2, **widths.slice
    )
    with device:
        model = Qwen3_5ForCausalLM(cfg)
    return TargetModel(model.float(), tokenizer=None, path=None)


def embedding_target(hidden: int, vocab: int, device: torch.device) -> TargetModel:
    """A one-layer Qwen3 with the real hidden size and vocabulary: training borrows only its
    embedding and LM head. bf16 on GPU, as `flashdraft train` loads a target there."""
    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=hidden,
        vocab_size=vocab,
        num_hidden_layers=1,
        intermediate_size=hidden,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=1,
        head_dim=128,
    )
    with device:
        model = Qwen3ForCausalLM(cfg)
    return TargetModel(model.to(torch.bfloat16 if device.type == "cuda" else torch.float32), None, None)


def new_drafter(fields: dict, device: torch.device, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A random DFlash drafter built on the device: on a GPU drawn there as `init_weights` draws (normal(0, 0.02),
    norms at 1), whose CPU generator takes many seconds for the 1-2 B parameters of the published shapes."""
    with device:
        drafter = DFlashDrafter(DrafterConfig(block_size=BLOCK, **fields))
    if device.type == "cpu":
        drafter.init_weights(seed=0)
    else:
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    return drafter.to(device=device, dtype=dtype)


@dataclass
class SyntheticRecord:  # what `make_batch` reads from a cached record
    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool
    context_features: torch.Tensor  # [T, n * H]
    target_topk: None = None


def synthetic_batch(cfg: DrafterConfig, widths: Widths, device: torch.device, seed: int = 0):
    """One training batch of one sequence: random tokens, the first eighth prompt, random features."""
    gen = torch.Generator().manual_seed(seed)
    t = widths.seq_len
    record = SyntheticRecord(
        torch.randint(0, cfg.vocab_size - 1, (t,), generator=gen),
        torch.arange(t) >= t // 8,
        torch.randn(t, cfg.num_context_layers * cfg.hidden_size, generator=gen),
    )
    return make_batch(
        [record],
        [0],
        0,
        batch_spec=BatchSpec(
            seed=seed, num_anchors=widths.num_anchors, block_size=BLOCK, mask_token_id=cfg.mask_token_id
        ),
    ).to(device)


def synthetic_records(cfg: DrafterConfig, lengths: list[int], prompt: int | None = None, seed: int = 0) -> list:
    """Records of these lengths: random tokens and features, the first `prompt` tokens (None: an eighth) the prompt."""
    gen = torch.Generator().manual_seed(seed)
    return [
        SyntheticRecord(
            torch.randint(0, cfg.vocab_size - 1, (t,), generator=gen),
            torch.arange(t) >= (t // 8 if prompt is None else prompt),
            torch.randn(t, cfg.num_context_layers * cfg.hidden_size, generator=gen),
        )
        for t in lengths
    ]
