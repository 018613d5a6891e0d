"""What ``hp plan`` and ``hp freeze`` share: the planning arguments, planning on the meta
device, verifying, and refusing a plan that names registry items no plugin provides."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

# The public facade, looked up at call time: ``hp plan --verify`` runs ``hp_core.verify``
# (tests replace it there).
import hp_core
from hp_core.cli.arg_types import positive_int
from hp_core.cli.failure import CommandFailed, failing
from hp_core.cli.model_args import load_model
from hp_core.errors import HpError
from hp_core.mesh import MeshSpec, MeshSpecError
from hp_core.plan_items import check_plan_items, missing_plan_items
from hp_core.plans.example import ExampleCall, ExampleCallError, parse_example_texts
from hp_core.presets import PRESETS
from hp_core.role_report import explain_roles
from hp_core.verifier.advice import plan

__all__ = [
    "ALLOW_MISSING_HELP",
    "ALLOW_MISSING_PLUGINS",
    "add_planning_args",
    "check_plugin_items",
    "explain_roles_from_args",
    "plan_from_args",
    "verify_plan",
]

#: Plan/freeze anyway when the plan names registry items no installed plugin provides.
ALLOW_MISSING_PLUGINS = "--allow-missing-plugins"
ALLOW_MISSING_HELP = (
    "warn instead of refusing (exit 2) when the plan names an inner wrapper or compute factory "
    "that no installed plugin provides (hp_core.apply still refuses such a plan)"
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hp_core.mesh import MeshLike
_DOING = {"plan": "planning", "freeze": "freezing"}


def add_planning_args(parser: argparse.ArgumentParser) -> None:
    """The model, mesh and planning options shared by ``hp plan`` and ``hp freeze``."""
    parser.add_argument(
        "--model",
        required=True,
        metavar="NAME_OR_CONFIG",
        help=(
            f"a preset ({', '.join(PRESETS)}), a path to an HF config.json (or its folder), or "
            "pkg.mod:factory, a zero-arg callable returning the nn.Module (called on the meta "
            "device; the current directory is importable)"
        ),
    )
    parser.add_argument(
        "--mesh", required=True, help="mesh axes and sizes, e.g. tp=8,cp=2 or dp=2,tp=4"
    )
    parser.add_argument("--overrides", metavar="FILE", help="a YAML overrides file")
    parser.add_argument(
        "--sp",
        dest="sequence_parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sequence parallelism between blocks when tp > 1 (default: on)",
    )
    parser.add_argument(
        "--loss-parallel",
        action="store_true",
        help="keep the logits vocab-sharded for a parallel loss",
    )
    parser.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        metavar="N",
        help="expert-parallel size for MoE blocks (default 1)",
    )
    parser.add_argument(
        "--example",
        action="append",
        default=None,
        metavar="ARG",
        help=(
            "one argument of the training call, in order, repeatable: 'int64[2,64]' "
            "(positional) or 'NAME=int64[2,64]' / 'NAME=true' (keyword); hp plans and verifies "
            "exactly that call (default: forward(int64[1,4]))"
        ),
    )


def check_plugin_items(planned: Any, args: argparse.Namespace, err: Console, verb: str) -> None:
    """Refuse (exit 2) a plan naming registry items that are not installed; with
    ``--allow-missing-plugins`` print one warning line per missing item instead.

    The message is ``hp_core.apply``'s: the items are resolved with the function its
    preflight uses (``hp_core.injection.resolve_injection``). When every name is installed,
    the rest of what ``hp_core.plan`` checks (import paths, ``Target`` config keys) follows:
    exit 1 with apply's error.
    """
    missing = missing_plan_items(planned)
    if not missing:
        with failing(1, HpError, ValueError):
            check_plan_items(planned)
        return
    if args.allow_missing_plugins:
        for item in missing:
            err.print(
                Text(
                    f"warning: {item.one_line().rstrip('.')}; {_DOING[verb]} anyway "
                    f"({ALLOW_MISSING_PLUGINS}): hp_core.apply refuses this plan until a plugin "
                    "provides it."
                ),
                soft_wrap=True,
            )
        return
    first = missing[0].one_line()
    also = "".join(f" Also missing: {m.name!r} ({m.where})." for m in missing[1:])
    stop = "" if first.endswith(".") else "."
    raise CommandFailed(2, f"{first}{stop}{also} To {verb} anyway, pass {ALLOW_MISSING_PLUGINS}.")


def _print_hp_warnings(
    caught: list[warnings.WarningMessage], err: Console, **print_kw: Any
) -> None:
    """Print the warnings hp itself raised (e.g. a glob matching nothing) to ``err``."""
    for w in caught:
        if w.category.__module__.startswith("hp_core"):
            err.print(Text(f"warning: {w.message}"), **print_kw)


def _inputs(args: argparse.Namespace) -> tuple[MeshSpec, Any, ExampleCall | None]:
    """The parsed ``--mesh``, the ``--model`` built on meta and the ``--example`` call (usage
    errors exit 2)."""
    with failing(2, MeshSpecError, message=lambda e: f"--mesh: {e}"):
        mesh = MeshSpec.parse(args.mesh)
    if args.overrides is not None and not Path(args.overrides).is_file():
        raise CommandFailed(2, f"--overrides: {args.overrides!r}: no such file.")
    call = None
    if args.example:
        with failing(2, ExampleCallError):
            call = parse_example_texts(args.example)
    return mesh, load_model(args.model), call


def explain_roles_from_args(args: argparse.Namespace, err: Console) -> Any:
    """``hp_core.explain_roles`` for ``--model`` on ``--mesh`` with the planning options (a
    refused plan is in the report, not raised); prints hp's own warnings to ``err``."""
    mesh, model, call = _inputs(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with failing(1, ValueError):  # a malformed overrides file
            report = explain_roles(
                model,
                mesh,
                overrides=args.overrides,
                sequence_parallel=args.sequence_parallel,
                loss_parallel=args.loss_parallel,
                ep_size=args.ep,
                example_inputs=call,
            )
    _print_hp_warnings(caught, err)
    return report


def plan_from_args(args: argparse.Namespace, err: Console) -> tuple[Any, Any]:
    """Plan ``--model`` for ``--mesh`` with the planning options; returns ``(plan, model)``.

    Raises :class:`CommandFailed`; prints hp's own warnings (e.g. a glob matching nothing)
    to ``err``.
    """
    mesh, model, call = _inputs(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # PlanError and friends: every planner error is a ValueError
        with failing(1, ValueError):
            result = plan(
                model,
                mesh,
                overrides=args.overrides,
                sequence_parallel=args.sequence_parallel,
                loss_parallel=args.loss_parallel,
                ep_size=args.ep,
                check_items=False,  # check_plugin_items: exit 2, or a warning
                example_inputs=call,
            )
    _print_hp_warnings(caught, err)
    return result, model


def verify_plan(model: Any, planned: Any, mesh: DeviceMesh | MeshLike, err: Console) -> Any:
    """``hp_core.verify(model, planned, mesh)`` on the meta-device model; returns the report.

    Raises :class:`CommandFailed` (exit 1) with the refusal's message; prints hp's own
    warnings.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # VerificationError, preflight and placement errors
        with failing(1, HpError, ValueError):
            report = hp_core.verify(model, planned, mesh)
    _print_hp_warnings(caught, err, soft_wrap=True)
    return report
