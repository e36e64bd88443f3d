"""fp16's range and a target's hidden states. Outliers in the residual stream reach past fp16's largest value (65504)
on some targets: computed or stored in fp16 they become Inf, and a drafter trained or served on them collapses
(0.06 accepted of 15 with an fp16 target, lmdeploy #4789). Captured states are checked before they are cached or
trained on, and the layer and the largest value are named."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP16_MAX = torch.finfo(torch.float16).max  # 65504


@dataclass(frozen=True)
class Overflow:
    """The first context layer whose hidden states leave fp16's range: its largest |value| (inf where the target
    itself overflowed) and the token where it is."""

    layer: int
    value: float
    token: int

    def line(self, where: str, computed_in: str) -> str:
        fix = (
            "run the target in bf16 (--target-dtype bf16)" if computed_in == "float16" else "store bf16 (--dtype bf16)"
        )
        return (
            f"{where}: hidden states of target layer {self.layer} reach {self.value:.4g} at token {self.token}, beyond "
            f"fp16's range (largest {FP16_MAX:.0f}; target computes in {computed_in}): in fp16 they are Inf and a "
            f"drafter trained on them collapses; {fix}"
        )


def fp16_overflow(features: torch.Tensor, layer_ids: list[int], hidden_size: int) -> Overflow | None:
    """`features` [T, len(layer_ids) * hidden_size] (in the dtype the target computed them): the first layer whose
    largest |value| is beyond fp16's range or not finite; None when every value fits."""
    per_layer = features.detach().reshape(features.shape[0], len(layer_ids), hidden_size).float().abs()
    per_layer = per_layer.masked_fill(per_layer.isnan(), float("inf"))  # a NaN is an overflow's aftermath
    peak, column = per_layer.max(dim=2)  # [T, layers]
    peak_of_layer, token = peak.max(dim=0)  # [layers]
    for k, layer in enumerate(layer_ids):
        if peak_of_layer[k] > FP16_MAX:
            return Overflow(layer, float(peak_of_layer[k]), int(token[k]))
    return None


def overflow_in_forward(decoder, ids: torch.Tensor) -> Overflow | None:
    """The first decoder layer whose output on `ids` [1, T] leaves fp16's range (a target computing in fp16 gives
    Inf there, then NaN logits); None if none does."""
    hidden_states = decoder(input_ids=ids, output_hidden_states=True).hidden_states  # embeddings, then each layer
    for layer, h in enumerate(hidden_states[1:]):
        overflow = fp16_overflow(h[0], [layer], h.shape[-1])
        if overflow is not None:
            return overflow
    return None
