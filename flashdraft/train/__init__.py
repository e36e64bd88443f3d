"""The DFlash training recipe (section 4 of the reference doc): blocks and masks, loss, data, the loop and the run.
Uses every wing below it: evaluation (held-out τ), data, decoding, drafter, target."""
