"""`flashdraft demo`: the whole pipeline on the built-in tiny target (`flashdraft.demo.run_demo`)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="the whole pipeline on the built-in tiny target, in minutes on a CPU")
    p.add_argument("--out", default="demo-out", help="output directory (re-running reuses finished stages)")
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget for the whole demo")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also decode compiled (the static cache under torch.compile, against compiled greedy decoding); its "
        "first compile takes a minute or two of the budget",
    )
    return p


def run(args: argparse.Namespace) -> None:
    from flashdraft.demo import DemoSettings, run_demo

    run_demo(args.out, args.minutes, DemoSettings(compile=args.compile))
