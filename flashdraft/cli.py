"""Command-line interface: the parser built from the command modules (`flashdraft.commands`), and
`main`, which runs one and turns its outcome into an exit status."""

from __future__ import annotations

import argparse
import sys

from flashdraft.commands import COMMANDS
from flashdraft.errors import FlashdraftError

EXIT_STATUSES = (
    "exit status: 0 done; 1 a check failed (doctor, parity); 2 a user error, a full disk (ENOSPC, EDQUOT, EFBIG) "
    "or an output another flashdraft process is writing, said on one line; 143 (SIGTERM) or 130 (SIGINT): train, "
    "generate and cache stopped gracefully after the unit in flight, their state on disk (the line says how to "
    "resume)"
)


class _Parser(argparse.ArgumentParser):
    """argparse with a user error on one line (what flashdraft promises for every user error),
    not the usage block: `flashdraft CMD --help` shows that."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flashdraft", description="Train and evaluate DFlash drafters.", epilog=EXIT_STATUSES)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices  # each command's parser (train reads --config into its own)
    for command in COMMANDS:
        command.add_parser(sub).set_defaults(func=command.run)
    return parser


def _resume_command(argv: list[str], flag: str) -> str:
    """The command line that continues a stopped run: this one (plus `flag`, e.g. --resume)."""
    import os
    import shlex

    args = list(argv) + ([flag] if flag and flag not in argv else [])
    line = "flashdraft " + shlex.join(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        line += " (under torchrun, with the same torchrun options)"
    return line


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 1 a check failed (doctor, parity); 2 a user error, a full disk or a
    held output, on one line; 143 (SIGTERM) or 130 (SIGINT): stopped gracefully, resumable."""
    from flashdraft.commands.config_file import train_options
    from flashdraft.commands.options import require_inputs
    from flashdraft.errors import Interrupted
    from flashdraft.files import DISK_FULL, disk_full_errno

    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            args = train_options(parser, argv, args)
        require_inputs(args)
        args.func(args)
    except FlashdraftError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        if str(e):
            verb = "resume" if e.resume_flag else "finish"
            print(f"stopped: {e}; {verb} with: {_resume_command(argv, e.resume_flag)}", file=sys.stderr, flush=True)
        return e.status
    except Exception as e:
        # a full disk in a writer that does not name its file itself: still one line
        code = disk_full_errno(e)
        if code is None or args.debug:
            raise
        where = getattr(e, "filename", None) or "a file being written"
        print(f"error: {where}: {DISK_FULL[code]}; free space and re-run the same command", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
