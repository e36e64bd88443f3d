"""`flashdraft convert-run`: an older run's trainer.pt files rewritten as tensors alone
(`flashdraft.drafter.run_dir.convert_run`), for a run its user trusts."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "convert-run",
        help="rewrite an older run's trainer.pt files as tensors alone, so that "
        "--resume reads them without running code (only for a run you trust)",
        description="flashdraft loads a trainer.pt only as tensors and plain containers: a pickle of "
        "other objects could run any code its maker put in it, so such a run is refused. If you "
        "trust the run (you made it, or know who did), this unpickles each checkpoint's trainer.pt "
        "in full, which runs whatever the file carries, and rewrites it as tensors and plain "
        "containers (numpy values become tensors), updating checksums.json.",
    )
    p.add_argument("run", help="training run directory, or one of its checkpoints/step-NNNNNNN directories")
    return p


def run(args: argparse.Namespace) -> None:
    from flashdraft.drafter.run_dir import convert_run

    for line in convert_run(args.run):
        print(line)
