"""gpu_check's checks, one module per family, run by `python benchmarks/gpu_check.py` (docs/gpu.md#check).

- registry.py: `CHECKS`, every check in the order it runs with its cap, its cases and its closing-table figure;
  adding a check is one function and one entry there (its docstring says how). `CAPS`, `CORE_SECONDS`.
- runner.py: the command: caps (`time_cap`), one JSON line per row, the closing table, the exit code.
- shapes.py: the published shapes and --dry-run's tiny ones (`Widths`: `GPU`, `DRY`).
- models.py, timing.py: the targets, drafters and synthetic records the checks build; timing on the device.
- parity.py: linear_attention_parity. verify_cost.py: target_verify_cost. decoding_loop.py: spec_loop_overhead.
- tiny_pipeline.py: tiny_decode. trees.py: draft_tree, draft_tree_hybrid. matmul.py: matmul_rate.
- training.py: flex_vs_dense, train_step (1 and 2 processes), packing.
- engine.py: served, bench, engine_capture, engine_feed (vLLM).
"""
