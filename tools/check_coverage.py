"""Fail when line coverage falls below the project's floors (see README, "Testing").

The spec model (its field table included) and the injection discipline must be fully
covered; every other measured file needs at least 90 %.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The spec model (the whole spec/ package, its field table included) and the injection
# discipline (the decorators and the resolution of names/targets) are held to 100 %.
FULL = (
    *sorted(p.as_posix() for p in Path("hp_core/spec").glob("*.py")),
    "hp_core/injection.py",
    "hp_core/resolve.py",
)
FLOOR = 90.0


def main(argv: list[str]) -> int:
    report = json.loads(Path(argv[1] if len(argv) > 1 else ".coverage.json").read_text())
    files = {
        str(Path(name).as_posix()).split("/src/", 1)[-1]
        if "/src/" in name
        else Path(name).as_posix(): data
        for name, data in report["files"].items()
    }
    problems = []
    for name, data in sorted(files.items()):
        pct = data["summary"]["percent_covered"]
        need = 100.0 if any(name.endswith(f) for f in FULL) else FLOOR
        if pct + 1e-9 < need:
            missing = data.get("missing_lines", [])
            problems.append(f"  {name}: {pct:.1f}% < {need:.0f}% (missing lines {missing})")
    for required in FULL:
        if Path(required).exists() and not any(n.endswith(required) for n in files):
            problems.append(f"  {required}: not measured at all")
    total = report["totals"]["percent_covered"]
    if problems:
        print(f"coverage floors not met (total {total:.1f}%):", *problems, sep="\n")
        return 1
    print(
        f"coverage floors met: {len(files)} files, total {total:.1f}%, "
        f"{', '.join(f for f in FULL if Path(f).exists())} at 100%."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
