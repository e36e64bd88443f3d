"""`flashdraft doctor PATH`: check a file or directory flashdraft made, by what it is.

Each kind of PATH has its own checker; this module only recognises the kind and
dispatches. Checkers print one line per check and return True when all pass.
"""

from __future__ import annotations

from pathlib import Path

from flashdraft.errors import FlashdraftError
from flashdraft.target import TargetModel


def kind_of(path: Path) -> str:
    """'cache' (a hidden-state cache directory), or raise naming what PATH is not."""
    from flashdraft.data.cache import MANIFEST, PROGRESS

    if path.is_dir() and ((path / MANIFEST).exists() or (path / PROGRESS).is_dir()):
        return "cache"
    if not path.exists():
        raise FlashdraftError(f"{path}: no such file or directory")
    raise FlashdraftError(f"{path}: not something doctor can check; expected a hidden-state cache directory "
                          f"(with {MANIFEST})")  # fmt: skip


def run_doctor(
    path: str | Path,
    target: TargetModel | None = None,
    layer_ids: list[int] | None = None,
    samples: int = 4,
    tolerance: float | None = None,
) -> bool:
    path = Path(path)
    if kind_of(path) == "cache":
        from flashdraft.data.cache import doctor_cache

        return doctor_cache(path, target=target, layer_ids=layer_ids, samples=samples, tolerance=tolerance)
    raise AssertionError("unreachable")
