"""The ``hp`` command line.

Each subcommand is one ``add_<name>_command(subparsers)`` function that declares its
arguments and sets ``handler``; a handler takes ``(args, out, err)`` (two rich
consoles) and returns the exit code. ``main`` wires them together.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from hp_core.plugins import RegisteredItem

__all__ = [
    "add_plan_command",
    "add_plugins_command",
    "build_parser",
    "cmd_plan",
    "cmd_plugins",
    "main",
]

Handler = Callable[[argparse.Namespace, Console, Console], int]

#: Width used when output is not a terminal, so nothing is truncated in logs and pipes.
PIPE_WIDTH = 240


def _console(file: TextIO) -> Console:
    is_tty = hasattr(file, "isatty") and file.isatty()
    return Console(file=file, width=None if is_tty else PIPE_WIDTH, highlight=False, soft_wrap=False)


# --------------------------------------------------------------------- hp plugins


def add_plugins_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp plugins [--strict]``: list plugins and every registered item."""
    parser = subparsers.add_parser(
        "plugins",
        help="list installed plugins and every registered item with its provider",
        description=(
            "List the plugins hp found (name, distribution, version, status) and every item "
            "they registered. Honors HP_DISABLE_PLUGIN_AUTOLOAD and HP_PLUGINS."
        ),
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 if any plugin failed to load (also HP_PLUGINS_STRICT=1)",
    )
    parser.set_defaults(handler=cmd_plugins)


def _describe_item(item: RegisteredItem) -> str:
    parts = []
    if "type" in item.meta:
        parts.append(str(item.meta["type"]))
    role = getattr(item.value, "role", None) if item.kind == "template" else None
    if role is not None:
        parts.append(f"role={role}")
    for key, value in item.meta.items():
        if key == "type":
            continue
        if key == "architectures":
            if value:
                parts.append(f"architectures={','.join(value)}")
            continue
        parts.append(f"{key}={value}")
    return " ".join(parts)


def cmd_plugins(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Print the plugin table and the item table; with ``--strict`` fail on broken plugins."""
    from hp_core.plugins import RegistryKind
    from hp_core.plugins._manager import current_state, strict_from_env

    # The diagnostic view never raises for a broken plugin: it is how you find it.
    state = current_state(strict=False)

    plugins = Table(title="hp plugins", title_justify="left")
    for column in ("name", "distribution", "version", "status", "items", "details"):
        plugins.add_column(column, overflow="fold")
    for info in state.report:
        style = {"failed": "red", "disabled": "dim"}.get(info.status, "")
        plugins.add_row(
            Text(info.name),
            Text(info.distribution or "-"),
            Text(info.version or "-"),
            Text(info.status, style=style),
            Text(str(info.items)),
            Text(info.error or info.note or ""),
        )
    out.print(plugins)

    items = Table(title="registered items", title_justify="left")
    for column in ("kind", "name", "provider", "distribution", "details"):
        items.add_column(column, overflow="fold")
    for kind in RegistryKind:
        for item in state.items[kind].values():
            items.add_row(
                Text(kind.value),
                Text(item.name),
                Text(item.provider),
                Text(item.distribution or "-"),
                Text(_describe_item(item)),
            )
    out.print(items)

    for warning in state.warnings:
        err.print(Text(f"warning: {warning}", style="yellow"))

    strict = args.strict or strict_from_env()
    failures = state.failures()
    if strict and (failures or state.warnings):
        for info in failures:
            version = f" {info.version}" if info.version else ""
            err.print(
                Text(
                    f"hp plugins --strict: plugin {info.name!r} from distribution "
                    f"{info.distribution or '(none)'}{version} failed to load: {info.error}",
                    style="red",
                )
            )
        if state.warnings:
            err.print(Text("hp plugins --strict: plugin selection problems (see warnings above).", style="red"))
        err.print(
            Text("Fix: repair or uninstall the failing plugin, or leave it out with HP_PLUGINS=<names>.")
        )
        return 1
    return 0


# ------------------------------------------------------------------------ hp plan


class _UsageError(Exception):
    """Bad command-line input (exit 2)."""


def add_plan_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp plan --model NAME_OR_CONFIG --mesh tp=8,cp=2 ...``: plan on the meta device and explain."""
    from hp_core.testing.models import PRESETS

    parser = subparsers.add_parser(
        "plan",
        help="plan a model for a mesh on the meta device and print the plan",
        description=(
            "Build the model on the meta device (no weights, no processes, no process group), "
            "plan it for the mesh and print every boundary with the collectives it costs, then "
            "the collectives of one training step. Nothing is downloaded."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="NAME_OR_CONFIG",
        help=f"a preset ({', '.join(PRESETS)}) or a path to an HF config.json (or its folder)",
    )
    parser.add_argument("--mesh", required=True, help="mesh axes and sizes, e.g. tp=8,cp=2 or dp=2,tp=4")
    parser.add_argument("--overrides", metavar="FILE", help="a YAML overrides file")
    parser.add_argument(
        "--sp",
        dest="sequence_parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sequence parallelism between blocks when tp > 1 (default: on)",
    )
    parser.add_argument(
        "--loss-parallel", action="store_true", help="keep the logits vocab-sharded for a parallel loss"
    )
    parser.add_argument(
        "--ep", type=_positive_int, default=1, metavar="N", help="expert-parallel size for MoE blocks (default 1)"
    )
    parser.add_argument("--yaml", action="store_true", help="print the plan as YAML instead of the explanation")
    parser.set_defaults(handler=cmd_plan)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _load_config(model: str) -> Any:
    """A preset name or a local HF config (file or folder) → a transformers config. Offline."""
    import json
    from pathlib import Path

    from hp_core.testing.models import PRESETS, UnknownModelPresetError, preset_config

    path = Path(model)
    looks_like_path = path.exists() or model.endswith(".json") or "/" in model or "\\" in model
    if not looks_like_path:
        try:
            return preset_config(model)
        except UnknownModelPresetError as e:
            raise _UsageError(f"--model: {e} Or pass a path to an HF config.json.") from None
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise _UsageError(
            f"--model: {str(file)!r}: no such file. Pass an HF config.json (or its folder) "
            f"or a preset: {', '.join(PRESETS)}."
        )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _UsageError(f"--model: {str(file)!r} is not a readable JSON config: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise _UsageError(
            f"--model: {str(file)!r} has no 'model_type'; an HF config.json names its model type "
            "(e.g. \"model_type\": \"llama\")."
        )
    from transformers import AutoConfig

    data = dict(data)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as e:
        raise _UsageError(f"--model: {str(file)!r}: transformers cannot build this config: {e}") from None


def cmd_plan(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Plan ``--model`` for ``--mesh`` on the meta device; print ``explain()`` or the YAML plan."""
    import warnings
    from pathlib import Path

    from hp_core.mesh import MeshSpec, MeshSpecError

    def fail(code: int, message: str) -> int:
        err.print(Text(f"hp plan: error: {message}"))
        return code

    try:
        mesh = MeshSpec.parse(args.mesh)
    except MeshSpecError as e:
        return fail(2, f"--mesh: {e}")
    if args.overrides is not None and not Path(args.overrides).is_file():
        return fail(2, f"--overrides: {args.overrides!r}: no such file.")
    try:
        config = _load_config(args.model)
    except _UsageError as e:
        return fail(2, str(e))

    from hp_core.planner import plan
    from hp_core.sharding_plan import dump_plan
    from hp_core.testing.models import model_from_config

    try:
        model = model_from_config(config, device="meta")
    except (ValueError, KeyError, TypeError) as e:
        return fail(2, f"--model: cannot build a causal LM from {args.model!r}: {e}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = plan(
                model,
                mesh,
                overrides=args.overrides,
                sequence_parallel=args.sequence_parallel,
                loss_parallel=args.loss_parallel,
                ep_size=args.ep,
            )
        except ValueError as e:  # PlanError and friends: every planner error is a ValueError
            return fail(1, f"{type(e).__name__}: {e}")
    for w in caught:
        if w.category.__module__.startswith("hp_core"):
            err.print(Text(f"warning: {w.message}"))
    text = dump_plan(result) if args.yaml else result.explain()
    out.print(Text(text.rstrip("\n")), soft_wrap=True)
    return 0


# ---------------------------------------------------------------------- wiring

#: Subcommands in help order; add ``add_<name>_command`` functions here.
COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    add_plugins_command,
    add_plan_command,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``hp`` argument parser with every subcommand in :data:`COMMANDS`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        hp_version = version("hp-core")
    except PackageNotFoundError:  # running from a source tree without installing
        hp_version = "unknown"
    parser = argparse.ArgumentParser(
        prog="hp",
        description="Parallelize PyTorch models over a DeviceMesh from declared sharding contracts.",
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
