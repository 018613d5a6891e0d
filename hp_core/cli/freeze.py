"""``hp freeze --model ... --mesh ... -o ARTIFACT``: plan and write a signed artifact."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.text import Text

# The package, looked up at call time: tests replace its functions there.
import hp_core.artifact as artifacts
from hp_core.cli.failure import CommandFailed, command, failing
from hp_core.cli.planning import (
    ALLOW_MISSING_HELP,
    ALLOW_MISSING_PLUGINS,
    add_planning_args,
    check_plugin_items,
    plan_from_args,
)

__all__ = ["add_freeze_command", "cmd_freeze"]


def add_freeze_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp freeze --model ... --mesh ... -o ARTIFACT``: plan and write a signed artifact."""
    parser = subparsers.add_parser(
        "freeze",
        help="plan a model for a mesh and write the plan as a signed artifact",
        description=(
            "Plan the model on the meta device (as hp plan does) and write the frozen plan, the "
            "inputs that produced it (model digest, mesh, overrides, hp and plugin versions) and "
            "a sha256 signature over both to ARTIFACT: canonical JSON, written atomically. "
            "Freezing the same inputs twice gives identical bytes. See docs/artifacts.md."
        ),
    )
    add_planning_args(parser)
    parser.add_argument(
        "-o", "--output", required=True, metavar="ARTIFACT", help="the artifact file to write"
    )
    parser.add_argument(ALLOW_MISSING_PLUGINS, action="store_true", help=ALLOW_MISSING_HELP)
    parser.set_defaults(handler=cmd_freeze)


@command("freeze")
def cmd_freeze(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Plan, freeze, sign and write ``--output``; exit 1 for planning/freezing problems, 2 for
    usage and for a plan naming registry items no installed plugin provides (unless
    ``--allow-missing-plugins``)."""
    target = Path(args.output)
    if target.is_dir() or not target.parent.is_dir():
        why = "is a directory" if target.is_dir() else "its folder does not exist"
        raise CommandFailed(
            2, f"-o/--output: {args.output!r}: {why}; name the artifact file to write."
        )
    result, model = plan_from_args(args, err)
    check_plugin_items(result, args, err, "freeze")
    with failing(1, artifacts.FreezeError, message=lambda e: f"FreezeError: {e}"):
        artifact = artifacts.make_artifact(result, model=model, overrides=args.overrides)
    with failing(1, OSError, message=lambda e: f"cannot write {args.output!r}: {e}"):
        artifacts.write_artifact(artifact, target)
    injected = len(artifact.meta["injections"])
    out.print(
        Text(
            f"hp freeze: wrote {args.output}: {len(result)} modules, {injected} with injections, "
            f"mesh {artifact.inputs['mesh']}, signature {artifact.signature}"
        ),
        soft_wrap=True,
    )
    return 0
