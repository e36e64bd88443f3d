"""`python -m tests.fault_runner DELAY ARGS...`: the flashdraft CLI with DELAY seconds of sleep
added to each unit of work (a generate batch, a cached record, a training micro-batch).

A tiny random target does that work in milliseconds; the delay spreads a run over a few
seconds so that a kill at a random moment lands inside it (test_faults.py). Sleeping changes
no result: the files a slowed run writes are the files an unslowed one writes."""

from __future__ import annotations

import functools
import sys
import time

import flashdraft.data.cache as cache
import flashdraft.data.completions as completions
import flashdraft.train.loop as loop
from flashdraft.cli import main


def slowed(fn, seconds: float):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return wrapper


if __name__ == "__main__":
    delay = float(sys.argv[1])
    completions.generate_batch = slowed(completions.generate_batch, delay)
    cache._cache_record = slowed(cache._cache_record, delay)
    loop.forward_loss = slowed(loop.forward_loss, delay)
    sys.exit(main(sys.argv[2:]))
