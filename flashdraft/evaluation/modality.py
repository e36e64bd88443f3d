"""τ by modality: the conversations with images beside the text-only ones, in every eval report where the records
evaluated hold any image (a vision-language target, `flashdraft.target.vision`). A drafter sees an image only
through the target's hidden states at its placeholders; how much acceptance it keeps on image turns is what this
figure says."""

from __future__ import annotations

from typing import Any

MODALITIES = ("with_images", "text_only")


def by_modality(result, records: list) -> dict[str, Any] | None:
    """τ, steps, tokens and prompts of the records with images and of those without (None: no record has one)."""
    if not any(getattr(r, "num_images", 0) for r in records):
        return None
    counts = {name: [0, 0, 0] for name in MODALITIES}  # [prompts, steps, tokens committed]
    for record, walked in zip(records, result.per_prompt, strict=True):
        row = counts["with_images" if getattr(record, "num_images", 0) else "text_only"]
        row[0] += 1
        row[1] += len(walked.acceptance_lengths)
        row[2] += sum(walked.acceptance_lengths)
    return {
        name: {"tau": tokens / steps if steps else None, "steps": steps, "tokens": tokens, "prompts": prompts}
        for name, (prompts, steps, tokens) in counts.items()
    }


def modality_line(figures: dict[str, Any] | None) -> str | None:
    """One line: τ with images and text-only, side by side."""
    if not figures:
        return None
    parts = []
    for name in MODALITIES:
        f = figures[name]
        tau = "-" if f["tau"] is None else f"{f['tau']:.3f}"
        parts.append(f"{name.replace('_', ' ')} {tau} ({f['prompts']} prompts, {f['steps']} steps)")
    return "τ by modality: " + ", ".join(parts)
