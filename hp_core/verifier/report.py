"""What the verifier proved about one plan on one mesh (``hp_core.VerifyReport``).

A report can be saved (:meth:`VerifyReport.dumps`, canonical JSON with a content
signature) and passed to ``apply(..., verify=VerifyReport.loads(text))`` in a later run
of the same plan, which then skips the verifier. The signature detects edits and
corruption (as an artifact's does: it is not authentication), and ``apply`` compares the
report's plan fingerprint with the plan's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from hp_core.bounded.json_reader import loads_json
from hp_core.bounded.limits import InputLimitError
from hp_core.errors import HpError
from hp_core.runtime.grads import GradReduction
from hp_core.spec.keywords import keyword_checked

__all__ = ["ReportFormatError", "ReportFormatInputLimitError", "VerifyReport"]

_FORMAT = "hp-verify-report"
_VERSION = 1


class ReportFormatError(HpError, ValueError):
    """A saved verifier report that cannot be read back (edited, truncated, another version)."""


class ReportFormatInputLimitError(ReportFormatError, InputLimitError):
    """A saved verifier report over hp's input limits (size, nesting depth) or holding
    NaN/Infinity (see :mod:`hp_core.bounded`): both a :class:`ReportFormatError` and an
    :class:`~hp_core.bounded.InputLimitError`."""


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@keyword_checked
@dataclasses.dataclass
class VerifyReport:
    """What the verifier proved about one plan on one mesh."""

    fingerprint: str
    mesh: tuple[tuple[str, int], ...]
    #: the gradients that are partial sums, and over which axes hp sums them
    reductions: tuple[GradReduction, ...]
    #: boundaries whose region DTensor propagation checked
    checked: tuple[str, ...]
    #: boundaries whose inside runs on local tensors: not looked into, and why
    opaque: dict[str, str]
    #: repeated layer → the identical one that was checked in its place
    repeated: dict[str, str]
    seconds: float = 0.0

    def dumps(self) -> str:
        """The report as signed canonical JSON (reductions, fingerprint, mesh, what was checked)."""
        body = {
            "format": _FORMAT,
            "version": _VERSION,
            "fingerprint": self.fingerprint,
            "mesh": [list(m) for m in self.mesh],
            "reductions": [
                [r.param, list(r.axes), r.source] for r in self.reductions if r.group is None
            ],
            "checked": list(self.checked),
            "opaque": dict(self.opaque),
            "repeated": dict(self.repeated),
        }
        body["signature"] = "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()
        return _canonical(body).decode() + "\n"

    @classmethod
    def loads(cls, text: str | bytes, *, source: str = "<report>") -> VerifyReport:
        """Read a report written by :meth:`dumps`; refuses anything edited or malformed.

        The text is read under hp's input limits (:mod:`hp_core.bounded`): too large, too
        deeply nested or holding NaN/Infinity raises :class:`ReportFormatInputLimitError`
        (an ``InputLimitError`` that is also a :class:`ReportFormatError`).
        """
        if not isinstance(text, str | bytes):
            raise ReportFormatError(
                f"{source}: expected the report's text (from VerifyReport.dumps()), got "
                f"{type(text).__name__}."
            )
        try:
            body = loads_json(text, source=source, error=ReportFormatInputLimitError)
        except InputLimitError:
            raise
        except ValueError as e:
            raise ReportFormatError(
                f"{source}: not a verifier report (invalid JSON: {e})."
            ) from None
        if not isinstance(body, dict) or body.get("format") != _FORMAT:
            raise ReportFormatError(
                f"{source}: not a verifier report (write one with VerifyReport.dumps())."
            )
        if body.get("version") != _VERSION:
            raise ReportFormatError(
                f"{source}: report version {body.get('version')!r}; this hp reads {_VERSION}. "
                "Verify again."
            )
        signature = body.pop("signature", None)
        if signature != "sha256:" + hashlib.sha256(_canonical(body)).hexdigest():
            raise ReportFormatError(
                f"{source}: the report's signature does not match its content (edited or corrupt). "
                "Verify again."
            )
        try:
            return cls(
                fingerprint=str(body["fingerprint"]),
                mesh=tuple((str(a), int(n)) for a, n in body["mesh"]),
                reductions=tuple(
                    GradReduction(str(p), tuple(str(a) for a in axes), str(src))
                    for p, axes, src in body["reductions"]
                ),
                checked=tuple(str(c) for c in body["checked"]),
                opaque={str(k): str(v) for k, v in body["opaque"].items()},
                repeated={str(k): str(v) for k, v in body["repeated"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ReportFormatError(
                f"{source}: the report's fields do not validate ({type(e).__name__}: {e})."
            ) from None

    def partial(self) -> dict[str, tuple[str, ...]]:
        """``{parameter FQN: axes}`` of every partial gradient."""
        return {r.param: r.axes for r in self.reductions}

    def summary(self) -> str:
        lines = [
            f"verified on mesh {dict(self.mesh)} in {self.seconds:.2f} s: {len(self.checked)} "
            f"boundaries checked by propagation, {len(self.opaque)} run on local tensors, "
            f"{len(self.repeated)} repeated layers skipped",
        ]
        by_axes: dict[tuple[str, ...], list[str]] = {}
        for r in self.reductions:
            by_axes.setdefault(r.axes, []).append(r.param)
        for axes, names in by_axes.items():
            lines.append(
                f"  partial gradients summed over {'+'.join(axes)}: {len(names)} "
                f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            )
        for fqn, why in list(self.opaque.items())[:8]:
            lines.append(f"  not looked into: {fqn} ({why})")
        return "\n".join(lines)
