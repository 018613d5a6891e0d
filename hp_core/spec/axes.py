"""Mesh axis names: the canonical ones (``tp``, ``cp``, ``ep``, ``dp``...) and their constants."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["CANONICAL_AXES", "CP", "DP", "EP", "TP", "MeshAxisName"]


class MeshAxisName(StrEnum):
    """Canonical mesh axis names. Members compare and hash equal to plain strings."""

    tp = "tp"
    cp = "cp"
    ep = "ep"
    pp = "pp"
    dp = "dp"
    dp_replicate = "dp_replicate"
    dp_shard = "dp_shard"
    dp_cp = "dp_cp"
    ep_shard = "ep_shard"
    # Upper-case aliases: ``MeshAxisName.TP is MeshAxisName.tp``.
    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"


TP = MeshAxisName.TP
CP = MeshAxisName.CP
EP = MeshAxisName.EP
DP = MeshAxisName.DP

#: Every canonical axis name, as plain strings.
CANONICAL_AXES: frozenset[str] = frozenset(m.value for m in MeshAxisName)
