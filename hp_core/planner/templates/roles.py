"""Semantic roles of parameters and the rules that assign them.

A role says what a parameter *is* (a column-parallel projection, an embedding, a
router, ...) independently of the model family. Rules map parameter names to roles;
plugins add rules scoped to their architectures through ``hp_register_templates``,
and those take precedence over the defaults registered by the core's built-in plugin.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from typing import Any

from hp_core.errors import HpError
from hp_core.spec.keywords import keyword_checked

__all__ = [
    "BOUNDARY_KINDS",
    "DEFAULT_ROLE_RULES",
    "BoundaryTemplate",
    "Role",
    "RoleRule",
    "RoleSource",
    "TemplateDefinitionError",
    "classify_param",
    "first_rule",
]


class TemplateDefinitionError(HpError, ValueError):
    """A RoleRule or BoundaryTemplate built with a value of the wrong kind."""


class Role(StrEnum):
    """What a parameter is, for the planner."""

    EMBED = "embed"
    LM_HEAD = "lm_head"
    NORM = "norm"
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    FUSED_QKV = "fused_qkv"
    FUSED_GATE_UP = "fused_gate_up"
    MOE_EXPERT = "moe_expert"
    MOE_ROUTER = "moe_router"
    SHARED_EXPERT_GATE = "shared_expert_gate"
    REPLICATED = "replicated"
    SKIP = "skip"


@keyword_checked
@dataclasses.dataclass(frozen=True)
class RoleRule:
    """``pattern`` (a regular expression searched in the parameter FQN) → ``role``.

    ``architectures`` scopes the rule to HF architecture class names (e.g.
    ``"Phi3ForCausalLM"``); an empty tuple applies to every model.
    """

    name: str
    pattern: str
    role: Role
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise TemplateDefinitionError(
                f"RoleRule {self.name!r}: role must be a hp_core.Role, got {self.role!r}"
            )
        if isinstance(self.architectures, str) or not all(
            isinstance(a, str) for a in self.architectures
        ):
            raise TemplateDefinitionError(
                f"RoleRule {self.name!r}: architectures must be a tuple of class names, got "
                f"{self.architectures!r}"
            )
        object.__setattr__(self, "architectures", tuple(self.architectures))
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise TemplateDefinitionError(
                f"RoleRule {self.name!r}: pattern {self.pattern!r} is not a regular expression: {e}"
            ) from None

    def matches(self, fqn: str, architectures: Sequence[str] = ()) -> bool:
        if self.architectures and not set(self.architectures) & set(architectures):
            return False
        return re.search(self.pattern, fqn) is not None


def _r(name: str, pattern: str, role: Role) -> RoleRule:
    return RoleRule(f"role.{name}", pattern, role)


#: The core's default rules, in precedence order (first match wins).
DEFAULT_ROLE_RULES: tuple[RoleRule, ...] = (
    _r("moe_expert", r"\.experts\.", Role.MOE_EXPERT),
    _r(
        "moe_router",
        r"(^|\.)(mlp|block_sparse_moe|moe)\.(gate|router)\.(weight|bias|e_score_correction_bias)$",
        Role.MOE_ROUTER,
    ),
    _r("shared_expert_gate", r"(^|\.)shared_expert_gate\.weight$", Role.SHARED_EXPERT_GATE),
    _r("embed", r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|embed_in)\.weight$", Role.EMBED),
    _r("lm_head", r"(^|\.)(lm_head|embed_out)\.weight$", Role.LM_HEAD),
    _r(
        "norm",
        r"(norm|layernorm|ln_f|ln_[0-9]|ln_attn|ln_mlp|norm_[0-9f])\.(weight|bias)$",
        Role.NORM,
    ),
    _r(
        "fused_qkv", r"(^|\.)(qkv_proj|query_key_value|c_attn|Wqkv)\.(weight|bias)$", Role.FUSED_QKV
    ),
    _r("fused_gate_up", r"(^|\.)gate_up_proj\.(weight|bias)$", Role.FUSED_GATE_UP),
    _r(
        "colwise",
        r"(^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3|fc1|c_fc|dense_h_to_4h)\.(weight|bias)$",
        Role.COLWISE,
    ),
    _r(
        "rowwise",
        r"(^|\.)(o_proj|down_proj|w2|fc2|dense|c_proj|out_proj|dense_4h_to_h)\.(weight|bias)$",
        Role.ROWWISE,
    ),
)


def first_rule(
    fqn: str, rules: Iterable[RoleRule], architectures: Sequence[str] = ()
) -> RoleRule | None:
    """The rule that decides parameter ``fqn``: architecture-scoped rules first, then the rest
    in order; None when none matches."""
    rules = list(rules)
    scoped = [r for r in rules if r.architectures]
    general = [r for r in rules if not r.architectures]
    for rule in (*scoped, *general):
        if rule.matches(fqn, architectures):
            return rule
    return None


def classify_param(fqn: str, rules: Iterable[RoleRule], architectures: Sequence[str] = ()) -> Role:
    """The role of parameter ``fqn``: architecture-scoped rules first, then the rest in order."""
    rule = first_rule(fqn, rules, architectures)
    return rule.role if rule is not None else Role.REPLICATED


@dataclasses.dataclass(frozen=True)
class RoleSource:
    """What decided one parameter's role, for :func:`hp_core.explain_roles`.

    ``via``: ``role_rule`` (an architecture-scoped RoleRule), ``name_hint`` (a general
    RoleRule no ModuleRule overrode), ``module_rule``, ``structure`` (the type, shape or
    meta trace) or ``unclaimed`` (nothing decided it: replicated by default). ``item``:
    the registry name of the rule, to look its provider up (None for structure).
    """

    via: str
    rule: str
    item: str | None = None


#: Boundary kinds the planner recognises in a model's structure.
BOUNDARY_KINDS = (
    "embed",
    "lm_head",
    "norm",
    "attention",
    "mlp",
    "moe",
    "layer",
    "keep",
    "linear_colwise",
    "linear_rowwise",
)


@keyword_checked
@dataclasses.dataclass(frozen=True)
class BoundaryTemplate:
    """Builds the derived spec of one boundary kind: ``build(ctx) -> ModuleShardingSpec``.

    ``ctx`` is a :class:`hp_core.planner.TemplateContext` (the block, the mesh, the active
    axes and the activation layouts). ``architectures`` scopes the template to HF
    architecture class names; scoped templates win over general ones.
    """

    name: str
    kind: str
    build: Callable[[Any], Any]
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in BOUNDARY_KINDS:
            raise TemplateDefinitionError(
                f"BoundaryTemplate {self.name!r}: kind must be one of {BOUNDARY_KINDS}, got "
                f"{self.kind!r}"
            )
        if not callable(self.build):
            raise TemplateDefinitionError(
                f"BoundaryTemplate {self.name!r}: build must be callable, got {self.build!r}"
            )
        if isinstance(self.architectures, str) or not all(
            isinstance(a, str) for a in self.architectures
        ):
            raise TemplateDefinitionError(
                f"BoundaryTemplate {self.name!r}: architectures must be a tuple of class names, "
                f"got {self.architectures!r}"
            )
        object.__setattr__(self, "architectures", tuple(self.architectures))

    def applies_to(self, architectures: Sequence[str]) -> bool:
        return not self.architectures or bool(set(self.architectures) & set(architectures))
