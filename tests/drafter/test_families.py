"""The family table: a made-up fourth family, added as a table entry and its model class only, is parsed, made, saved,
loaded and evaluated by every path that reads the table."""

from __future__ import annotations

import json

import pytest
import torch

from flashdraft.decoding.hybrid import HybridDrafter
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.drafter import families
from flashdraft.drafter.checkpoint import load_drafter, save_drafter
from flashdraft.drafter.config import DrafterConfig
from flashdraft.drafter.families import FAMILIES, Family, drafts_per_block, family_of
from flashdraft.drafter.init import DrafterChoices, new_drafter_for_target
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.offline import evaluate_offline
from flashdraft.evaluation.run import records_from_prompts
from tests.conftest import DFLASH2, make_drafter, make_drafter_config, make_target


class ToyDrafter(DFlashDrafter):
    """The toy family's model: the DFlash drafter with its logits halved (a module of its own, no new tensors)."""

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        return super().logits(hidden, lm_head) / 2


# anchor-first like DSpark but another block, so a path that asks "is this DSpark?" instead of the table fails
TOY = Family("toy", "Toy", "ToyDraftModel", 5, first_draft_position=0, aliases=("ToyDrafterLegacy",), model=ToyDrafter)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", TOY)
    return TOY


def test_every_family_has_one_architecture_and_the_names_it_is_read_by():
    names = families.architectures()
    assert names == {
        "DFlashDraftModel": "dflash",
        "DFlash2DraftModel": "dflash2",
        "Qwen3DSparkModel": "dspark",
        "DSparkDraftModel": "dspark",
    }
    assert [f.default_block_size for f in FAMILIES.values()] == [16, 8, 7]
    # a config without block_size reads the family's default block, the block init makes (DFlash2: the published 8)
    for overrides in ({}, DFLASH2, {"family": "dspark", "markov_rank": 4}):
        raw = make_drafter_config(**overrides).to_dict()
        raw.pop("block_size")
        raw["dflash_config"].pop("block_size", None)
        cfg = DrafterConfig.from_dict(raw)
        assert cfg.block_size == FAMILIES[cfg.family].default_block_size
    with pytest.raises(FlashdraftError, match=r"'architectures' is \['Eagle3'\]; expected \[\"DFlashDraftModel\"\]"):
        families.by_architectures(["Eagle3"], "config.json")


def test_which_family_is_read_alike_from_a_config_a_drafter_a_hybrid_and_a_baseline():
    drafter = make_drafter(family="dspark", markov_rank=4, block_size=7)
    hybrid = HybridDrafter(drafter, NGramProposer(64))
    assert family_of(drafter.config) == family_of(drafter) == family_of(hybrid) == "dspark"
    assert family_of(NGramProposer(64)) is None
    assert drafts_per_block(hybrid, 7) == 7 and drafts_per_block(make_drafter(), 8) == 7
    assert drafts_per_block(NGramProposer(64), 8) == 7  # the n-gram baseline drafts the fill-in way


def test_a_fourth_family_is_parsed_made_saved_loaded_and_evaluated_from_its_table_entry(toy, tmp_path):
    # config: the architecture (and its alias) names the family; its default block and layout are the entry's
    raw = make_drafter_config().to_dict()
    raw.pop("block_size")
    raw["dflash_config"].pop("block_size", None)
    for name in ("ToyDraftModel", "ToyDrafterLegacy"):
        cfg = DrafterConfig.from_dict(raw | {"architectures": [name]})
        assert cfg.family == "toy" and cfg.block_size == 5 and cfg.drafts_per_block == 5
        assert cfg.architecture == "ToyDraftModel" and cfg.describe_layout().startswith("anchor-first")
    # init: the family's model class, with its default block
    target = make_target("qwen3")
    drafter = new_drafter_for_target(target, choices=DrafterChoices(family="toy"))
    assert type(drafter) is ToyDrafter and drafter.config.block_size == 5
    # save and load by the architecture name
    save_drafter(drafter, tmp_path / "toy")
    assert json.loads((tmp_path / "toy" / "config.json").read_text())["architectures"] == ["ToyDraftModel"]
    loaded = load_drafter(tmp_path / "toy")
    assert type(loaded) is ToyDrafter and loaded.config.family == "toy"
    saved, read = drafter.state_dict(), loaded.state_dict()
    assert saved.keys() == read.keys() and all(torch.equal(saved[k], read[k]) for k in saved)
    # eval: every position of the block drafts (anchor-first), the model's own logits propose
    records = records_from_prompts(target, [("r0", [3, 7, 11, 5, 9])], 12)
    result = evaluate_offline(loaded, target, records)
    assert result.drafts_per_block == 5 and len(result.position_acceptance) == 5
    assert result.num_steps > 0
