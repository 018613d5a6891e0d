"""YAML I/O: plan text and files (``dump_plan`` / ``load_plan``), read strictly and within limits.

Security note: a plan or override file names injected code by registry name or by a
``{_target_: pkg.module.function}`` dotted path. Dotted paths are imported only when the
plan is applied, and only from installed hp plugins or packages the user trusted
(``hp_core.trust_packages`` / ``HP_TRUSTED_PACKAGES``). A plan dumped from Python with a
decorated function in it therefore needs that function's package trusted to be loaded
back and applied.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from hp_core.bounded import load_yaml, read_bounded
from hp_core.plans.codec import plan_from_dict, plan_to_dict
from hp_core.plans.errors import PlanError, PlanTypeError, PlanYAMLError, PlanYAMLInputLimitError
from hp_core.plans.model import ShardingPlan
from hp_core.plans.spec_codec import short, tname

__all__ = ["dump_plan", "in_file", "load_plan", "read_source", "yaml_dump", "yaml_load"]

_YAML_SUFFIXES = (".yaml", ".yml", ".json")


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys (YAML would silently keep the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first at line {first.start_mark.line + 1}); YAML would "
                "silently keep only the last one, so hp refuses the document. Remove or merge one "
                "of them",
                key_node.start_mark,
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_source(src: Any, what: str) -> tuple[str, str, bool]:
    """``(text, name, is_file)`` from YAML text or a file path."""
    if isinstance(src, os.PathLike):
        path = os.fspath(src)
    elif isinstance(src, str):
        if "\n" in src or not (src.strip().endswith(_YAML_SUFFIXES) or os.path.isfile(src)):
            return src, "<string>", False
        path = src
    else:
        raise PlanYAMLError(f"{what}: expected YAML text or a file path, got {tname(src)} {src!r}.")
    try:
        # Bounded: a file over the size cap is refused after reading at most the cap.
        data = read_bounded(path, source=str(path), error=PlanYAMLInputLimitError)
        return data.decode("utf-8"), str(path), True
    except FileNotFoundError:
        raise PlanYAMLError(f"{path}: no such file (reading {what}).") from None
    except UnicodeDecodeError as e:
        raise PlanYAMLError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}).") from None
    except OSError as e:
        raise PlanYAMLError(f"{path}: cannot read {what}: {e.strerror or e}.") from None


def yaml_load(text: str, name: str) -> Any:
    """The document in ``text`` (plain data), or a PlanYAMLError naming line and column."""
    # A SafeLoader (plain data only) under hp's input limits: size, depth and alias expansion
    # are refused with a PlanYAMLInputLimitError (an InputLimitError that is also a PlanYAMLError).
    try:
        return load_yaml(text, source=name, loader=_StrictLoader, error=PlanYAMLInputLimitError)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise PlanYAMLError(
            f"{where}: invalid YAML: {detail}. "
            "Fix: correct the document at that line (indentation, a missing ':' or an unclosed "
            "bracket or quote are the usual causes)."
        ) from None


def yaml_dump(data: Any, err: type[PlanError]) -> str:
    """``data`` as block-style YAML text, keys in insertion order."""
    try:
        return yaml.safe_dump(
            data, sort_keys=False, default_flow_style=None, allow_unicode=True, width=4096
        )
    except yaml.YAMLError as e:
        raise err(
            f"cannot be written as YAML (Target config values must be plain data): {e}"
        ) from e


def in_file(e: PlanError, name: str) -> PlanError:
    """``e`` again, its message ending with the file it was read from."""
    return type(e)(f"{e} (in {name})")


def dump_plan(plan: ShardingPlan) -> str:
    """The plan as YAML text; ``load_plan(dump_plan(p)) == p`` and dumping is byte-stable.

    A decorated function in the plan is written as ``{_target_: module.qualname}``; applying
    the loaded plan imports it only if its package is an hp plugin or trusted by the user.
    The distribution and version providing each registry item it names are recorded under
    ``providers:`` (see :mod:`hp_core.plans.providers`).
    """
    if not isinstance(plan, ShardingPlan):
        raise PlanTypeError(
            f"dump_plan: expected a ShardingPlan, got {tname(plan)} {short(plan)}. Pass the plan "
            "that hp_core.plan(...) or load_plan returned."
        )
    return yaml_dump(plan_to_dict(plan), PlanYAMLError)


def load_plan(text_or_path: str | os.PathLike[str]) -> ShardingPlan:
    """Read a plan from YAML text or a ``.yaml``/``.yml``/``.json`` file from :func:`dump_plan`."""
    if not isinstance(text_or_path, (str, os.PathLike)):
        hint = (
            " (it is one already: use it as is, or plan.copy())"
            if isinstance(text_or_path, ShardingPlan)
            else ""
        )
        raise PlanTypeError(
            f"a plan: expected YAML text or a file path, got {tname(text_or_path)} "
            f"{short(text_or_path)} (load_plan takes a str or an os.PathLike){hint}. For a dict, "
            "use hp_core.plans.plan_from_dict."
        )
    text, name, is_file = read_source(text_or_path, "a plan")
    data = yaml_load(text, name)
    try:
        return plan_from_dict(data)
    except PlanError as e:
        if is_file:
            raise in_file(e, name) from e
        raise
