"""Role hints for ``Phi3ForCausalLM``: fused ``qkv_proj`` / ``gate_up_proj``, rowwise exits.

Phi-3 packs q, k and v into one ``self_attn.qkv_proj`` Linear and gate and up into one
``mlp.gate_up_proj`` Linear. Both are column-parallel *fused* projections: each tp rank
must hold its slice of every packed part, not a contiguous slice of the packed weight.
``o_proj`` and ``down_proj`` are ordinary row-parallel exits.

These are hints, not the mechanism: the core classifies the same names the same way and
derives how the parts split from the model's config (``hp_core.planner.fused_layout``),
so a Phi-3 plans the same with or without this plugin. The rules are scoped to the
architecture, so they pin Phi-3's roles whatever the core's defaults become.
"""

from __future__ import annotations

from collections.abc import Callable

from hp_core import Role, RoleRule
from hp_core.hookspecs import hookimpl

__all__ = ["ARCHITECTURE", "HP_PLUGIN_API", "PHI3_ROLE_RULES", "hp_register_templates"]

#: The hp plugin API (hook specs + injection signatures) this plugin is built for: a
#: literal, so an hp-core speaking another version refuses it instead of misusing it.
HP_PLUGIN_API = 2

ARCHITECTURE = "Phi3ForCausalLM"

PHI3_ROLE_RULES: tuple[RoleRule, ...] = (
    RoleRule(
        "phi3.fused_qkv", r"(^|\.)self_attn\.qkv_proj\.weight$", Role.FUSED_QKV, (ARCHITECTURE,)
    ),
    RoleRule(
        "phi3.fused_gate_up",
        r"(^|\.)mlp\.gate_up_proj\.weight$",
        Role.FUSED_GATE_UP,
        (ARCHITECTURE,),
    ),
    RoleRule("phi3.o_proj", r"(^|\.)self_attn\.o_proj\.weight$", Role.ROWWISE, (ARCHITECTURE,)),
    RoleRule("phi3.down_proj", r"(^|\.)mlp\.down_proj\.weight$", Role.ROWWISE, (ARCHITECTURE,)),
)


@hookimpl
def hp_register_templates(register: Callable[[RoleRule], None]) -> None:
    """Register the Phi-3 role rules."""
    for rule in PHI3_ROLE_RULES:
        register(rule)
