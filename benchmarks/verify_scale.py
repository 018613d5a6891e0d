"""Verifier scale: hp's verify() vs plan() on 7B-shaped Llama, tp=8, meta device.

The target (the issue that asked for the verifier): at 32 and 1024 layers, verifying a plan
costs at most 2x planning it. Both are measured in the same run, on the same model, with
sequence parallelism on (the default) and off. verify() runs on meta-device copies over
torch's in-process fake process group (world 8); nothing is communicated. Model
construction is excluded from both. Each repetition times plan() then verify() in turn
(interleaved); the table reports medians after one warm-up and, as verify / plan, the
median of the per-repetition ratios (robust to load drift). The warm-up (the
first plan() and verify() in the process) is reported on its own: a user's first apply
pays it. Also: the verifier with ``exhaustive=True`` at 32 layers (what repeat detection
saves), the floor under it (torch's meta kernels alone for the layers it checks, one forward
and backward), and a 7B-shaped MoE preset when ``hp_core.presets`` has one.

    python benchmarks/verify_scale.py [--layers 32 64 128 256 512 1024] [--repeat 5]
        [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MESH = "tp=8"
TARGET = 2.0
MOE_FAMILIES = ("mixtral", "qwen2moe")


def _model(layers: int, preset: str = "llama-7b"):
    from hp_core.presets import model_from_config, preset_config

    return model_from_config(preset_config(preset, num_hidden_layers=layers))


def _timed(fn, *args, **kwargs) -> tuple[float, Any]:
    gc.collect()  # the previous call's garbage (two meta copies) is not this call's cost
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def _stats(times: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "samples_s": times,
    }


def measure(
    model, repeat: int, *, sequence_parallel: bool, exhaustive: bool = False
) -> dict[str, Any]:
    """``repeat`` interleaved (plan, verify) pairs on one model; medians and spreads."""
    import hp_core

    plan_t, verify_t, exh_t = [], [], []
    report = exh = None
    for _ in range(repeat):
        dt, p = _timed(hp_core.plan, model, MESH, sequence_parallel=sequence_parallel)
        plan_t.append(dt)
        dt, report = _timed(hp_core.verify, model, p, MESH)
        verify_t.append(dt)
        if exhaustive:
            dt, exh = _timed(hp_core.verify, model, p, MESH, exhaustive=True)
            exh_t.append(dt)
    row = {
        "plan": _stats(plan_t),
        "verify": _stats(verify_t),
        # median of the per-repetition ratios: each pair ran back to back, so load drift cancels
        "ratio": statistics.median(v / p for v, p in zip(verify_t, plan_t, strict=True)),
        "ratio_of_medians": statistics.median(verify_t) / statistics.median(plan_t),
        "report_seconds": report.seconds,
        "checked": len(report.checked),
        "repeated": len(report.repeated),
        "reductions": len(report.reductions),
    }
    if exhaustive:
        row["exhaustive"] = {
            **_stats(exh_t),
            "ratio": statistics.median(e / p for e, p in zip(exh_t, plan_t, strict=True)),
            "saving": statistics.median(e / v for e, v in zip(exh_t, verify_t, strict=True)),
            "checked": len(exh.checked),
            "repeated": len(exh.repeated),
        }
    return row


def meta_floor(layers: int, repeat: int) -> dict[str, Any]:
    """One forward + backward of a ``layers``-layer copy on the meta device, without hp.

    This is the floor under every verifier pass: torch's meta kernels for the layers the
    verifier checks. The verifier runs three such passes (DTensor, local tensors, the
    unsharded model), so it cannot cost less than about three of these.
    """
    import torch

    from hp_core.verifier.meta import MetaValues, meta_clone

    model = meta_clone(_model(layers))
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")

    def once() -> None:
        with MetaValues():  # answers HF's value queries (mask.all()) as the verifier does
            model(input_ids=ids, use_cache=False).logits.sum().backward()

    once()
    return _stats([_timed(once)[0] for _ in range(repeat)])


def _moe_preset() -> str | None:
    from hp_core.presets import SEVEN_B

    return next((name for name, (family, _) in SEVEN_B.items() if family in MOE_FAMILIES), None)


def _span(s: dict[str, Any]) -> str:
    return f"{s['median_s']:.3f} ({s['min_s']:.3f}-{s['max_s']:.3f})"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | layers | sequence parallel | plan s, median (min-max) | verify s, median "
        "(min-max) | verify / plan | <= 2x | layers checked / repeated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = "yes" if r["ratio"] <= TARGET else "**no**"
        lines.append(
            f"| {r['model']} | {r['layers']} | {'on' if r['sequence_parallel'] else 'off'} | "
            f"{_span(r['plan'])} | {_span(r['verify'])} | {r['ratio']:.2f}x | {ok} | "
            f"{r['layers'] - r['repeated']} / {r['repeated']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    parser.add_argument(
        "--repeat", type=int, default=5, help="timed repetitions per size, after the warm-up"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 32 and 64 layers, 1 repetition, sequence parallel only",
    )
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/verify_scale.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.repeat = [32, 64], 1
    sp_modes = (True,) if args.quick else (True, False)

    import hp_core  # imports (torch.distributed.tensor among them) are not part of the first call

    # Warm-up, reported: the first plan() and verify() in this process, 32 layers, defaults.
    warm_model = _model(32)
    first_plan, p = _timed(hp_core.plan, warm_model, MESH)
    first_verify, _ = _timed(hp_core.verify, warm_model, p, MESH)
    del warm_model, p

    rows: list[dict[str, Any]] = []
    for n in args.layers:
        model = _model(n)  # built once per size, outside every timed region
        for sp in sp_modes:
            row = measure(model, args.repeat, sequence_parallel=sp, exhaustive=(n == 32 and sp))
            rows.append({"model": "llama-7b", "layers": n, "sequence_parallel": sp, **row})
        del model

    moe_name = _moe_preset()
    moe: dict[str, Any] = {"preset": moe_name}
    if moe_name is None:
        moe["skipped"] = (
            "hp_core.presets has no 7B-shaped MoE preset (SEVEN_B has no mixtral/qwen2moe entry)"
        )
    else:
        from hp_core.presets import SEVEN_B

        n = SEVEN_B[moe_name][1].get("num_hidden_layers", 32)
        row = measure(_model(n, moe_name), args.repeat, sequence_parallel=True)
        rows.append({"model": moe_name, "layers": n, "sequence_parallel": True, **row})

    lines = _table(rows)
    warm32 = next(
        (
            r
            for r in rows
            if r["layers"] == 32 and r["sequence_parallel"] and r["model"] == "llama-7b"
        ),
        None,
    )
    lines += [
        "",
        "| first call in the process (32 layers, sequence parallel) | s | warm median s | "
        "first-call extra s |",
        "|---|---|---|---|",
    ]
    for name, first, key in (("plan()", first_plan, "plan"), ("verify()", first_verify, "verify")):
        med = warm32[key]["median_s"] if warm32 else float("nan")
        lines.append(f"| {name} | {first:.3f} | {med:.3f} | {first - med:+.3f} |")
    exh_row = next((r for r in rows if "exhaustive" in r), None)
    if exh_row is not None:
        e = exh_row["exhaustive"]
        lines += [
            "",
            "| 32 layers, sequence parallel | verify s, median (min-max) | layers checked | "
            "vs plan |",
            "|---|---|---|---|",
            f"| repeat detection (default) | {_span(exh_row['verify'])} | "
            f"{32 - exh_row['repeated']} | {exh_row['ratio']:.2f}x |",
            f"| exhaustive=True | {_span(e)} | 32 | {e['ratio']:.2f}x |",
            f"| saved by repeat detection | {e['saving']:.1f}x faster | | |",
        ]
    if warm32 is not None:
        checked = warm32["layers"] - warm32["repeated"]
        floor = meta_floor(checked, args.repeat)
        out_floor = {"layers": checked, **floor}
        plan32 = warm32["plan"]["median_s"]
        lines += [
            "",
            f"| floor: torch alone, {checked}-layer copy on meta, one forward + backward | "
            "s, median (min-max) | vs plan (32 layers) | verify / floor |",
            "|---|---|---|---|",
            f"| no hp, no DTensor | {_span(floor)} | {floor['median_s'] / plan32:.2f}x | "
            f"{warm32['verify']['median_s'] / floor['median_s']:.1f}x |",
        ]
    else:
        out_floor = None
    if "skipped" in moe:
        lines += ["", f"MoE: skipped: {moe['skipped']}."]
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "mesh": MESH,
        "repeat": args.repeat,
        "target_ratio": TARGET,
        "first_call": {"plan_s": first_plan, "verify_s": first_verify, "layers": 32},
        "rows": rows,
        "moe": moe,
        "meta_floor": out_floor,
    }
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
