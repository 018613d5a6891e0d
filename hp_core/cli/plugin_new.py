"""``hp plugin new NAME [--dir DIR] [--architecture ARCH] [--force]``: start a plugin.

Writes the installable skeleton of :mod:`hp_core.scaffold` into ``DIR/hp-plugin-NAME/``
and prints what it wrote and the next three commands. (``hp plugins`` lists installed
plugins; ``hp plugin`` groups the commands that work on one plugin's source.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.text import Text

from hp_core.cli.failure import command, failing
from hp_core.scaffold import ScaffoldError, write_skeleton

__all__ = ["add_plugin_command", "cmd_plugin_help", "cmd_plugin_new"]


def add_plugin_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp plugin new NAME``: generate a plugin skeleton."""
    parser = subparsers.add_parser(
        "plugin",
        help="work on a plugin's source: `hp plugin new NAME` starts one",
        description="Commands for writing an hp plugin (hp plugins lists installed ones).",
    )
    parser.set_defaults(handler=cmd_plugin_help, plugin_parser=parser)
    actions = parser.add_subparsers(title="plugin commands", metavar="ACTION")
    new = actions.add_parser(
        "new",
        help="generate an installable plugin skeleton that passes hp's conformance suite",
        description=(
            "Write DIR/hp-plugin-NAME/: a pyproject with the hp_core entry point, the "
            "hp_core.items table and a compatible hp-core range; src/hp_plugin_NAME with "
            "py.typed and a hook module registering architecture-scoped role rules; tests "
            "running hp's conformance suite (with an equivalence case on a tiny model) and a "
            "README. Then: pip install -e DIR/hp-plugin-NAME && python -m pytest "
            "DIR/hp-plugin-NAME/tests."
        ),
    )
    new.add_argument("name", metavar="NAME", help="plugin name: lowercase, e.g. my_gpt")
    new.add_argument(
        "--dir",
        type=Path,
        default=Path("."),
        help="folder to create hp-plugin-NAME/ in (default: the current folder)",
    )
    new.add_argument(
        "--architecture",
        default=None,
        metavar="ARCH",
        help=(
            "model class the rules are scoped to, e.g. GPT2LMHeadModel (default: the tiny "
            "model the skeleton ships)"
        ),
    )
    new.add_argument(
        "--force",
        action="store_true",
        help="overwrite the skeleton's files in an existing hp-plugin-NAME/",
    )
    new.set_defaults(handler=cmd_plugin_new)


@command("plugin")
def cmd_plugin_help(args: argparse.Namespace, out: Console, err: Console) -> int:
    """``hp plugin`` without an action: print its help, exit 2."""
    err.print(Text(args.plugin_parser.format_help()), soft_wrap=True)
    return 2


@command("plugin new")
def cmd_plugin_new(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Write the skeleton; usage errors (bad name, existing folder) exit 2."""
    with failing(2, ScaffoldError, message=str):
        root, files = write_skeleton(
            args.name, args.dir, architecture=args.architecture, force=args.force
        )
    out.print(Text(f"hp plugin new: wrote {root}/ ({len(files)} files)"), soft_wrap=True)
    for path in files:
        out.print(Text(f"  {path.relative_to(root)}"), soft_wrap=True)
    out.print(Text("next:"))
    for line in (
        f"pip install -e {root}",
        "hp plugins",
        f"python -m pytest {root / 'tests'}",
    ):
        out.print(Text(f"  {line}"), soft_wrap=True)
    return 0
