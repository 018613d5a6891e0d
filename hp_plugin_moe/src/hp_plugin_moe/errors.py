"""The errors hp-plugin-moe raises; each says which module, what is wrong and the fix."""

from __future__ import annotations

__all__ = ["MoEConfigError", "MoEInterfaceError", "MoERuntimeError"]


class MoEInterfaceError(TypeError):
    """An MoE block does not have the children / parameters a factory or router needs."""


class MoEConfigError(ValueError):
    """A factory config key (from YAML or Python) has a value the factory cannot use."""


class MoERuntimeError(RuntimeError):
    """The MoE compute met a state it cannot run in (e.g. experts not sharded as bound)."""
