"""The planner without its full-width q/k norm scheme, for tests of hp's refusal path.

OLMo-2 served those tests as the model the planner got wrong (its q/k norms span every
head while the projections are split); the planner now shards such norms
(``hp_core.planner.templates.qk_norm``). These helpers give the tests the plan it made
before, so what they check — the verifier's refusal and its pasteable fix — keeps a
real model to refuse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from hp_core.planner.templates import builtin


def _unchanged(ctx: object, spec: object) -> object:
    return spec


@contextlib.contextmanager
def without_full_width_norms() -> Iterator[None]:
    """Plan attention blocks with full-width q/k norms replicated, as before (rank-side)."""
    saved = builtin.shard_full_width_norms
    builtin.shard_full_width_norms = _unchanged  # type: ignore[assignment]
    try:
        yield
    finally:
        builtin.shard_full_width_norms = saved


def disable_full_width_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same, for the rest of an in-process test."""
    monkeypatch.setattr(builtin, "shard_full_width_norms", _unchanged)


@pytest.fixture
def no_qk_norm_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same, as a fixture."""
    disable_full_width_norms(monkeypatch)
