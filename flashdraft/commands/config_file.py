"""Run configs as data: a YAML or JSON file of a command's options (`flashdraft train --config
run.yaml`).

A file is one mapping; its keys are the command's long flag names without the dashes in front
(`target-model` or `target_model`), its values what the flag takes (YAML/JSON lists for layer
ids, true/false for switches, null for "not set"). Every value goes through the flag's own
parser, so a file is checked exactly as the command line is, and an unknown key or a bad value
is a one-line error naming the file and the key. Paths in a file are as on the command line:
relative to the working directory. Flags given on the command line override the file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flashdraft.errors import FlashdraftError

SUFFIXES = (".yaml", ".yml", ".json")


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a .yaml/.yml/.json file."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise FlashdraftError(f"{path}: expected a {', '.join(SUFFIXES)} config file, found suffix {path.suffix!r}")
    try:
        text = path.read_text()
    except OSError as e:
        raise FlashdraftError(f"{path}: cannot read the config file ({e.strerror})") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise FlashdraftError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise FlashdraftError(f"{path}: not valid YAML ({getattr(e, 'problem', None) or e}{where})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise FlashdraftError(f"{path}: found a {type(data).__name__}; expected a mapping of option names to values")
    return data


def option_actions(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> dict[str, argparse.Action]:
    """The parser's long options by key (the flag without its dashes, `-` as `_`)."""
    # argparse lists its actions only in this attribute; every option of flashdraft has one long flag
    actions = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in exclude and not isinstance(action, argparse._HelpAction):
            actions[longs[0][2:].replace("-", "_")] = action
    return actions


def _flag_value(action: argparse.Action, value: Any, where: str) -> Any:
    """`value` from a file as the flag's parser turns it into the option's value."""
    flag = action.option_strings[0]

    def bad(expected: str) -> FlashdraftError:
        return FlashdraftError(f"{where} is {value!r}; expected {expected} (as {flag} takes it)")

    if value is None:
        return action.default
    if action.nargs == 0:  # a switch (store_true)
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if action.nargs in ("*", "+"):
        items = value if isinstance(value, list) else [value]
        if action.choices is not None and any(item not in action.choices for item in items):
            raise bad(f"a list of {', '.join(map(str, action.choices))}")
        return [str(item) for item in items]
    if isinstance(value, bool):
        raise bad("a value")
    # lists as the flag writes them (layer ids 1,6,11), a mapping as JSON (--rope-scaling); numbers as text, so
    # YAML's 6e-4 (a string to YAML 1.1) and 6.0e-4 (a float) both parse
    text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
    if isinstance(value, dict):
        text = json.dumps(value)
    converted = text
    if action.type is not None:
        try:
            converted = action.type(text)
        except argparse.ArgumentTypeError as e:
            raise FlashdraftError(f"{where}: {e}") from None
        except (TypeError, ValueError) as e:
            expected = {int: "an integer", float: "a number"}.get(action.type, f"a value {flag} accepts")
            raise bad(f"{expected} ({e})") from None
    if action.choices is not None and converted not in action.choices:
        raise bad(f"one of {', '.join(map(str, action.choices))}")
    return converted


def options_from_file(
    path: str | Path, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The options a config file sets, by argparse dest, each checked by its flag's parser.
    A key the parser has no flag for (or one in `exclude`) is refused, naming the file."""
    actions = option_actions(parser, exclude)
    values = {}
    for key, value in read_mapping(path).items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            raise FlashdraftError(
                f"{path}: unknown key {key!r}; expected {parser.prog}'s options without the leading dashes: "
                f"{', '.join(k.replace('_', '-') for k in sorted(actions))}"
            )
        if action.dest in values:
            raise FlashdraftError(f"{path}: key {key!r} is given twice (with - and _ spellings)")
        values[action.dest] = _flag_value(action, value, f"{path}: key {key!r}")
    return values


def train_options(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace) -> argparse.Namespace:
    """`flashdraft train`'s options: --config's file under the flags given (which override it);
    then what is required, wherever it was given. `parser`: flashdraft's, `args`: `argv` parsed."""
    train = parser.commands["train"]
    if args.config:
        values = options_from_file(args.config, train, exclude=("config",))
        sources = [k for k in ("cached_hidden_states", "completions") if values.get(k) is not None]
        if len(sources) > 1:
            raise FlashdraftError(
                f"{args.config}: keys 'cached-hidden-states' and 'completions' are both given; "
                f"expected one (offline or online)"
            )
        train.set_defaults(**values)
        args = parser.parse_args(argv)
        other = {"cached_hidden_states": "completions", "completions": "cached_hidden_states"}
        if sources and getattr(args, other[sources[0]]) is not None:
            setattr(args, sources[0], None)  # the command line's data source replaces the file's
    missing = [flag for flag in ("--target-model", "--out") if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        train.error(f"the following arguments are required: {', '.join(missing)}, as flags or --config keys")
    if args.cached_hidden_states is None and args.completions is None:
        train.error(
            "one of the arguments --cached-hidden-states --completions is required, as a flag or a --config key"
        )
    return args
