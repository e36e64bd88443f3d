"""The serving rules on a drafter's positions (`flashdraft.serving.positions`)."""

import json
from types import SimpleNamespace

from flashdraft.drafter.doctor_report import Checks
from flashdraft.serving.positions import mrope_fields, position_checks
from flashdraft.target.vision import MROPE_ROW0, TOKEN_INDEX


def test_m_rope_fields_are_found_wherever_a_drafter_config_carries_them():
    assert mrope_fields({"rope_scaling": {"rope_type": "default"}}) == []
    found = mrope_fields(
        {
            "rope_parameters": {"mrope_section": [2, 3, 3]},
            "mrope_interleaved": True,
            "dflash_config": {"mrope_section": 1},
        }
    )
    assert found == ["rope_parameters.mrope_section", "mrope_interleaved", "dflash_config.mrope_section"]


def test_the_served_positions_are_said_and_a_drafter_trained_at_others_fails(tmp_path):
    def run(config: dict, scheme: str) -> Checks:
        (tmp_path / "config.json").write_text(json.dumps(config))
        checks = Checks(held=True)
        position_checks(tmp_path, SimpleNamespace(position_scheme=scheme), checks)
        return checks

    assert not run({"trained_positions": MROPE_ROW0}, MROPE_ROW0).failures
    failed = run({"trained_positions": TOKEN_INDEX}, MROPE_ROW0).failures
    assert len(failed) == 1 and "M-RoPE's row 0" in failed[0] and "trained at token-index" in failed[0]
    unrecorded = run({}, TOKEN_INDEX)
    assert not unrecorded.failures and any("not recorded" in line for line in unrecorded.held)
    assert run({"rope_scaling": {"mrope_section": [1, 1, 2]}}, TOKEN_INDEX).failures  # refused beside any target
