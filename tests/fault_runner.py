"""`python -m tests.fault_runner DELAY ARGS...`: the flashdraft CLI with DELAY seconds of sleep
added to each unit of work (a generate batch, a cached record, a training micro-batch), and
5 x DELAY to each checkpoint, after its drafter is written and before its trainer state (a
window for a second signal to land inside a save).

A tiny random target does that work in milliseconds; the delay spreads a run over a few
seconds so that a kill at a random moment lands inside it (test_faults.py). Sleeping changes
no result: the files a slowed run writes are the files an unslowed one writes."""

from __future__ import annotations

import functools
import sys
import time

import flashdraft.data.cache as cache
import flashdraft.data.completers as completers
import flashdraft.drafter.run_dir as run_dir
import flashdraft.train.step as step
from flashdraft.cli import main


def slowed(fn, seconds: float):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return wrapper


def slowed_after(fn, seconds: float):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        time.sleep(seconds)
        return result

    return wrapper


if __name__ == "__main__":
    delay = float(sys.argv[1])
    completers.generate_batch = slowed(completers.generate_batch, delay)  # the name the local completer calls
    cache._cache_record = slowed(cache._cache_record, delay)
    step.forward_loss = slowed(step.forward_loss, delay)
    run_dir.save_drafter_state = slowed_after(run_dir.save_drafter_state, 5 * delay)
    sys.exit(main(sys.argv[2:]))
