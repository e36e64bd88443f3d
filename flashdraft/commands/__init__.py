"""The commands of `flashdraft`, one module each: `add_parser(sub)` declares its options and
returns its parser, `run(args)` does it. COMMANDS is their order in `flashdraft --help`."""

from flashdraft.commands import (
    bench,
    cache,
    convert_run,
    demo,
    doctor,
    eval,
    export,
    generate,
    init,
    parity,
    speculate,
    train,
)

COMMANDS = (init, speculate, generate, cache, doctor, parity, eval, bench, export, train, convert_run, demo)
