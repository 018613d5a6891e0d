"""``hp demo``: train a tiny HF model on CPU ranks with tp x cp x ep; compare every loss."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table
from rich.text import Text

import hp_core.demo as demo
from hp_core.cli.arg_types import positive_int
from hp_core.cli.failure import command, failing
from hp_core.presets import build_model

__all__ = ["add_demo_command", "cmd_demo"]


def add_demo_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp demo``: train a tiny HF model on CPU ranks with tp x cp x ep; compare every loss."""
    parser = subparsers.add_parser(
        "demo",
        help=(
            "train a tiny HF model on CPU ranks with tp/cp/ep and check every loss against one "
            "process"
        ),
        description=(
            "Spawn CPU ranks (gloo), build a tiny real Hugging Face model, plan it for "
            "tp x cp x ep "
            "(the default uses every installed plugin: a cp axis with hp-plugin-cp, expert "
            "parallelism with hp-plugin-moe), apply it in production mode, train AdamW steps on a "
            "synthetic next-token task and compare each loss with a single-process copy. "
            "Exit 0 only if every step matches within rtol=atol=1e-5."
        ),
    )
    parser.add_argument(
        "--model",
        default="qwen2moe",
        choices=demo.MODELS,
        help="tiny model preset (default qwen2moe)",
    )
    parser.add_argument(
        "--world",
        type=positive_int,
        default=None,
        help="number of ranks (default 4; 2 without hp-plugin-cp)",
    )
    parser.add_argument(
        "--mesh",
        default=None,
        help="tp and cp sizes, e.g. tp=2,cp=2 (default: from --world and the plugins)",
    )
    parser.add_argument(
        "--ep",
        type=positive_int,
        default=None,
        help="expert-parallel size (default 2 for MoE models with hp-plugin-moe)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=20, help="training steps (default 20)"
    )
    parser.add_argument(
        "--batch", type=positive_int, default=2, help="sequences per step (default 2)"
    )
    parser.add_argument(
        "--seq", type=positive_int, default=16, help="tokens per sequence (default 16)"
    )
    parser.set_defaults(handler=cmd_demo)


@command("demo")
def cmd_demo(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Choose the setup, print the plan summary, train on spawned ranks, print the table and
    verdict. (``demo.run_demo`` is looked up on the module at call time: tests replace it.)"""
    with failing(2, demo.DemoError, message=str):
        setup = demo.default_setup(
            args.model,
            world=args.world,
            mesh=args.mesh,
            ep=args.ep,
            steps=args.steps,
            batch=args.batch,
            seq=args.seq,
        )
    for note in setup.notes:
        out.print(Text(f"note: {note}"), soft_wrap=True)
    cannot_plan = f"cannot plan {args.model} for {setup.mesh_text}"
    # every planner error is a ValueError
    with failing(1, ValueError, message=lambda e: f"{cannot_plan}: {e}"):
        plan = demo.plan_for(setup, build_model(args.model, device="meta"), setup.mesh_text)
    out.print(
        Text(
            f"hp demo: {args.model} on {setup.world} CPU ranks, mesh {setup.mesh_text}, "
            f"ep={setup.ep}, {setup.steps} steps of batch {setup.batch} x seq {setup.seq}, "
            "production mode"
        ),
        soft_wrap=True,
    )
    for line in demo.plan_summary(plan):
        out.print(Text(line), soft_wrap=True)
    with failing(1, demo.DemoError, message=str):
        reports = demo.run_demo(setup)
    total = sum(p.numel() for p in build_model(args.model, device="meta").parameters())
    per_rank = ", ".join(str(r["params"]) for r in reports)
    out.print(Text(f"params per rank: {per_rank} (unsharded model: {total})"), soft_wrap=True)
    adapters = ", ".join(reports[0]["adapters"]) or "none"
    out.print(Text(f"training adapters: {adapters}"), soft_wrap=True)
    for line in demo.measured_lines(reports[0]["measured"]):
        out.print(Text(line), soft_wrap=True)
    rows = [demo.StepRow(i, a, b) for i, (a, b) in enumerate(reports[0]["losses"])]
    table = Table(title="loss per step: sharded vs single device", title_justify="left")
    for column in ("step", "sharded", "single", "|diff|", "ok"):
        table.add_column(column, justify="right")
    for r in rows:
        ok = Text("ok" if r.ok() else "MISMATCH", style="" if r.ok() else "red")
        table.add_row(str(r.step), f"{r.sharded:.6f}", f"{r.single:.6f}", f"{r.diff:.2e}", ok)
    out.print(table)
    code = demo.verdict(rows)
    if code == 0:
        out.print(
            Text(f"every step matches the single-device run (rtol={demo.RTOL}, atol={demo.ATOL})")
        )
    else:
        bad = [r.step for r in rows if not r.ok()]
        err.print(
            Text(
                f"MISMATCH at step(s) {bad}: the sharded loss differs from the single-device loss",
                style="red",
            )
        )
    return code
