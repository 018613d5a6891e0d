"""Repeated layers: the elements of a layer stack that are structurally the same.

A decoder of 80 layers is usually one or two distinct layers repeated. The verifier checks
each distinct element once and lets the copies pass their input through (every element
it skips this way must have returned a tensor shaped like its input the first time).

Two elements of one ``nn.ModuleList`` / ``nn.Sequential`` are the same when every module
under them has the same class, the same parameter and buffer shapes, dtypes and
``requires_grad``, the same plain attributes (numbers, strings, booleans), and the same
plan specs. An integer attribute equal to the element's own index in its list (a layer
index, whatever it is called) in *every* element is the one attribute allowed to differ:
it is how a layer knows its position, not what it computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = ["find_repeats", "spec_signature"]

_PLAIN = (int, float, bool, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, tuple | list) and all(isinstance(v, _PLAIN) for v in value)


def _value_key(value: Any) -> Any:
    if callable(value) and not isinstance(value, type):
        return (
            f"{getattr(value, '__module__', '?')}."
            f"{getattr(value, '__qualname__', type(value).__qualname__)}"
        )
    if isinstance(value, dict):
        return tuple(sorted((str(k), _value_key(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_value_key(v) for v in value)
    return repr(value)


def spec_signature(spec: ModuleShardingSpec) -> tuple[Any, ...]:
    """Every field of a spec (user and internal) as a hashable, address-free value."""
    return tuple(
        sorted((k, _value_key(v)) for k, v in vars(spec).items() if not k.startswith("_resolved"))
    )


def _attrs(element: nn.Module) -> dict[tuple[str, str], Any]:
    return {
        (rel, k): v
        for rel, mod in element.named_modules(remove_duplicate=False)
        for k, v in vars(mod).items()
        if not k.startswith("_") and k != "training" and _plain(v)
    }


def _element_signature(
    element: nn.Module,
    fqn: str,
    plan: Mapping[str, ModuleShardingSpec],
    attrs: Mapping[tuple[str, str], Any],
    index_like: set[tuple[str, str]],
) -> tuple[Any, ...]:
    parts: list[Any] = [
        tuple(
            sorted((f"{r}.{k}", repr(v)) for (r, k), v in attrs.items() if (r, k) not in index_like)
        )
    ]
    for rel, mod in element.named_modules(remove_duplicate=False):
        params = tuple(
            (n, tuple(p.shape), str(p.dtype), p.requires_grad)
            for n, p in mod._parameters.items()
            if p is not None
        )
        buffers = tuple(
            (n, tuple(b.shape), str(b.dtype)) for n, b in mod._buffers.items() if b is not None
        )
        full = f"{fqn}.{rel}" if rel else fqn
        spec = plan.get(full)
        parts.append(
            (
                rel,
                type(mod).__qualname__,
                type(mod).__module__,
                params,
                buffers,
                spec_signature(spec) if spec else None,
            )
        )
    return tuple(parts)


def find_repeats(model: nn.Module, plan: Mapping[str, ModuleShardingSpec]) -> dict[str, str]:
    """``{element FQN: FQN of the first identical element}`` over every layer stack of ``model``."""
    out: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) < 2:
            continue
        if any(fqn.startswith(f + ".") or fqn == f for f in out):
            continue  # inside an element already shared
        elements = [
            (int(n), e) for n, e in module._modules.items() if e is not None and n.isdigit()
        ]
        attrs = {i: _attrs(e) for i, e in elements}
        # An integer attribute equal to its element's index in every element is a position.
        keys = set.intersection(*(set(a) for a in attrs.values())) if attrs else set()
        index_like = {
            k
            for k in keys
            if all(type(attrs[i][k]) is int and attrs[i][k] == i for i, _ in elements)
        }
        first: dict[tuple[Any, ...], str] = {}
        for i, element in elements:
            path = f"{fqn}.{i}" if fqn else str(i)
            key = _element_signature(element, path, plan, attrs[i], index_like)
            rep = first.setdefault(key, path)
            if rep != path:
                out[path] = rep
    return out
