"""The drafter's positions beside its target as served (`flashdraft.target.vision`): which positions vLLM's DFlash
proposer gives the drafter, whether the drafter was trained at the same, and the M-RoPE fields a DFlash drafter must
not carry (vLLM's proposer raises on an M-RoPE drafter: `_raise_if_mrope`, "does not support M-RoPE yet"; the
speculators trainer strips `mrope_section` from DFlash configs for that reason)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flashdraft.target.vision import SCHEME_WORDS, position_scheme_of

VLLM_POSITIONS = (
    "vLLM's DFlash proposer (v1/spec_decode/dflash.py, copy_and_expand_dflash_inputs_kernel) reads the target's "
    "positions at row 0: "
)


def mrope_fields(raw: dict[str, Any]) -> list[str]:
    """Where a drafter config carries `mrope_section` (top level, RoPE scaling or parameters, dflash_config)."""
    found = []
    for name in ("rope_scaling", "rope_parameters"):
        if isinstance(raw.get(name), dict) and "mrope_section" in raw[name]:
            found.append(f"{name}.mrope_section")
    for name in ("mrope_section", "mrope_interleaved"):
        if name in raw:
            found.append(name)
    dflash = raw.get("dflash_config")
    if isinstance(dflash, dict) and "mrope_section" in dflash:
        found.append("dflash_config.mrope_section")
    return found


def position_checks(path: Path, target, checks) -> None:
    """The position rules of a drafter directory beside `target` (a TargetModel, a TargetHead or None)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # said by the format check
    mrope = mrope_fields(raw)
    checks.check(
        not mrope,
        f"positions: M-RoPE fields in the drafter config: {', '.join(mrope) or 'none'} (vLLM's DFlash proposer "
        f"refuses an M-RoPE drafter, _raise_if_mrope: 'does not support M-RoPE yet'; beside an M-RoPE target it "
        f"serves the drafter with 1-D RoPE at row 0)",
        "remove mrope_section (and mrope_interleaved) from config.json: the drafter is served with 1-D RoPE",
    )
    if target is None:
        return
    served = position_scheme_of(target)
    trained = raw.get("trained_positions")
    line = f"positions: {VLLM_POSITIONS}{SCHEME_WORDS[served]} for this target"
    if trained is None:
        checks.about(f"{line}; the drafter's trained positions are not recorded (trained elsewhere or before)")
    else:
        checks.check(
            trained == served,
            f"{line} ({served}); the drafter was trained at {trained}",
            f"retrain (or cache again) with this target: flashdraft trains at the positions it serves "
            f"({served}); after an image the two differ",
        )
