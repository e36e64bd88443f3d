"""Drafter checkpoints in the public DFlash format, loaded strictly.

A drafter directory is `config.json` + `model.safetensors` (or shards listed in
`model.safetensors.index.json`), keys and shapes exactly as section 1 of the reference
doc. Loading never leaves a tensor randomly initialised: every missing, unexpected or
wrongly shaped tensor is an error that names it, with the shape found and expected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from flashdraft.config import DrafterConfig
from flashdraft.errors import FlashdraftError
from flashdraft.model import DFlashDrafter

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every public tensor key with its shape, derived from the config alone."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_context_layers * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}  # fmt: skip
    return shapes


def _fsync_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_drafter(model: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `config.json` + `model.safetensors` in the public format (each file atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    drift = set(state) ^ set(expected_shapes(model.config))
    if drift:  # the module and the public table must never drift apart
        raise AssertionError(f"drafter state dict keys differ from the public table: {sorted(drift)}")
    cfg = model.config.to_dict()
    cfg["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    _fsync_write(out / WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    _fsync_write(out / "config.json", lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n"))
    return out


def _weight_files(directory: Path) -> dict[str, Path]:
    """Map each tensor key to the safetensors file that holds it."""
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.exists():
        files = [single]
    elif index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise FlashdraftError(f"{index}: not a safetensors index (expected a 'weight_map' object)") from None
        files = sorted({directory / f for f in weight_map.values()})
    else:
        raise FlashdraftError(f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME}; expected the drafter's weights there")
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    where[key] = f
        except FileNotFoundError:
            raise FlashdraftError(f"{f}: listed in {INDEX_NAME} but missing") from None
        except (SafetensorError, OSError) as e:
            raise FlashdraftError(f"{f}: not a readable safetensors file (truncated or corrupt: {e})") from None
    return where


def read_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for key, f in _weight_files(directory).items():
        with safe_open(str(f), framework="pt") as sf:
            shapes[key] = tuple(sf.get_slice(key).get_shape())
    return shapes


def check_state_shapes(cfg: DrafterConfig, found: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise on the first inconsistency between found tensor shapes and the config."""
    fc = found.get("fc.weight")
    if fc is not None and len(fc) == 2:
        h = cfg.hidden_size
        if fc[1] % h:
            raise FlashdraftError(
                f"{source}: tensor 'fc.weight' has shape {list(fc)}; in_features {fc[1]} is not a multiple "
                f"of hidden_size {h}, expected [{h}, n * {h}]"
            )
        if fc[1] // h != cfg.num_context_layers:
            raise FlashdraftError(
                f"{source}: tensor 'fc.weight' has shape {list(fc)} ({fc[1] // h} context layers) but the config's "
                f"target_layer_ids {cfg.target_layer_ids} need {[h, cfg.num_context_layers * h]} "
                f"({cfg.num_context_layers} context layers)"
            )
    expected = expected_shapes(cfg)
    for key, shape in expected.items():
        if key not in found:
            raise FlashdraftError(f"{source}: tensor '{key}' is missing; expected shape {list(shape)}")
        if tuple(found[key]) != shape:
            raise FlashdraftError(f"{source}: tensor '{key}' has shape {list(found[key])}; expected {list(shape)}")
    for key in found:
        if key not in expected:
            raise FlashdraftError(
                f"{source}: unexpected tensor '{key}' with shape {list(found[key])}; "
                f"not part of a {cfg.num_hidden_layers}-layer DFlash drafter"
            )


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    """Load a drafter directory (this project's or any public DFlash drafter), strictly."""
    directory = Path(path)
    if not directory.is_dir():
        raise FlashdraftError(f"{directory}: not a directory; expected a drafter directory with config.json")
    cfg = DrafterConfig.load(directory / "config.json")
    where = _weight_files(directory)
    found = read_shapes(directory)
    check_state_shapes(cfg, found, str(directory))
    state = {}
    for key, f in where.items():
        with safe_open(str(f), framework="pt") as sf:
            state[key] = sf.get_tensor(key)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary_emb = type(model.rotary_emb)(model.rotary_emb.config)  # buffers were on meta
    return model.to(device=device, dtype=dtype).eval()
