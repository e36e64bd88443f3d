"""The DFlash training recipe (section 4 of the reference doc): blocks and masks, loss,
data, checkpoints, distributed set-up, and the loop that composes them."""
