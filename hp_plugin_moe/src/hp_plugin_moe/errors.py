"""The errors hp-plugin-moe raises; each says which module, what is wrong and the fix."""

from __future__ import annotations

from hp_core import HpError

__all__ = ["MoEConfigError", "MoEInterfaceError", "MoERuntimeError"]


class MoEInterfaceError(HpError, TypeError):
    """An MoE block does not have the children / parameters a factory or router needs."""


class MoEConfigError(HpError, ValueError):
    """A factory config key (from YAML or Python) has a value the factory cannot use."""


class MoERuntimeError(HpError, RuntimeError):
    """The MoE compute met a state it cannot run in (e.g. experts not sharded as bound)."""
