"""Plugin discovery cost: `import hp_core` + loading every installed plugin, beside `import torch`.

Each measurement runs in a fresh interpreter (imports are cached per process), repeated,
and reports the median in milliseconds.

    python benchmarks/plugin_discovery.py [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PROBES = {
    "import torch": (
        "import time; t=time.perf_counter(); import torch; print(time.perf_counter()-t)"
    ),
    "import torch + import hp_core": (
        "import time; t=time.perf_counter(); import torch, hp_core; print(time.perf_counter()-t)"
    ),
    "import torch + hp_core + load all plugins": (
        "import time; t=time.perf_counter(); import torch, hp_core; "
        "from hp_core.plugins import load_plugins; "
        "load_plugins(); print(time.perf_counter()-t)"
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument(
        "--json", type=Path, default=Path("benchmarks/results/plugin_discovery.json")
    )
    args = parser.parse_args(argv)
    results = {}
    for _ in range(args.repeat):  # interleaved: one round of every probe per repetition
        for name, code in PROBES.items():
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            )
            results.setdefault(name, []).append(1e3 * float(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(results["import torch"])
    lines = ["| what | median ms | min-max ms | beyond `import torch` |", "|---|---|---|---|"]
    for name, times in results.items():
        med = statistics.median(times)
        lines.append(
            f"| {name} | {med:.0f} | {min(times):.0f}-{max(times):.0f} | {med - base:+.0f} ms |"
        )
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
