"""The ``hp`` command line: :func:`build_parser` and :func:`main` (the ``hp`` console script,
``hp_core.cli:main``) here, one module per command beside them.

* :mod:`~hp_core.cli.plugins`, :mod:`~hp_core.cli.plugin_new` (``hp plugin new``),
  :mod:`~hp_core.cli.plan`, :mod:`~hp_core.cli.freeze`, :mod:`~hp_core.cli.check`,
  :mod:`~hp_core.cli.demo` — one ``hp`` command each: an ``add_<name>_command(subparsers)``
  that declares its arguments and sets ``handler``, and the handler
  ``cmd_<name>(args, out, err)`` (two rich consoles) that returns the exit code;
* :mod:`~hp_core.cli.failure` — the error/exit skeleton every handler shares;
* :mod:`~hp_core.cli.model_args` (``--model``; :mod:`~hp_core.cli.model_factory` its
  ``pkg.mod:factory`` form), :mod:`~hp_core.cli.planning` (what plan and freeze share),
  :mod:`~hp_core.cli.arg_types` (argparse value types).

Add a command: write ``hp_core/cli/<name>.py`` with both functions and list its
``add_<name>_command`` in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TextIO

from rich.console import Console

from hp_core.cli.check import add_check_command, cmd_check
from hp_core.cli.demo import add_demo_command, cmd_demo
from hp_core.cli.failure import Handler
from hp_core.cli.freeze import add_freeze_command, cmd_freeze
from hp_core.cli.plan import add_plan_command, cmd_plan
from hp_core.cli.plugin_new import add_plugin_command, cmd_plugin_new
from hp_core.cli.plugins import add_plugins_command, cmd_plugins

__all__ = [
    "add_check_command",
    "add_demo_command",
    "add_freeze_command",
    "add_plan_command",
    "add_plugin_command",
    "add_plugins_command",
    "build_parser",
    "cmd_check",
    "cmd_demo",
    "cmd_freeze",
    "cmd_plan",
    "cmd_plugin_new",
    "cmd_plugins",
    "main",
]

#: Width used when output is not a terminal, so nothing is truncated in logs and pipes.
PIPE_WIDTH = 240

#: Subcommands in help order; add ``add_<name>_command`` functions here.
COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    add_plugins_command,
    add_plugin_command,
    add_plan_command,
    add_freeze_command,
    add_check_command,
    add_demo_command,
]


def _console(file: TextIO) -> Console:
    """A rich console on ``file``: the terminal's width, else :data:`PIPE_WIDTH`."""
    is_tty = hasattr(file, "isatty") and file.isatty()
    width = None if is_tty else PIPE_WIDTH
    return Console(file=file, width=width, highlight=False, soft_wrap=False)


def build_parser() -> argparse.ArgumentParser:
    """The ``hp`` argument parser with every subcommand in :data:`COMMANDS`."""
    try:
        hp_version = version("hp-core")
    except PackageNotFoundError:  # running from a source tree without installing
        hp_version = "unknown"
    parser = argparse.ArgumentParser(
        prog="hp",
        description=(
            "Parallelize PyTorch models over a DeviceMesh from declared sharding contracts."
        ),
    )
    parser.add_argument("--version", action="version", version=f"hp {hp_version}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hp`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return handler(args, _console(sys.stdout), _console(sys.stderr))
