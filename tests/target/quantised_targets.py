"""Tiny quantised targets made here, data-free, as llm-compressor's data-free schemes make them: compressed-tensors'
preset scheme (W8A8: int8 weights per channel, int8 activations per token, dynamic; FP8_DYNAMIC: the same in fp8) on
every Linear but the LM head, weight scales from each row's (or group's) range (compressed-tensors'
`calculate_qparams`), then the weights compressed and saved with the config's `quantization_config`."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SCHEMES = ("W8A8", "FP8_DYNAMIC")  # also made: W4A16 (packed int4, groups of 128 columns)


def save_quantised_target(source: Path, directory: Path, scheme: str, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """`source` (a saved target) quantised with compressed-tensors' preset `scheme` on every Linear but `ignore`,
    saved as a checkpoint."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=list(ignore)
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        weight = module.weight.detach().float()  # [out, in]
        # one scale per output row (channel strategy), or per row and group of columns (group strategy, W4A16)
        groups = weight.view(weight.shape[0], -1, args.group_size) if args.group_size else weight[:, None]
        scale, zero_point = calculate_qparams(groups.amin(2), groups.amax(2), args)  # [out, groups]
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        module.weight_zero_point.data.copy_(zero_point.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return directory
