"""Verdicts: every rank says how its part of ``apply`` went and hears every other rank's.

The exchange goes through the default process group's key-value store rather than a
collective. A collective waits for a rank that failed, died or never called ``apply``
for as long as the process group's own timeout (30 minutes by default); a store key
that does not appear within ``timeout`` seconds is an error that names the missing
ranks. Keys are namespaced by the call's sequence number in this process (the n-th
``apply`` of every rank meets the n-th of the others) and by the phase.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from hp_core.errors import HpError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ApplyFailedError",
    "RankTimeoutError",
    "Verdict",
    "VerdictExchange",
    "resolve_timeout",
]

#: Seconds a rank waits for the others at each exchange, unless apply(timeout=...) or
#: HP_APPLY_TIMEOUT says otherwise. Long enough for ranks that load weights at
#: slightly different speeds; short enough that a dead rank is noticed within a minute.
DEFAULT_TIMEOUT_S = 30.0
_ENV = "HP_APPLY_TIMEOUT"
_calls = itertools.count()


class RankTimeoutError(HpError, RuntimeError):
    """Some ranks did not reach an exchange of ``apply`` in time (dead, hung, or not calling it)."""


class ApplyFailedError(HpError, RuntimeError):
    """``apply`` failed on some rank after the preflight; every rank rolled its model back."""


def resolve_timeout(timeout: float | None) -> float:
    """``timeout`` if given, else ``$HP_APPLY_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`."""
    if timeout is None:
        raw = os.environ.get(_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(raw)
        except ValueError:
            raise RankTimeoutError(
                f"{_ENV}={raw!r} is not a number of seconds; set it to e.g. 60."
            ) from None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise RankTimeoutError(
            f"apply(timeout={timeout!r}): expected a positive number of seconds."
        )
    return float(timeout)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One rank's word at one exchange: what it agreed to, and how it went."""

    #: Everything that changes what this rank will do: name → a printable value.
    fingerprint: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: ``None``, or ``"ErrorType: message"``.
    error: str | None = None
    #: The exception's type name (for the peers' message).
    error_type: str | None = None
    #: Where it failed: ``phase`` or ``phase at module``.
    where: str | None = None

    def dumps(self) -> bytes:
        return json.dumps(
            dataclasses.asdict(self) | {"fingerprint": dict(self.fingerprint)}
        ).encode()

    @classmethod
    def loads(cls, data: bytes) -> Verdict:
        raw = json.loads(data.decode())
        return cls(dict(raw["fingerprint"]), raw["error"], raw["error_type"], raw["where"])

    @classmethod
    def of(
        cls,
        error: BaseException | None,
        where: str | None = None,
        fingerprint: Mapping[str, str] | None = None,
    ) -> Verdict:
        if error is None:
            return cls(dict(fingerprint or {}))
        return cls(
            dict(fingerprint or {}), f"{type(error).__name__}: {error}", type(error).__name__, where
        )


def _store() -> Any:
    # Private, but the only handle on the store init_process_group made; every backend has one.
    return dist.distributed_c10d._get_default_store()


class VerdictExchange:
    """The exchanges of one ``apply`` call; a no-op outside a multi-rank job."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.call = next(_calls)
        self.rank = dist.get_rank() if self.active else 0
        self.world = dist.get_world_size() if self.active else 1

    def exchange(self, phase: str, mine: Verdict) -> list[Verdict]:
        """Post ``mine``; return every rank's verdict for ``phase`` (index = rank)."""
        if not self.active:
            return [mine]
        store = _store()
        key = f"hp/apply/{self.call}/{phase}/"
        store.set(key + str(self.rank), mine.dumps())
        keys = [key + str(r) for r in range(self.world)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except (RuntimeError, dist.DistError):  # the store's timeout
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if not missing:  # they arrived just now
                return [Verdict.loads(store.get(k)) for k in keys]
            raise RankTimeoutError(
                f"apply() on rank {self.rank}: rank(s) {missing} did not reach the {phase!r} "
                f"exchange within {self.timeout:g} s (dead, hung, or not calling apply() with the "
                "others). Check those ranks' logs; if they are only slow (e.g. loading weights), "
                f"raise the limit: apply(..., timeout=SECONDS) or {_ENV}=SECONDS."
            ) from None
        return [Verdict.loads(store.get(k)) for k in keys]


def failures(verdicts: list[Verdict]) -> dict[int, Verdict]:
    """Rank → verdict of every rank that failed."""
    return {r: v for r, v in enumerate(verdicts) if v.error is not None}


def mismatches(verdicts: list[Verdict]) -> dict[str, dict[int, str]]:
    """Fingerprint entry → value by rank, for every entry the ranks disagree on."""
    names = sorted({n for v in verdicts for n in v.fingerprint})
    out: dict[str, dict[int, str]] = {}
    for name in names:
        values = {r: v.fingerprint.get(name, "<missing>") for r, v in enumerate(verdicts)}
        if len(set(values.values())) > 1:
            out[name] = values
    return out
