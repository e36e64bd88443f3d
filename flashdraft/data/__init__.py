"""Training and evaluation data: prompts, the target's own completions and the hidden-state cache the drafter
trains on. Uses the serving (engine), decoding (sampling rules), drafter and target wings."""
