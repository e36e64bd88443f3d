"""GPU readiness: one command that runs every CUDA path of flashdraft once and measures it.

    pip install -e '.[gpu]'                    # fla kernels (docs/gpu.md: carried as wheels to a bare machine)
    python benchmarks/gpu_check.py             # one H200: 6 minutes (the engine checks, where vLLM is, on top)
    python benchmarks/gpu_check.py --dry-run   # the same code paths at tiny widths on CPU, < 1 minute
    python benchmarks/gpu_check.py --checks NAME,...   # some checks only

Each check announces itself with its time cap (past it, the check is stopped and reported and the run goes on) and
prints one JSON line as it finishes; a table closes the run. Exit 1 when a check fails or raises. The checks live
in benchmarks/gpu/, one module per family; benchmarks/gpu/registry.py lists them in order with their caps, and
says how to add one.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: the gpu package, packing.py
from gpu.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
