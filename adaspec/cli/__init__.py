"""The `adaspec` command: one module per subcommand, each exposing `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import textwrap

from ..errors import AdaspecError

SUBCOMMANDS = ("generate", "bench", "models", "doctor", "train_dflash", "serve", "build_suffix")


class DefaultsFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, unless the help names it already (flags
    that are off by default and options without a default say nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", action.default
        if (
            not action.option_strings
            or "default" in text.lower()
            or default in (None, False, argparse.SUPPRESS)
            or default == []
        ):
            return action.help
        return text + " (default: %(default)s)"

    # flags stay whole when lines wrap
    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
            break_on_hyphens=False,
        )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaspec",
        description="Adaptive, lossless speculative decoding for mlx-lm models.",
        formatter_class=DefaultsFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"adaspec.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"adaspec.cli.{name}":
                raise
            continue
        module.add_parser(sub)
    for p in sub.choices.values():
        add_plugin_flag(p)
        p.formatter_class = DefaultsFormatter
    return parser


def add_plugin_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a module name or a .py file) first: it registers drafters with "
        "adaspec.register_drafter (repeatable; ADASPEC_PLUGINS adds more; default: none)",
    )


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process's own command line: restart it under the tuned allocator
        _restart_tuned()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra", False):  # serve parses its own flags
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        from ..drafters import plugins
        from ..settings import get

        # a bad or unknown ADASPEC_* variable fails here, in one line
        plugins.load([*get().plugin_modules, *args.plugin])
        return int(args.func(args) or 0)
    except AdaspecError as exc:
        print(f"adaspec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _restart_tuned() -> None:
    from ..settings import get
    from .malloc import restart_tuned

    try:
        count = get().malloc_tcache
    except AdaspecError:  # a bad ADASPEC_* variable is reported below, in one line
        return
    restart_tuned(count)


if __name__ == "__main__":
    sys.exit(main())
