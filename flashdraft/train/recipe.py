"""The recipes: the settings a run takes where the user chose none (no flag, no --config key, a TrainConfig field
left None), and which one a target gets. `TrainConfig.with_recipe` returns the copy with them filled in; the run
says which."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashdraft.target.model import TINY_DIR, resolve_target_path


@dataclass(frozen=True)
class Recipe:
    name: str
    lr: float
    num_anchors: int
    epochs: int | None  # with max_steps None: whole epochs
    max_steps: int | None

    def describe(self) -> str:
        steps = f"{self.max_steps} steps" if self.max_steps is not None else f"{self.epochs} epoch(s)"
        return f"{self.name} (lr {self.lr:g}, {self.num_anchors} anchors per sequence, {steps})"


# section 4 of the reference doc: lr 6e-4 and 512 anchors per sequence of thousands of tokens, ~800k samples
PUBLISHED_RECIPE = Recipe("the published recipe", 6e-4, 512, 1, None)
# the built-in tiny target on a CPU: few anchors per record, many steps (the demo's; docs/tiny.md). The published
# recipe on tiny's few hundred records of 256 tokens runs tens of steps and accepts nothing
TINY_RECIPE = Recipe("the tiny target's recipe", 6e-3, 8, None, 1000)


def recipe_for(target_model: str | Path) -> Recipe:
    """The tiny target's recipe for the built-in `tiny` (by name or path), the published one for any other."""
    return TINY_RECIPE if resolve_target_path(target_model).resolve() == TINY_DIR.resolve() else PUBLISHED_RECIPE
