"""Training and evaluation data: prompts, target-regenerated completions, and the
hidden-state cache the drafter trains on."""
