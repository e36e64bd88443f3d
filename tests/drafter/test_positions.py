"""A drafter trained at other positions than its target serves (`flashdraft.drafter.positions`)."""

from types import SimpleNamespace

from flashdraft.drafter.positions import position_lines
from flashdraft.target.vision import MROPE_ROW0, TOKEN_INDEX


def test_a_drafter_trained_at_the_token_index_beside_an_m_rope_target_is_warned_about_on_image_records():
    target = SimpleNamespace(position_scheme=MROPE_ROW0)
    drafters = [
        ("index", SimpleNamespace(config=SimpleNamespace(trained_positions=TOKEN_INDEX))),
        ("row0", SimpleNamespace(config=SimpleNamespace(trained_positions=MROPE_ROW0))),
        ("unrecorded", SimpleNamespace(config=SimpleNamespace(trained_positions=None))),
    ]
    images, text = [SimpleNamespace(num_images=1)], [SimpleNamespace(num_images=0)]
    lines = position_lines(drafters, target, images)
    assert len(lines) == 1 and lines[0].startswith("index: warning: positions: trained at token-index, served")
    assert position_lines(drafters, target, text) == []  # without images both schemes are the same positions
