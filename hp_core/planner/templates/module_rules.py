"""``ModuleRule``: a plugin's word on what a module *is* (attention, MLP, embedding, ...).

The planner infers module kinds from the model's structure (docs/plans.md); a rule
registered through ``hp_register_templates`` says it outright, for models whose structure
the inference cannot read or reads differently from what their author intends. Rules
match a module by its FQN (a regular expression searched in it), by its class name
(a string without regex metacharacters that equals ``type(module).__name__``), or by
its class (a type: ``isinstance``). Architecture-scoped rules win over general ones.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

from torch import nn

from hp_core.planner.templates.roles import Role, TemplateDefinitionError
from hp_core.spec.keywords import keyword_checked

__all__ = ["MODULE_KINDS", "ModuleRule", "kind_role", "module_kind", "module_rule"]

#: What a ModuleRule may declare a module to be.
MODULE_KINDS = ("attention", "mlp", "embed", "lm_head", "norm", "keep")

_KIND_ROLES = {"embed": Role.EMBED, "lm_head": Role.LM_HEAD, "norm": Role.NORM}


@keyword_checked
@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """``match`` (FQN regex, class name or class) → ``kind``, one of :data:`MODULE_KINDS`.

    ``attention`` / ``mlp``: a tensor-parallel block; its projections' roles are still
    inferred (or named by RoleRules). ``embed`` / ``lm_head`` / ``norm``: every parameter of
    the module has that role. ``keep``: the module stays whole on every axis (its
    parameters replicated, its forward unwrapped), e.g. a position embedding.
    """

    name: str
    match: str | type
    kind: str
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in MODULE_KINDS:
            raise TemplateDefinitionError(
                f"ModuleRule {self.name!r}: kind must be one of {MODULE_KINDS}, got {self.kind!r}. "
                "Fix: pass one of those kinds (a module to leave unsharded is 'keep')."
            )
        if isinstance(self.architectures, str) or not all(
            isinstance(a, str) for a in self.architectures
        ):
            raise TemplateDefinitionError(
                f"ModuleRule {self.name!r}: architectures must be a tuple of class names, got "
                f"{self.architectures!r}. Fix: pass e.g. architectures=('LlamaForCausalLM',)."
            )
        object.__setattr__(self, "architectures", tuple(self.architectures))
        if isinstance(self.match, type):
            if not issubclass(self.match, nn.Module):
                raise TemplateDefinitionError(
                    f"ModuleRule {self.name!r}: match must be an nn.Module subclass, a class name "
                    f"or an FQN pattern, got the class {self.match.__name__}. Fix: match the "
                    "module's own class (or its name)."
                )
            return
        if not isinstance(self.match, str):
            raise TemplateDefinitionError(
                f"ModuleRule {self.name!r}: match must be a regular expression, a class name or "
                f"an nn.Module subclass, got {self.match!r}. Fix: pass e.g. "
                "match=r'\\.attn$' or match='MyAttention'."
            )
        try:
            re.compile(self.match)
        except re.error as e:
            raise TemplateDefinitionError(
                f"ModuleRule {self.name!r}: match {self.match!r} is not a regular expression: {e}. "
                "Fix: escape the special characters (re.escape) or correct the pattern."
            ) from None

    def matches(self, fqn: str, module: nn.Module, architectures: Sequence[str] = ()) -> bool:
        if self.architectures and not set(self.architectures) & set(architectures):
            return False
        if isinstance(self.match, type):
            return isinstance(module, self.match)
        if self.match == type(module).__name__:
            return True
        return re.search(self.match, fqn) is not None


def module_rule(
    fqn: str, module: nn.Module, rules: Iterable[ModuleRule], architectures: Sequence[str] = ()
) -> ModuleRule | None:
    """The first matching rule (architecture-scoped rules first), or None."""
    rules = list(rules)
    for rule in (
        *(r for r in rules if r.architectures),
        *(r for r in rules if not r.architectures),
    ):
        if rule.matches(fqn, module, architectures):
            return rule
    return None


def module_kind(
    fqn: str, module: nn.Module, rules: Iterable[ModuleRule], architectures: Sequence[str] = ()
) -> str | None:
    """The kind the first matching rule declares (architecture-scoped rules first), or None."""
    rule = module_rule(fqn, module, rules, architectures)
    return rule.kind if rule is not None else None


def kind_role(kind: str) -> Role | None:
    """The role every parameter of a module of ``kind`` gets (None: decided per parameter)."""
    return _KIND_ROLES.get(kind)
