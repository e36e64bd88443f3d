"""A drafter's trained positions against the ones its target serves (`flashdraft.target.vision`): where the records
evaluated hold images, a drafter trained at other positions drafts at positions it never saw (`eval` says so;
`doctor --serving` fails it, `flashdraft.serving.positions`)."""

from __future__ import annotations

from typing import Any

from flashdraft.target.vision import SCHEME_WORDS, position_scheme_of


def position_lines(drafters: list[tuple[str, Any]], target, records: list) -> list[str]:
    """A warning for each (label, drafter) trained at positions other than those this target serves, where the
    evaluated records hold images (elsewhere the two schemes are the same positions)."""
    if not any(getattr(r, "num_images", 0) for r in records):
        return []
    served, lines = position_scheme_of(target), []
    for label, drafter in drafters:
        cfg = getattr(drafter, "config", None) or getattr(getattr(drafter, "drafter", None), "config", None)
        trained = getattr(cfg, "trained_positions", None)
        if trained is not None and trained != served:
            lines.append(
                f"{label}: warning: positions: trained at {trained}, served (and evaluated here) at {served} "
                f"({SCHEME_WORDS[served]}); on records with images it drafts at positions it was not trained at; "
                f"fix: train it again beside this target (flashdraft trains at the served positions)"
            )
    return lines
