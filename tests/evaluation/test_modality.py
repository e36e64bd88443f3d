"""τ by modality (`flashdraft.evaluation.modality`): records with images beside text-only ones."""

from types import SimpleNamespace

from flashdraft.evaluation.modality import by_modality, modality_line


def test_tau_with_images_and_text_only_side_by_side_and_none_without_images():
    records = [SimpleNamespace(num_images=1), SimpleNamespace(num_images=0), SimpleNamespace(num_images=2)]
    walked = [SimpleNamespace(acceptance_lengths=a) for a in ([1, 3], [2, 2, 2], [4])]
    figures = by_modality(SimpleNamespace(per_prompt=walked), records)
    assert figures["with_images"] == {"tau": 8 / 3, "steps": 3, "tokens": 8, "prompts": 2}
    assert figures["text_only"] == {"tau": 2.0, "steps": 3, "tokens": 6, "prompts": 1}
    line = modality_line(figures)
    assert line == "τ by modality: with images 2.667 (2 prompts, 3 steps), text only 2.000 (1 prompts, 3 steps)"
    text = [SimpleNamespace(num_images=0)]
    assert by_modality(SimpleNamespace(per_prompt=walked[:1]), text) is None and modality_line(None) is None
