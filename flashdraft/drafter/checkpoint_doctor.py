"""`flashdraft doctor` on a drafter directory or a bare state dict: its config, every tensor against the shape the
config gives it, `fc` against `target_layer_ids`, and against a target its sizes and layers. The format's facts are
`drafter/checkpoint.py`'s; the report is `flashdraft.checks.Checks`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from flashdraft.checks import Checks
from flashdraft.drafter.server_fields import fields_set
from flashdraft.errors import FlashdraftError
from flashdraft.safe_load import UnsafeFileError
from flashdraft.target.model import TargetModel

NEW_DRAFTER = "train a drafter for this target (flashdraft init / flashdraft train --target-model T)"


def _describe_config(cfg) -> str:
    return (
        f"{cfg.describe_family()}, {cfg.num_hidden_layers} layers ({cfg.describe_layers()}), hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} kv heads x {cfg.head_dim}, intermediate "
        f"{cfg.intermediate_size}, vocab {cfg.vocab_size}, block size {cfg.block_size} ({cfg.describe_layout()}), "
        f"mask token "
        f"{cfg.mask_token_id}, target_layer_ids {cfg.target_layer_ids} of {cfg.num_target_layers} target layers"
    )


def _shape_problems(cfg, found: dict[str, tuple[int, ...]]) -> list[str]:
    """Every missing, mis-shaped and unexpected tensor (the loader stops at the first)."""
    from flashdraft.drafter.checkpoint import expected_shapes

    expected = expected_shapes(cfg)
    problems = [f"tensor '{k}' is missing (expected {list(v)})" for k, v in expected.items() if k not in found]
    problems += [
        f"tensor '{k}' has shape {list(found[k])}, expected {list(v)}"
        for k, v in expected.items()
        if k in found and tuple(found[k]) != v
    ]
    problems += [f"unexpected tensor '{k}' {list(v)}" for k, v in found.items() if k not in expected]
    return problems


def _fc_line(found: dict[str, tuple[int, ...]], hidden: int, layer_ids: list[int]) -> tuple[bool, str]:
    fc = found.get("fc.weight")
    if fc is None or len(fc) != 2:
        return False, f"fc.weight is {list(fc) if fc else 'missing'}; expected [{hidden}, n * {hidden}]"
    if fc[1] % hidden:
        return False, f"fc.weight {list(fc)}: in_features {fc[1]} is not a multiple of hidden size {hidden}"
    n = fc[1] // hidden
    return n == len(layer_ids), (
        f"fc.weight {list(fc)} holds {n} context layers; target_layer_ids {layer_ids} name {len(layer_ids)}"
    )


def _check_against_target(cfg, source: str, target: TargetModel | None, checks: Checks) -> None:
    if target is None:
        checks.about("no --target-model: hidden size, vocabulary and layer ids not checked against a target")
        return
    for name, found, expected in [
        ("hidden_size", cfg.hidden_size, target.hidden_size),
        ("vocab_size", cfg.vocab_size, target.vocab_size),
        ("num_target_layers", cfg.num_target_layers, target.num_layers),
    ]:
        checks.check(
            found == expected,
            f"{name} {found} "
            + ("equals" if found == expected else "differs from")
            + f" the target's {expected} ({target.path})",
            f"the drafter was made for another target; evaluate it with its own target, or {NEW_DRAFTER}",
        )
    final = target.num_layers - 1
    checks.check(
        final not in cfg.target_layer_ids and max(cfg.target_layer_ids) < target.num_layers,
        f"target_layer_ids {cfg.target_layer_ids} within the target's layers 0..{final - 1} (not the final "
        f"layer, whose output makes the labels)",
        f"{NEW_DRAFTER} with --target-layer-ids below {final}",
    )
    mask = target.tokenizer.convert_ids_to_tokens(cfg.mask_token_id) if cfg.mask_token_id < target.vocab_size else None
    checks.check(
        cfg.mask_token_id not in target.stop_token_ids,
        f"mask token {cfg.mask_token_id} ({mask!r}) is not one of the target's stop tokens {target.stop_token_ids}",
        "use an unused special token as dflash_config.mask_token_id (flashdraft init picks one)",
    )


def check_drafter_dir(path: Path, target: TargetModel | None, checks: Checks, verify: bool = True) -> None:
    """A drafter directory: config, every tensor against it, finite weights, fc against the
    layer ids, and with a target hidden size, vocabulary, layers and mask token."""
    from safetensors import safe_open

    from flashdraft.drafter.checkpoint import weight_files
    from flashdraft.drafter.config import DrafterConfig

    fix_files = "copy the drafter directory again (or re-export it)"
    try:
        cfg = DrafterConfig.load(path / "config.json")
    except FlashdraftError as e:
        checks.fail(str(e), "correct config.json (see the public DFlash drafter format)")
        return
    checks.about(f"drafter directory {path}: {_describe_config(cfg)}")
    for field, value in fields_set(json.loads((path / "config.json").read_text())):
        done = {
            "honoured": "flashdraft computes it",
            "folded": "flashdraft folds it into the weights on load (the "
            "same drafter; export writes it in its own conventions, which both servers read alike)",
        }
        checks.about(
            f"config.json sets {field.name} = {json.dumps(value)}: {field.effect}; read by "
            f"{field.read_by}; {done.get(field.handling, 'refused')}"
        )
    try:
        where = weight_files(path)
    except FlashdraftError as e:
        checks.fail(str(e), fix_files)
        return
    found, finite, dtypes = {}, [], set()
    for key, f in sorted(where.items()):
        with safe_open(str(f), framework="pt") as sf:
            tensor = sf.get_tensor(key)
        found[key] = tuple(tensor.shape)
        dtypes.add(str(tensor.dtype).removeprefix("torch."))
        if not torch.isfinite(tensor).all():
            finite.append(key)
    files = sorted(set(where.values()))
    fingerprint = ""
    if verify:
        h = hashlib.sha256()
        for f in files:
            h.update(f.read_bytes())
        fingerprint = f", weights sha256 {h.hexdigest()[:16]}"
    checks.about(
        f"{len(found)} tensors in {', '.join(f.name for f in files)} ({', '.join(sorted(dtypes))}){fingerprint}"
    )
    ok, line = _fc_line(found, cfg.hidden_size, cfg.target_layer_ids)
    checks.check(
        ok,
        line,
        "set dflash_config.target_layer_ids to the layers fc was trained on (as many as its "
        "context layers), or use the config.json that came with these weights",
    )
    problems = _shape_problems(cfg, found)
    checks.check(
        not problems,
        f"tensor names and shapes against config.json ({len(found)} tensors)"
        + (f": {len(problems)} problems: " + "; ".join(problems[:4]) if problems else ""),
        "the weights and config.json belong to different drafters; use the config.json saved with these weights",
    )
    checks.check(
        not finite,
        "weights finite" + (f": NaN/Inf in {', '.join(finite[:4])}" if finite else ""),
        "the drafter diverged or the file is damaged; use an earlier checkpoint",
    )
    _check_against_target(cfg, str(path), target, checks)


def check_state_dict(path: Path, target: TargetModel | None, checks: Checks) -> None:
    """A bare state dict: what its shapes say, and with a target whether it loads strictly."""
    from flashdraft.drafter.checkpoint import read_state_dict_file
    from flashdraft.drafter.run_dir import load_any_drafter

    try:
        state = read_state_dict_file(path)
    except UnsafeFileError:
        raise  # a file that would run code is refused outright (exit 2)
    except FlashdraftError as e:
        checks.fail(str(e), "copy the file again, or save the drafter's state_dict() with torch.save/safetensors")
        return
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    norm, fc = shapes.get("norm.weight"), shapes.get("fc.weight")
    layers = {k.split(".")[1] for k in shapes if k.startswith("layers.") and k.split(".")[1].isdigit()}
    head_dim = shapes.get("layers.0.self_attn.q_norm.weight", (None,))[0]
    q, kv = shapes.get("layers.0.self_attn.q_proj.weight"), shapes.get("layers.0.self_attn.k_proj.weight")
    heads = f"{q[0] // head_dim} / kv heads {kv[0] // head_dim}" if q and kv and head_dim else "?"
    facts = (
        f"state dict {path}: {len(shapes)} tensors ({fc and state['fc.weight'].dtype}), hidden "
        f"{norm[0] if norm else '?'}, {len(layers)} layers, head_dim {head_dim}, heads {heads}"
    )
    if fc and norm and len(fc) == 2 and fc[1] % norm[0] == 0:
        facts += f"; fc.weight {list(fc)} holds {fc[1] // norm[0]} context layers"
    checks.about(facts)
    checks.about("a bare state dict stores no vocabulary, target layer ids, mask token or block size")
    ok = bool(fc and norm and len(fc) == 2 and fc[1] % norm[0] == 0 and layers)
    checks.check(
        ok,
        "fc.weight, norm.weight and layers.* present, fc in_features a multiple of hidden",
        "this is not a DFlash drafter state dict (or a truncated one)",
    )
    if target is None:
        checks.about("no --target-model: give one to check that it loads for that target")
        return
    try:
        loaded = load_any_drafter(path, target)
    except FlashdraftError as e:
        checks.fail(str(e), f"{NEW_DRAFTER}, or pass --target-layer-ids/--mask-token-id/--block-size to eval")
        return
    checks.ok(f"loads for target {target.path}: {_describe_config(loaded.drafter.config)}")
    for note in loaded.assumed:
        checks.about(f"assumed: {note}")
    _check_against_target(loaded.drafter.config, str(path), target, checks)
