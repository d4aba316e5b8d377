"""`--config FILE.yaml`, as vLLM's: a YAML mapping whose keys are a subcommand's flag names
(`max-num-seqs` or `max_num_seqs`) and whose values are what the command line would take.

The file becomes command-line flags, placed before the command line's own, so argparse
checks every value exactly as it checks a typed flag and a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NoReturn

import yaml

CONFIG_FLAG = "--config"


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """`--config`; only a `flag_help.FlagParser` expands it (it reads the command line)."""
    parser.add_argument(
        CONFIG_FLAG,
        action=_UnexpandedConfig,
        default=None,
        metavar="FILE.yaml",
        help="YAML file of flags: keys are flag names (max-num-seqs or max_num_seqs), values "
        "as on the command line (true/false for switches, a list for a flag that takes "
        "several); flags on the command line override it (default: none)",
    )


class _UnexpandedConfig(argparse.Action):
    """Reached only when `--config` was not expanded before parsing (an abbreviation such as
    `--conf`, or a parser that is no FlagParser): an error, not a file silently ignored."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{CONFIG_FLAG} was not read: spell it in full, {CONFIG_FLAG} FILE")


def expand_config_file(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`args` with `--config FILE` replaced by the file's flags, put after a leading
    positional (the model) and before every other argument, so the command line wins."""
    if CONFIG_FLAG not in parser._option_string_actions:
        return args
    path, rest = _split_config(parser, args)
    if path is None:
        return args
    config_argv = config_to_argv(parser, path, rest)
    if rest and not rest[0].startswith("-"):
        return [rest[0], *config_argv, *rest[1:]]
    return [*config_argv, *rest]


def _split_config(parser: argparse.ArgumentParser, args: list[str]) -> tuple[str | None, list]:
    """The `--config` value and the other arguments (nothing after a `--` is looked at)."""
    end = args.index("--") if "--" in args else len(args)
    paths, rest, i = [], [], 0
    while i < end:
        arg = args[i]
        if arg == CONFIG_FLAG:
            if i + 1 >= end:
                _fail(parser, f"{CONFIG_FLAG} needs a file")
            paths.append(args[i + 1])
            i += 2
            continue
        if arg.startswith(CONFIG_FLAG + "="):
            paths.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    if len(paths) > 1:
        _fail(parser, f"{CONFIG_FLAG} given {len(paths)} times; give one file")
    return (paths[0] if paths else None), rest + args[end:]


def load_config(parser: argparse.ArgumentParser, path: str) -> dict:
    """The file's mapping; a missing file, bad YAML or a non-mapping is a parser error."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        _fail(parser, f"{CONFIG_FLAG} {path}: {error.strerror or error}")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        _fail(parser, f"{CONFIG_FLAG} {path}: not valid YAML: {error}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        _fail(parser, f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values")
    return data


def config_to_argv(parser: argparse.ArgumentParser, path: str, cli_args: list[str]) -> list:
    """The file's flags as argv strings. Unknown keys are one error naming them all. A flag
    that adds up (`--api-key` repeated) is left to the command line when it gives it, so
    the command line replaces the file's values rather than adding to them."""
    data = load_config(parser, path)
    actions = {key: _action_for(parser, key) for key in data}
    unknown = [str(key) for key, action in actions.items() if action is None]
    if unknown:
        _fail(
            parser, f"{CONFIG_FLAG} {path}: unknown flags for `{parser.prog}`: {', '.join(unknown)}"
        )
    argv: list[str] = []
    for key, value in data.items():
        flag, action = actions[key]
        if _accumulates(action) and _given(action, cli_args):
            continue
        argv += _flag_argv(parser, path, flag, action, value)
    return argv


def _action_for(parser: argparse.ArgumentParser, key: object):
    """(flag, action) of a config key, or None for a key that is no flag of the parser."""
    if not isinstance(key, str):
        return None
    flag = "--" + key.lstrip("-").replace("_", "-")
    action = parser._option_string_actions.get(flag)
    if action is None or flag in (CONFIG_FLAG, "--help"):
        return None
    return flag, action


def _accumulates(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._AppendAction, argparse._ExtendAction))


def _given(action: argparse.Action, cli_args: list[str]) -> bool:
    return any(
        arg == option or arg.startswith(option + "=")
        for arg in cli_args
        for option in action.option_strings
    )


def _flag_argv(parser, path: str, flag: str, action: argparse.Action, value) -> list[str]:
    """One config entry as argv: switches from true/false, lists as repeated or spread
    values, mappings (e.g. speculative-config) as JSON."""
    if action.nargs == 0:
        return _switch_argv(parser, path, flag, action, value)
    if value is None:
        _fail(parser, f"{CONFIG_FLAG} {path}: {flag} needs a value, got null")
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        values = value if isinstance(value, list) else [value]
        return [flag, *(_text(v) for v in values)]
    if isinstance(value, list) and _accumulates(action):
        return [f"{flag}={_text(v)}" for v in value]
    # "=" so that a value starting with "-" stays this flag's value.
    return [f"{flag}={_text(value)}"]


def _switch_argv(parser, path: str, flag: str, action: argparse.Action, value) -> list[str]:
    if not isinstance(value, bool):
        _fail(
            parser, f"{CONFIG_FLAG} {path}: {flag} is a switch: give true or false, got {value!r}"
        )
    if isinstance(action, argparse.BooleanOptionalAction):
        positive = action.option_strings[0]
        on = value if flag == positive else not value
        return [positive if on else "--no-" + positive[2:]]
    # store_true and the like have no "off" flag: false leaves the default.
    return [flag] if value else []


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """A parser error without the usage, which would bury what is wrong with the file."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
