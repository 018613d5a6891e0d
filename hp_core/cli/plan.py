"""``hp plan --model NAME_OR_CONFIG --mesh tp=8,cp=2 ...``: plan on the meta device, explain."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.text import Text

from hp_core.cli.failure import CommandFailed, command
from hp_core.cli.planning import (
    ALLOW_MISSING_HELP,
    ALLOW_MISSING_PLUGINS,
    add_planning_args,
    check_plugin_items,
    explain_roles_from_args,
    plan_from_args,
    verify_plan,
)
from hp_core.plans.yaml_io import dump_plan

__all__ = ["add_plan_command", "cmd_plan"]


def add_plan_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp plan --model NAME_OR_CONFIG --mesh tp=8,cp=2 ...``: plan on the meta device and
    explain."""
    parser = subparsers.add_parser(
        "plan",
        help="plan a model for a mesh on the meta device and print the plan",
        description=(
            "Build the model on the meta device (no weights, no processes, no process group), "
            "plan it for the mesh and print every boundary with the collectives it costs, then "
            "the collectives of one training step. Nothing is downloaded. With --verify, also "
            "run the plan verifier on meta copies of the model (an in-process fake process "
            "group of the mesh's size, so any mesh works on a laptop): exit 1 with its message "
            "if it refuses the plan."
        ),
    )
    add_planning_args(parser)
    parser.add_argument(
        "--yaml", action="store_true", help="print the plan as YAML instead of the explanation"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help=(
            "verify the plan on meta copies (hp_core.verify) and print its report; the collectives "
            "per step then count the gradient reductions it derived (exit 1 if it refuses)"
        ),
    )
    parser.add_argument(
        "--explain-roles",
        action="store_true",
        help=(
            "print why each parameter has its role: the rule that decided it, the plugin that "
            "provided the rule, its placements; then the unclaimed parameters and the fused "
            "projections under tp (exit 1 after the table if the planner refuses the model)"
        ),
    )
    parser.add_argument(ALLOW_MISSING_PLUGINS, action="store_true", help=ALLOW_MISSING_HELP)
    parser.set_defaults(handler=cmd_plan)


@command("plan")
def cmd_plan(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Plan ``--model`` for ``--mesh`` on the meta device; print ``explain()`` or the YAML plan.

    A plan naming an inner wrapper or compute factory that no installed plugin provides is
    refused with exit 2 and ``hp_core.apply``'s message (``--allow-missing-plugins``: a
    warning instead). With ``--verify``, verify it first (a refusal prints only the error and
    exits 1); the collectives per step then count the verified gradient reductions
    (``explain(report)``), and the verifier's summary follows the plan.
    """
    if args.explain_roles:
        return _explain_roles(args, out, err)
    result, model = plan_from_args(args, err)
    check_plugin_items(result, args, err, "plan")
    report = verify_plan(model, result, args.mesh, err) if args.verify else None
    if args.yaml:
        text = dump_plan(result).rstrip("\n")
        if report is not None:  # as YAML comments, so the output still loads as a plan
            text += "\n" + "\n".join(f"# {line}" for line in report.summary().split("\n"))
    else:
        text = result.explain(report)
        if report is not None:
            text = text.rstrip("\n") + "\n\n" + report.summary()
    out.print(Text(text.rstrip("\n")), soft_wrap=True)
    return 0


def _explain_roles(args: argparse.Namespace, out: Console, err: Console) -> int:
    """``--explain-roles``: the report on ``out``; a refused plan then exits 1 with its error
    on ``err`` (the table comes first: it is what explains the refusal)."""
    if args.yaml or args.verify:
        raise CommandFailed(
            2,
            "--explain-roles prints the role report only; drop --yaml/--verify (or run hp plan "
            "again without --explain-roles).",
        )
    report = explain_roles_from_args(args, err)
    out.print(Text(report.text().rstrip("\n")), soft_wrap=True)
    if report.refusal is not None:
        first = report.refusal.split("\n", 1)[0]
        raise CommandFailed(
            1, f"the planner refuses this model: {first} (the report above shows the fix)"
        )
    return 0
