"""How `pagedllm` flags explain themselves, as vLLM's: every help line ends with its default,
flags sit in named sections (model, cache, scheduler, ...), and `--help=SECTION` prints one
section (`--help=listgroup` names them, any other word searches flag names).

`FlagParser` is the parser of `pagedllm` and of each subcommand; it also expands
`--config FILE.yaml` (see `config_file`) before argparse reads the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Sequence

from pagedllm.entrypoints.config_file import expand_config_file

# Sections in the order `--help` prints them, after the positional arguments, the options
# (-h, --config) and any section of one subcommand's own (e.g. generate's "sampling"). The
# descriptions print under each section's title.
SECTIONS = {
    "frontend": "the OpenAI-compatible HTTP server",
    "admission": "what the server lets in: queue limits, body size, client timeouts",
    "tenants": "API keys and per-tenant limits",
    "tls": "HTTPS and client certificates",
    "model": "the model, its weights and tokenizer, and what it runs for",
    "cache": "the paged KV cache",
    "scheduler": "which requests run in each engine step",
    "parallel": "how many ranks and engine cores split the work",
    "device": "where and how the model's steps run",
    "lora": "LoRA adapters served on top of the model",
    "speculative": "speculative decoding",
    "kv-transfer": "KV beyond the pool: host-memory and disk tiers, prefill/decode disaggregation",
    "observability": "logs and statistics",
}
_LIST_GROUPS = "listgroup"


def section(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's argument group titled `title`, made (with its description) on first use,
    so the serve flags and the engine flags of one topic share one section."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, SECTIONS.get(title))


def render_default(value: object) -> str:
    """A default as a user would type it: lists as JSON (as `--allowed-origins` takes
    them), infinity as `inf`."""
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return str(value)


def shows_default(action: argparse.Action) -> bool:
    """Whether a flag's default is worth printing: None and False read as "not set", which
    the help says in words where it means more (e.g. "default: the model's"); a --x/--no-x
    switch says which of the two is the default."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return isinstance(action.default, bool)
    # Identity, not ==: a default of 0 is worth printing, False is not.
    unset = (None, False, argparse.SUPPRESS)
    if not action.option_strings or any(action.default is value for value in unset):
        return False
    # A store_true flag is off unless given.
    return action.nargs != 0


class FlagHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already says "default: ..."."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 32,
                 width: int | None = None) -> None:  # fmt: skip
        super().__init__(prog, indent_increment, max_help_position, width)

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Flag names in help (--kv-offload-dir) stay whole on one line.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # "default:" rather than "default": a help that says "by default" may speak of
        # something else than the flag's own default.
        if not shows_default(action) or "default:" in text.lower():
            return text
        # Literal text, not %(default)s, which would print repr()s of lists; argparse
        # %-formats help, so a literal % must be doubled.
        default = render_default(action.default).replace("%", "%%")
        return f"{text} (default: {default})"


def _normalize(name: str) -> str:
    name = name.lower().replace("_", "-")
    # vLLM's section names are config classes: CacheConfig, KVTransferConfig.
    return name.removesuffix("config").removesuffix("-").replace("kvtransfer", "kv-transfer")


class HelpAction(argparse.Action):
    """`-h/--help` with vLLM's optional value: a section, `listgroup`, or a word to search."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:  # fmt: skip
        super().__init__(option_strings, dest, nargs="?", default=default, metavar="SECTION",
                         help=help)  # fmt: skip

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:
            parser.print_help()
        elif values == _LIST_GROUPS:
            print("\n".join(_group_lines(parser)))
        else:
            print(_section_help(parser, values))
        parser.exit()


def _groups(parser: argparse.ArgumentParser) -> list[argparse._ArgumentGroup]:
    """The parser's non-empty sections: positionals, options and the subcommand's own
    sections as made, then the shared ones in `SECTIONS` order."""
    order = list(SECTIONS)
    groups = [group for group in parser._action_groups if group._group_actions]
    return sorted(groups, key=lambda g: order.index(g.title) + 1 if g.title in order else 0)


def _group_lines(parser: argparse.ArgumentParser) -> list[str]:
    return [f"{g.title}: {g.description}" if g.description else g.title for g in _groups(parser)]


def _section_help(parser: argparse.ArgumentParser, wanted: str) -> str:
    formatter = parser._get_formatter()
    key = _normalize(wanted)
    matches = [g for g in _groups(parser) if g.title and _normalize(g.title) == key]
    if matches:
        group = matches[0]
        formatter.start_section(group.title)
        formatter.add_text(group.description)
        formatter.add_arguments(group._group_actions)
    else:
        word = wanted.lower().lstrip("-").replace("_", "-")
        found = [
            action
            for group in _groups(parser)
            for action in group._group_actions
            if any(word in option.lower() for option in action.option_strings)
        ]
        if not found:
            names = ", ".join(g.title for g in _groups(parser))
            # No usage: it would bury the one line that matters.
            parser.exit(
                2,
                f"{parser.prog}: error: --help={wanted}: no section and no flag named like it; "
                f"sections: {names}\n",
            )
        formatter.start_section(f"flags matching {wanted!r}")
        formatter.add_arguments(found)
    formatter.end_section()
    return formatter.format_help()


class FlagParser(argparse.ArgumentParser):
    """The `pagedllm` parser: sections, defaults in help, `--help=SECTION`, `--config`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", FlagHelpFormatter)
        add_help = kwargs.pop("add_help", True)
        super().__init__(*args, add_help=False, **kwargs)
        if add_help:
            self.add_argument(
                "-h",
                "--help",
                action=HelpAction,
                help="show this help and exit; --help=SECTION shows one section "
                f"(--help={_LIST_GROUPS} lists them), --help=WORD the flags whose name has WORD",
            )

    def format_help(self) -> str:
        # Sections in SECTIONS order whatever order the flags were added in.
        groups = self._action_groups
        self._action_groups = _groups(self)
        try:
            return super().format_help()
        finally:
            self._action_groups = groups

    def parse_known_args(self, args=None, namespace=None):
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args(expand_config_file(self, list(args)), namespace)
