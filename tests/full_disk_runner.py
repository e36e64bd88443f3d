"""`python -m tests.full_disk_runner PLAN.json RESULTS.json`: run each flashdraft command of PLAN
(a list of {"name", "argv", "limit"}) in this one process, each under its own file-size limit
(RLIMIT_FSIZE = limit bytes), and write {name: {"rc", "stdout", "stderr"}} to RESULTS.

A write that would take a file past the limit fails with EFBIG, what a full filesystem or quota
(ENOSPC, EDQUOT) gives a writer, on any machine and without root: SIGXFSZ, which would kill the
process instead, is ignored. One process for all commands pays Python's and torch's start-up
once (test_faults.py)."""

from __future__ import annotations

import contextlib
import io
import json
import resource
import signal
import sys
import traceback

from flashdraft.cli import main

if __name__ == "__main__":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    plan = json.loads(open(sys.argv[1]).read())
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    results = {}
    for command in plan:
        out, err = io.StringIO(), io.StringIO()
        resource.setrlimit(resource.RLIMIT_FSIZE, (command["limit"], hard))
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = main(command["argv"])
                except SystemExit as e:
                    rc = e.code
                except BaseException:  # what a user would see: a traceback and exit 1
                    traceback.print_exc()
                    rc = 1
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        results[command["name"]] = {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
