"""How hp does on the zoo: zero-config ``plan`` and the equivalence check, per model and SP.

Run from the repository root: ``python -m tests.zoo.survey [--steps 3] [--only NAME ...]
[--json PATH]``. For every zoo entry and ``sequence_parallel`` in (True, False) it plans on
``tp=2`` with no overrides, on the training call (``example_inputs``: step 0's batch);
when that plans, it runs :func:`hp_core.testing.check_equivalence` (both modes,
``--steps`` AdamW steps) on a 2-rank gloo world. Each run's outcome is one of ``match``,
``refused at plan: ...``, ``refused at apply: ...``, ``crashed: ...``, ``mismatch: ...``
(the error's class and first line), with whether the attention block's parameters are
tp-sharded or kept whole.

A refusal whose message prints an override to paste (hp's ``Fix:`` YAML, e.g. a
keep-whole ``params:`` entry or ``is_boundary: false``) is then *followed*: the printed
entries are added to the overrides and the entry is planned again (a new refusal with
another printed entry adds that one too, up to :data:`MAX_FIX_ROUNDS`), and the result is
checked like the zero-config run: a ``+fix`` row. ``+manual``: where a refusal prints
no override (minGPT), the override a user would try (:data:`MANUAL_FIXES`, written here,
not by hp), then hp's printed ones as above.

``mingpt_copyable`` is a diagnostic entry, not a zoo model: minGPT with its ``mlpf`` lambda
replaced by a ``partial`` that ``copy.deepcopy`` follows (the check deep-copies the model;
a copied lambda keeps calling the original's MLP).

This is a survey, not a test: it asserts nothing and is not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

import hp_core
from hp_core import HpError, ShardingPlan
from hp_core.testing import (
    EquivalenceError,
    EquivalenceInputError,
    EquivalenceRunError,
    WorldError,
    WorldTimeoutError,
    check_equivalence,
    shutdown_worlds,
)
from hp_core.testing.printed_fix import printed_fix
from tests.zoo import gpt_fast, litgpt, mingpt, nanogpt, torchtitan_llama

MESH = "tp=2"
MAX_FIX_ROUNDS = 8


@dataclass(frozen=True)
class Entry:
    name: str
    factory: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, Any]]
    loss_fn: Callable[[Any, dict[str, Any]], Any]
    attention: str  # the first layer's attention block
    mlp: str  # the first layer's MLP block


_H0 = "transformer.h.0"
ENTRIES = (
    Entry("nanogpt", nanogpt.tiny, nanogpt.batch, nanogpt.output_loss, f"{_H0}.attn", f"{_H0}.mlp"),
    Entry(
        "gpt_fast",
        gpt_fast.tiny,
        gpt_fast.batch,
        gpt_fast.output_loss,
        "layers.0.attention",
        "layers.0.feed_forward",
    ),
    Entry(
        "torchtitan_llama",
        torchtitan_llama.tiny,
        torchtitan_llama.batch,
        torchtitan_llama.output_loss,
        "layers.0.attention",
        "layers.0.feed_forward",
    ),
    Entry(
        "litgpt_llama",
        litgpt.tiny_llama,
        litgpt.batch,
        litgpt.output_loss,
        f"{_H0}.attn",
        f"{_H0}.mlp",
    ),
    Entry(
        "litgpt_pythia",
        litgpt.tiny_pythia,
        litgpt.batch,
        litgpt.output_loss,
        f"{_H0}.attn",
        f"{_H0}.mlp",
    ),
    Entry(
        "litgpt_phi", litgpt.tiny_phi, litgpt.batch, litgpt.output_loss, f"{_H0}.attn", f"{_H0}.mlp"
    ),
    Entry("mingpt", mingpt.tiny, mingpt.batch, mingpt.output_loss, f"{_H0}.attn", f"{_H0}.mlp"),
    # A diagnostic, not a zoo entry: minGPT with its mlpf lambda made deepcopy-safe.
    Entry(
        "mingpt_copyable",
        mingpt.tiny_copyable,
        mingpt.batch,
        mingpt.output_loss,
        f"{_H0}.attn",
        f"{_H0}.mlp",
    ),
)
BY_NAME = {e.name: e for e in ENTRIES}

#: What a user would try where hp's refusal prints no override. minGPT's MLP is a
#: ModuleDict run by a lambda (its forward is never called): declare its parameters
#: without wrapping that forward.
_MINGPT_MLP: list[dict[str, Any]] = [
    {
        "match": "transformer.h.*.mlp",
        "is_boundary": False,
        "params": {
            f"{lin}.{p}": {"tp": "replicate"}
            for lin in ("c_fc", "c_proj")
            for p in ("weight", "bias")
        },
    }
]
MANUAL_FIXES = {"mingpt": _MINGPT_MLP, "mingpt_copyable": _MINGPT_MLP}


@dataclass
class Row:
    entry: str
    sp: bool
    variant: str  # "zero-config" or "+fix"
    outcome: str
    attention: str = "-"
    mlp: str = "-"
    overrides: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""  # the whole message of the refusal or failure
    seconds: float = 0.0


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def suggested_overrides(message: str) -> list[dict[str, Any]]:
    """The override entries of the fix a refusal prints (hp verified it before printing)."""
    fix = printed_fix(message)
    return fix.overrides if fix is not None else []


def block_layout(p: ShardingPlan, block: str) -> str:
    """``sharded`` when a weight under ``block`` is tp-sharded in the plan, else ``whole``
    (with how: a boundary, parameters only (``is_boundary: false``), or not in the plan)."""
    placements: dict[str, str] = {}
    for fqn, spec in p.items():
        params = spec.params if isinstance(spec.params, dict) else {}
        for rel, named in params.items():
            name = f"{fqn}.{rel}" if fqn else rel
            if name.startswith(block + "."):
                placements[name] = type(named.get("tp")).__name__
    noted = any(block in n and "kept whole" in n for n in p.notes)
    if any(v == "Shard" for v in placements.values()):
        return "sharded"
    boundary = block in p and p[block].is_boundary is not False
    how = "boundary" if boundary else "params only" if placements else "not in plan"
    return f"whole ({how}{', planner note' if noted else ''})"


def plan_once(
    entry: Entry, sp: bool, overrides: list[dict[str, Any]]
) -> tuple[ShardingPlan | None, BaseException | None]:
    try:
        model = entry.factory()
        return hp_core.plan(model, MESH, overrides=overrides, **_plan_kwargs(entry, sp)), None
    except HpError as e:
        return None, e


def _plan_kwargs(entry: Entry, sp: bool) -> dict[str, Any]:
    return {"sequence_parallel": sp, "example_inputs": entry.batch(0)}


def _checked(entry: Entry, sp: bool, overrides: list[dict[str, Any]], steps: int) -> Any:
    return check_equivalence(
        entry.factory, entry.batch, MESH, overrides=overrides or None,
        plan_kwargs=_plan_kwargs(entry, sp), steps=steps, loss_fn=entry.loss_fn, timeout=600,
    )  # fmt: skip


def equivalence(
    entry: Entry, sp: bool, overrides: list[dict[str, Any]], steps: int
) -> tuple[str, str]:
    """``(outcome, whole message)`` of the equivalence check."""
    try:
        report = _checked(entry, sp, overrides, steps)
    except EquivalenceRunError as e:
        return f"crashed: {first_line(e)}", f"{e}\n--- cause ---\n{e.__cause__}"
    except EquivalenceError as e:
        return f"mismatch: {first_line(e)}", str(e)
    except EquivalenceInputError as e:
        return f"harness refused: {first_line(e)}", str(e)
    except HpError as e:
        return f"refused at apply: {first_line(e)}", str(e)
    except WorldTimeoutError as e:
        shutdown_worlds()  # a hung world cannot take the next task
        return f"crashed: {first_line(e)}", str(e)
    except WorldError as e:
        return f"crashed: {first_line(e)}", str(e)
    worst = ", ".join(f"{k}={v:.1e}" for k, v in sorted(report.worst.items()) if ":grad" in k)
    compared = report.compared.get("production:grad", 0)
    return "match", f"{compared}/{report.n_params} grads compared; worst grad excess: {worst}"


def run_variant(
    entry: Entry,
    sp: bool,
    overrides: list[dict[str, Any]],
    steps: int,
    variant: str = "zero-config",
) -> Row:
    """Plan with ``overrides`` and check; unless zero-config, keep following the refusals'
    printed fixes (at plan and at apply) until one plans, or none is printed."""
    start = time.monotonic()
    follow = variant != "zero-config"
    overrides = list(overrides)
    for _ in range(MAX_FIX_ROUNDS):
        p, err = plan_once(entry, sp, overrides)
        if p is None:
            assert err is not None
            more = [o for o in suggested_overrides(str(err)) if o not in overrides]
            if follow and more:
                overrides += more
                continue
            return Row(
                entry.name, sp, variant, f"refused at plan: {first_line(err)}",
                overrides=overrides, error=str(err), seconds=time.monotonic() - start,
            )  # fmt: skip
        notes = [n.splitlines()[0] for n in p.notes]
        outcome, message = equivalence(entry, sp, overrides, steps)
        more = [o for o in suggested_overrides(message) if o not in overrides]
        if follow and outcome.startswith("refused at apply") and more:
            overrides += more
            continue
        return Row(
            entry.name, sp, variant, outcome,
            block_layout(p, entry.attention), block_layout(p, entry.mlp),
            overrides=overrides, notes=notes, error=message, seconds=time.monotonic() - start,
        )  # fmt: skip
    return Row(entry.name, sp, variant, "gave up: fixes kept coming", overrides=overrides)


def _report(row: Row, indent: str = "") -> Row:
    print(
        f"[{row.seconds:5.1f}s] {indent}{row.entry} sp={row.sp} {row.variant}: {row.outcome}",
        flush=True,
    )
    return row


def survey(entries: tuple[Entry, ...], steps: int) -> list[Row]:
    rows: list[Row] = []
    for entry in entries:
        for sp in (True, False):
            row = _report(run_variant(entry, sp, [], steps))
            rows.append(row)
            fix = suggested_overrides(row.error) if row.outcome.startswith("refused") else []
            fixed = None
            if fix:
                fixed = _report(run_variant(entry, sp, fix, steps, "+fix"), "  ")
            elif row.outcome.startswith("refused") and entry.name in MANUAL_FIXES:
                manual = MANUAL_FIXES[entry.name]
                fixed = _report(run_variant(entry, sp, manual, steps, "+manual"), "  ")
            if fixed is not None:
                rows.append(fixed)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| entry | SP | variant | outcome | attention | mlp |", "|---|---|---|---|---|---|"]
    for r in rows:
        outcome = r.outcome.replace("|", "\\|")
        lines.append(f"| {r.entry} | {r.sp} | {r.variant} | {outcome} | {r.attention} | {r.mlp} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="entry names (default: all)")
    parser.add_argument("--json", help="write every row (with whole messages) here")
    args = parser.parse_args(argv)
    entries = tuple(e for e in ENTRIES if not args.only or e.name in args.only)
    try:
        rows = survey(entries, args.steps)
    finally:
        shutdown_worlds()
    print()
    print(table(rows))
    for r in rows:
        print(f"\n## {r.entry} sp={r.sp} {r.variant}: {r.outcome}")
        for o in r.overrides:
            print(f"  override: {o}")
        for n in r.notes:
            print(f"  plan note: {n}")
        print(textwrap.indent(r.error.strip()[:3000], "  | "))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
