"""The drafter families flashdraft builds, one entry each: every fact that differs between them and is not a
module size (those are `DrafterConfig` fields). Config, init, eval, the serving checks and export read it; a new
family is an entry here and, where it adds modules, its model class.

Facts read from vLLM 0.33.0 (`models/registry.py`, `qwen3_dflash.py`, `qwen3_dflash2.py`, `qwen3_dspark.py`),
SGLang 0.5.23 (`models/dflash.py`, `models/dspark.py`) and the published checkpoints (reference doc section 8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashdraft.errors import FlashdraftError


@dataclass(frozen=True)
class Family:
    name: str  # DrafterConfig.family, init --family
    title: str  # how READMEs and messages name it
    architecture: str  # the `architectures` entry written, which the servers build the drafter from
    default_block_size: int  # a fresh drafter's block, and a config's without block_size
    # the block position of the first draft: 1 in the fill-in layout (position k drafts the token at anchor + k, the
    # anchor drafts nothing), 0 in the anchor-first one (position k drafts the token after anchor + k)
    first_draft_position: int = 1
    aliases: tuple[str, ...] = ()  # other `architectures` entries read as this family, never written
    # vLLM --speculative-config method, and whether vLLM serves it only on its V2 model runner (the command pins it)
    vllm_method: str = "dflash"
    v2_runner_only: bool = False
    # SGLang --speculative-algorithm and the flag given the block (anchor included)
    sglang_algorithm: str = "DFLASH"
    sglang_block_flag: str = "--speculative-num-draft-tokens"
    model: type | None = None  # the drafter's module class; None: flashdraft.drafter.model.DFlashDrafter

    def drafts_per_block(self, block_size: int) -> int:
        """Tokens one block of `block_size` drafts: block_size - 1 (fill-in) or block_size (anchor-first)."""
        return block_size - self.first_draft_position


FAMILIES: dict[str, Family] = {
    # the first public drafters: 16 usual (8 and 10 exist)
    "dflash": Family("dflash", "DFlash", "DFlashDraftModel", 16),
    # the published DFlash2 drafter's block (z-lab/Qwen3.8-27B-DFlash2 dflash_config.block_size 8)
    "dflash2": Family("dflash2", "DFlash2", "DFlash2DraftModel", 8, v2_runner_only=True),
    # DSpark (DeepSeek, DeepSpec): the anchor-first block of the paper (gamma 7: the anchor and 6 masks, all 7
    # drafting); SpecForge's DSparkDraftModel, which vLLM 0.33.0's registry maps to its DeepSeek-V4 DSpark (the Qwen3
    # one is Qwen3DSparkModel, which SGLang 0.5.23 also builds), is read as it
    "dspark": Family(
        "dspark",
        "DSpark",
        "Qwen3DSparkModel",
        7,
        first_draft_position=0,
        aliases=("DSparkDraftModel",),
        vllm_method="dspark",
        sglang_algorithm="DSPARK",
        sglang_block_flag="--speculative-dspark-block-size",
    ),
}
DEFAULT_FAMILY = "dflash"  # a config without `architectures`, as the first public drafters
DEFAULT_BLOCK_SIZE = FAMILIES[DEFAULT_FAMILY].default_block_size  # also a proposer's without a drafter (n-gram)


def family(name: str) -> Family:
    """The entry of family `name` (DrafterConfig.family)."""
    return FAMILIES[name]


def architectures() -> dict[str, str]:
    """Family name by every `architectures` entry read: each family's own, then the aliases."""
    own = {f.architecture: f.name for f in FAMILIES.values()}
    return own | {alias: f.name for f in FAMILIES.values() for alias in f.aliases}


def by_architectures(value: Any, source: str) -> str:
    """The family a config's `architectures` list names (absent: the default family)."""
    if value is None:
        return DEFAULT_FAMILY
    known = architectures()
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and value[0] in known:
        return known[value[0]]
    names = " or ".join(f'["{n}"]' for n in known)
    raise FlashdraftError(
        f"{source}: field 'architectures' is {value!r}; expected {names} (the drafter families flashdraft builds)"
    )


def family_of(x: Any) -> str | None:
    """Which family this is: of a `DrafterConfig`, a drafter (its config), a hybrid (its drafter) or a proposer (the
    family it drafts as now: a DFlash2 drafter without its selector drafts as DFlash, a hybrid's n-gram proposal as
    none); None without a drafter (the n-gram baseline)."""
    if hasattr(x, "family"):
        return x.family
    if hasattr(x, "config"):
        return family_of(x.config)
    if hasattr(x, "drafter"):
        return family_of(x.drafter)
    return None


def drafts_per_block(x: Any, block_size: int) -> int:
    """Drafts a block of `block_size` holds for `x` (anything `family_of` reads; without a family: the fill-in
    layout, as the n-gram baseline drafts)."""
    name = family_of(x)
    return FAMILIES[name].drafts_per_block(block_size) if name is not None else block_size - 1
