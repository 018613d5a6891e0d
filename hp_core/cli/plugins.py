"""``hp plugins [--strict]``: list the plugins hp found and every item they registered."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hp_core.cli.failure import command
from hp_core.plugins import (
    RegisteredItem,
    RegistryKind,
    current_state,
    declared_problems,
    strict_from_env,
)

__all__ = ["add_plugins_command", "cmd_plugins"]


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
    """The item table's details column: its metadata as ``key=value`` words."""
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


@command("plugins")
def cmd_plugins(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Print the plugin table and the item table; with ``--strict`` fail on broken plugins."""
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

    # Malformed hp_core.items metadata: a problem of that distribution, not a crash.
    warnings = [*state.warnings, *declared_problems()]
    for warning in warnings:
        err.print(Text(f"warning: {warning}", style="yellow"))

    strict = args.strict or strict_from_env()
    failures = state.failures()
    if strict and (failures or warnings):
        for info in failures:
            version = f" {info.version}" if info.version else ""
            err.print(
                Text(
                    f"hp plugins --strict: plugin {info.name!r} from distribution "
                    f"{info.distribution or '(none)'}{version} failed to load: {info.error}",
                    style="red",
                )
            )
        if warnings:
            err.print(
                Text(
                    "hp plugins --strict: plugin selection or metadata problems (see warnings "
                    "above).",
                    style="red",
                )
            )
        err.print(
            Text(
                "Fix: repair or uninstall the failing plugin, or leave it out with "
                "HP_PLUGINS=<names>."
            )
        )
        return 1
    return 0
