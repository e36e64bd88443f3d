"""The drafter: its model, config and spellings, the family table, RoPE, init, the public checkpoint format and
run directories, the long-context guards. Uses the target wing and the shared root modules."""
