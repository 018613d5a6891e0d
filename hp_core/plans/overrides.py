"""User overrides: ``OverrideEntry``, reading and writing them, and merging them into a plan.

Overrides are lists of :class:`OverrideEntry` (from Python or YAML) that
:func:`resolve_overrides` merges into the derived boundaries with the "unset inherits,
set wins" rule (docs/plans.md, "Overrides"; :func:`hp_core.spec.merge.merge_specs`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Union

import yaml

from hp_core.plans.errors import (
    DuplicateOverrideError,
    IncompleteOverrideError,
    OverrideError,
    OverrideMatchWarning,
    OverridesTypeError,
    PlanError,
)
from hp_core.plans.spec_codec import (
    LAYOUT_FIELDS,
    OVERRIDE_FIELDS,
    build_spec,
    check_keys,
    short,
    spec_to_data,
    tname,
)
from hp_core.plans.yaml_io import in_file, read_source, yaml_dump, yaml_load
from hp_core.spec.axes import CANONICAL_AXES
from hp_core.spec.keywords import close_matches, did_you_mean, keyword_checked
from hp_core.spec.merge import IncompleteContractError, finalize_insert, merge_specs
from hp_core.spec.module_spec import ModuleShardingSpec, copy_spec
from hp_core.spec.placements import UnsupportedPartialError, check_lowerable

__all__ = [
    "WHEN_VALUES",
    "OverrideEntry",
    "OverridesLike",
    "compile_glob",
    "dump_overrides",
    "is_glob",
    "load_overrides",
    "overrides_to_list",
    "resolve_overrides",
]

#: Values of an override entry's ``when:`` (``sp`` = sequence parallel is on).
WHEN_VALUES = ("tp", "cp", "ep", "sp")
_ENTRY_EXAMPLE = (
    "  - match: model.layers.*.mlp\n    when: tp\n    out_dst: {output: {tp: replicate}}"
)


def _check_when(value: Any, path: str, err: type[PlanError] = OverrideError) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and str(value) in WHEN_VALUES:
        return str(value)
    hint = did_you_mean(value.lower(), WHEN_VALUES) if isinstance(value, str) else ""
    raise err(
        f"{path}: {value!r} is not a valid 'when'.{hint} Valid values: {', '.join(WHEN_VALUES)} "
        "(the entry applies only while that axis is active; sp = sequence parallel is on). "
        "Leave 'when' out to apply the entry always."
    )


@keyword_checked
@dataclasses.dataclass(frozen=True)
class OverrideEntry:
    """One user override: a module FQN or glob, the spec to merge, an optional axis condition.

    ``source`` (e.g. ``overrides[2]``) names the entry in error messages; it does not
    take part in equality. An empty ``match`` names the root module.
    """

    match: str
    spec: ModuleShardingSpec
    when: str | None = None
    source: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        where = self.source or "OverrideEntry"
        if not isinstance(self.source, str):
            raise OverrideError(f"OverrideEntry.source: expected a string, got {self.source!r}.")
        if not isinstance(self.match, str):
            raise OverrideError(
                f"{where}.match: expected a module FQN or glob string, got {tname(self.match)} "
                f"{self.match!r}."
            )
        if not isinstance(self.spec, ModuleShardingSpec):
            raise OverrideError(
                f"{where}: expected a ModuleShardingSpec, got {tname(self.spec)} {self.spec!r}. "
                "Write ModuleShardingSpec(...) in Python, or an entry with match: and spec fields "
                "in YAML."
            )
        if self.spec.skip_source_lowering is not None:
            raise OverrideError(f"{where}.skip_source_lowering: {_SKIP_LOWERING_MSG}")
        object.__setattr__(self, "when", _check_when(self.when, f"{where}.when"))


_SKIP_LOWERING_MSG = "set by codegen (hp freeze) only, not by overrides. Remove it."
_OVERRIDE_INTERNAL_MSG = (
    "internal fields (leading underscore) are set by the planner and applier, never by "
    f"overrides. Remove it; an override may set: {', '.join(OVERRIDE_FIELDS)}."
)
_ENTRY_KEYS = ("match", "when", *OVERRIDE_FIELDS)

#: What :func:`load_overrides` (and so ``plan(overrides=...)``) accepts.
OverridesLike = Union[
    None,
    str,
    os.PathLike[str],
    Mapping[str, ModuleShardingSpec],
    Iterable[Union[OverrideEntry, Mapping[str, Any]]],
]


def _entry_from_mapping(raw: Any, path: str) -> OverrideEntry:
    err = OverrideError
    if not isinstance(raw, Mapping):
        raise err(
            f"{path}: expected a mapping with a 'match' key, got {tname(raw)} {raw!r}. An entry "
            f"looks like:\n{_ENTRY_EXAMPLE}"
        )
    check_keys(
        raw,
        path,
        err,
        _ENTRY_KEYS,
        internal_hint=_OVERRIDE_INTERNAL_MSG,
        special={"skip_source_lowering": _SKIP_LOWERING_MSG},
    )
    match = raw.get("match")
    if match is None:
        raise err(
            f"{path}: missing required key 'match' (the FQN or glob of the module(s) this entry "
            f"overrides). Add it, e.g.\n{_ENTRY_EXAMPLE}"
        )
    if not isinstance(match, str):
        raise err(
            f"{path}.match: expected a module FQN or glob string, got {tname(match)} {match!r}."
        )
    when = _check_when(raw.get("when"), f"{path}.when")
    spec = build_spec(raw, path, err, OVERRIDE_FIELDS, module=match)
    return OverrideEntry(match, spec, when, source=path)


def _entries_from_document(doc: Any, name: str) -> list[OverrideEntry]:
    err = OverrideError
    if doc is None:
        return []
    if isinstance(doc, Mapping):
        if "match" in doc:
            raise err(
                "overrides: the document is a single entry; write entries as a list (prefix the "
                f"entry with '- '), e.g.\n{_ENTRY_EXAMPLE}"
            )
        check_keys(doc, "overrides", err, ("overrides",))
        items = doc.get("overrides")
        if items is None:
            return []
    else:
        items = doc
    if not isinstance(items, list):
        hint = ""
        if isinstance(items, str) and name == "<string>" and "\n" not in items.strip():
            hint = " (If this was meant as a file path: no such file exists.)"
        raise err(
            f"overrides: expected a list of entries or {{overrides: [...]}}, got {tname(items)} "
            f"{items!r}.{hint} An entry looks like:\n{_ENTRY_EXAMPLE}"
        )
    entries = [_entry_from_mapping(item, f"overrides[{i}]") for i, item in enumerate(items)]
    _check_duplicates(entries)
    return entries


def load_overrides(text_or_path_or_list: OverridesLike) -> list[OverrideEntry]:
    """Normalize overrides from YAML (text or file), ``{fqn: spec}``, or a list of entries/dicts.

    A YAML document is a list of entries or ``{overrides: [...]}``; each entry has
    ``match`` (FQN or glob), optional ``when`` and spec fields. Every problem raises
    :class:`OverrideError` (or :class:`PlanYAMLError` for unreadable YAML) naming its path.

    Two exact entries (no glob) for the same module with the same ``when`` raise
    :class:`DuplicateOverrideError`: merge them into one entry. Entries with different
    ``when`` conditions may name the same module; those that apply merge in list order.
    """
    src = text_or_path_or_list
    if src is None:
        return []
    if isinstance(src, (str, os.PathLike)):
        text, name, is_file = read_source(src, "overrides")
        doc = yaml_load(text, name)
        try:
            return _entries_from_document(doc, name)
        except PlanError as e:
            if is_file:
                raise in_file(e, name) from e
            raise
    if isinstance(src, Mapping):
        if set(src) == {"overrides"} and not isinstance(src["overrides"], ModuleShardingSpec):
            return _entries_from_document(src, "<dict>")
        entries = []
        for key, spec in src.items():
            path = f"overrides[{key!r}]"
            if not isinstance(key, str):
                raise OverrideError(
                    f"overrides: keys must be module FQN or glob strings, got {tname(key)} {key!r}."
                )
            if not isinstance(spec, ModuleShardingSpec):
                raise OverrideError(
                    f"{path}: expected a ModuleShardingSpec, got {tname(spec)} {spec!r}. In Python "
                    f"write {{{key!r}: ModuleShardingSpec(...)}}; for dict entries use a list: "
                    f"[{{'match': {key!r}, ...}}]."
                )
            entries.append(OverrideEntry(key, spec, None, source=path))
        return entries
    if not isinstance(src, Iterable):
        hint = (
            " Key a spec by the module it overrides: {'model.layers.0.mlp': "
            "ModuleShardingSpec(...)}."
            if isinstance(src, ModuleShardingSpec)
            else ""
        )
        raise OverridesTypeError(
            f"overrides: expected YAML text, a file path, {{fqn: ModuleShardingSpec}} or a list of "
            f"entries, got {tname(src)} {short(src)}.{hint}"
        )
    out: list[OverrideEntry] = []
    for i, item in enumerate(src):
        path = f"overrides[{i}]"
        if isinstance(item, OverrideEntry):
            out.append(item if item.source else dataclasses.replace(item, source=path))
        else:
            out.append(_entry_from_mapping(item, path))
    _check_duplicates(out)
    return out


def _entry_text(entry: OverrideEntry) -> str:
    """One line of an entry's content, for messages (YAML flow style where it can be written)."""
    item: dict[str, Any] = {"match": entry.match}
    if entry.when is not None:
        item["when"] = entry.when
    try:
        item.update(
            spec_to_data(
                entry.spec,
                entry.source or "overrides",
                OverrideError,
                fields=OVERRIDE_FIELDS,
                internals=False,
                strict=False,
            )
        )
        return yaml.safe_dump(
            item, default_flow_style=True, sort_keys=False, width=1 << 16, allow_unicode=True
        ).strip()
    except (PlanError, yaml.YAMLError):
        return f"{item!r} {entry.spec!r}"


def _check_duplicates(entries: Sequence[OverrideEntry]) -> None:
    seen: dict[tuple[str, str | None], tuple[int, OverrideEntry]] = {}
    for i, entry in enumerate(entries):
        if is_glob(entry.match):
            continue
        key = (entry.match, entry.when)
        if key not in seen:
            seen[key] = (i, entry)
            continue
        j, first = seen[key]
        a, b = first.source or f"overrides[{j}]", entry.source or f"overrides[{i}]"
        cond = f"when: {entry.when}" if entry.when is not None else "no 'when'"
        raise DuplicateOverrideError(
            f"{a} and {b} are both exact overrides for module {entry.match!r} ({cond}); the second "
            "would silently replace every field the first also sets.\n"
            f"  {a} (entry {j}): {_entry_text(first)}\n"
            f"  {b} (entry {i}): {_entry_text(entry)}\n"
            f"Fix: merge them into one entry for {entry.match!r} (for a field both set, keep the "
            "value you want). Entries with different 'when:' conditions may name the same module; "
            "those that apply merge in list order."
        )


def overrides_to_list(entries: OverridesLike) -> list[dict[str, Any]]:
    """Override entries as plain data (the list :func:`dump_overrides` writes)."""
    out = []
    for e in load_overrides(entries):
        path = e.source or "overrides"
        item: dict[str, Any] = {"match": e.match}
        if e.when is not None:
            item["when"] = e.when
        item.update(
            spec_to_data(
                e.spec, path, OverrideError, fields=OVERRIDE_FIELDS, internals=False, strict=True
            )
        )
        out.append(item)
    return out


def dump_overrides(entries: OverridesLike) -> str:
    """Override entries as a YAML ``{overrides: [...]}`` document, for :func:`load_overrides`."""
    return yaml_dump({"overrides": overrides_to_list(entries)}, OverrideError)


# ----------------------------------------------------------------- resolution


def is_glob(pattern: str) -> bool:
    """Whether an override key is a glob (has ``*``, ``?`` or ``[``) rather than an exact FQN."""
    return any(c in pattern for c in "*?[")


def compile_glob(pattern: str, *, path: str = "match") -> re.Pattern[str]:
    """An FQN glob as a ``fullmatch`` regex: ``*`` (crosses dots), ``?``, ``[...]``, ``[!...]``."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not out or out[-1] != ".*":
                out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:  # no closing bracket: a literal '['
                out.append(re.escape(c))
                continue
            body, i = pattern[i:j], j + 1
            negate, body = body.startswith("!"), body.removeprefix("!")
            chars = [
                "-" if ch == "-" and 0 < k < len(body) - 1 else re.escape(ch)
                for k, ch in enumerate(body)
            ]
            out.append(("[^" if negate else "[") + "".join(chars) + "]")
        else:
            out.append(re.escape(c))
    try:
        return re.compile("".join(out), re.DOTALL)
    except re.error as e:
        raise OverrideError(
            f"{path}: {pattern!r} is not a valid glob ({e}). Check its [...] ranges."
        ) from None


def _iter_axes(spec: ModuleShardingSpec, prefix: str) -> Iterator[tuple[str, str]]:
    for name in LAYOUT_FIELDS:
        value = getattr(spec, name)
        if isinstance(value, Mapping):
            for key, named in value.items():
                if isinstance(named, Mapping):
                    for axis in named:
                        yield f"{prefix}.{name}.{key}.{axis}", str(axis)


def _validate_entry(
    entry: OverrideEntry,
    mesh_axes: tuple[str, ...],
    module_set: set[str],
    module_names: Sequence[str],
) -> re.Pattern[str] | None:
    source = entry.source or "overrides"
    for name in LAYOUT_FIELDS:  # a spec's fields can be assigned after construction: check again
        value = getattr(entry.spec, name)
        for key, named in value.items() if isinstance(value, Mapping) else ():
            for axis, p in named.items() if isinstance(named, Mapping) else ():
                try:
                    check_lowerable(p, path=f"{source}.{name}.{key}.{axis}", module=entry.match)
                except UnsupportedPartialError as e:
                    raise OverrideError(str(e)) from e
    for path, axis in _iter_axes(entry.spec, source):
        if axis.startswith("dp"):
            raise OverrideError(
                f"{path}: placement on data-parallel axis {axis!r}. dp stays outside the plan: "
                "FSDP/DDP own it and a plan describes one dp slice. Remove this axis from the "
                f"override and apply FSDP/DDP over the {axis!r} mesh dimension after hp."
            )
        if axis in mesh_axes or axis in CANONICAL_AXES:
            continue
        best = close_matches(axis, mesh_axes, n=1) or close_matches(axis, CANONICAL_AXES, n=1)
        hint = f" Did you mean {best[0]!r}?" if best else ""
        raise OverrideError(
            f"{path}: mesh axis {axis!r} is neither a dimension of the mesh {mesh_axes} nor a "
            f"canonical axis name.{hint} Use one of the mesh's dimension names."
        )
    if is_glob(entry.match):
        return compile_glob(entry.match, path=f"{source}.match")
    if entry.match not in module_set:
        close = close_matches(entry.match, module_names, n=3)
        hint = (
            f" Close matches: {', '.join(repr(c) for c in close)}."
            if close
            else " No module has a similar name."
        )
        raise OverrideError(
            f"{source}.match: {entry.match!r} is not a module of the model.{hint} An exact key "
            "must name a module from model.named_modules(); use a glob (*, ?, [...]) to match "
            "several."
        )
    return None


def resolve_overrides(
    derived: Mapping[str, ModuleShardingSpec],
    overrides: OverridesLike,
    *,
    module_names: Sequence[str],
    active: Iterable[str],
    mesh_axis_names: Sequence[str],
) -> tuple[dict[str, ModuleShardingSpec], list[str]]:
    """Merge user overrides into the derived boundaries (docs/plans.md, "Overrides").

    Every entry is validated first (spec values, mesh axes, no dp, exact FQNs exist).
    Entries whose ``when`` axis is not in ``active`` are skipped. An exact key merges into
    the boundary there or inserts a new one (full contract required); a glob merges into
    every matching derived boundary in model order and warns when it matches none.
    Entries apply in list order. Returns the new specs in model order and the merge notes;
    neither ``derived`` nor the override specs are mutated.
    """
    entries = load_overrides(overrides)
    order = [str(n) for n in module_names]
    module_set = set(order)
    mesh_axes = tuple(str(a) for a in mesh_axis_names)
    active_set = {str(a) for a in active}
    for fqn, spec in derived.items():
        if fqn not in module_set:
            raise PlanError(
                f"derived boundary {fqn!r} is not in module_names; pass model.named_modules() "
                "names."
            )
        if not isinstance(spec, ModuleShardingSpec):
            raise PlanError(f"derived[{fqn!r}]: expected a ModuleShardingSpec, got {tname(spec)}.")
    patterns = [_validate_entry(e, mesh_axes, module_set, order) for e in entries]

    state = {fqn: copy_spec(derived[fqn]) for fqn in order if fqn in derived}
    derived_order = list(state)
    notes: list[str] = []

    def merge_into(fqn: str, entry: OverrideEntry, source: str) -> None:
        merged, merge_notes = merge_specs(state[fqn], entry.spec, fqn=fqn)
        state[fqn] = copy_spec(merged)
        notes.extend(f"{source}: {note}" for note in merge_notes)

    for entry, pattern in zip(entries, patterns, strict=True):
        source = entry.source or "overrides"
        if entry.when is not None and entry.when not in active_set:
            notes.append(
                f"{source}: skipped ({entry.match!r} when: {entry.when}; {entry.when} is not "
                "active)"
            )
            continue
        if pattern is None:
            if entry.match in state:
                merge_into(entry.match, entry, source)
                continue
            try:
                state[entry.match] = copy_spec(finalize_insert(entry.spec, fqn=entry.match))
            except IncompleteContractError as e:
                raise IncompleteOverrideError(f"{source}: {e}") from e
            notes.append(f"{source}: inserted a new boundary at {entry.match!r}")
            continue
        hits = [fqn for fqn in derived_order if pattern.fullmatch(fqn)]
        if hits:
            for fqn in hits:
                merge_into(fqn, entry, source)
            continue
        modules_hit = [n for n in order if pattern.fullmatch(n)]
        if modules_hit:
            why = (
                f"; it matches {len(modules_hit)} module(s) (e.g. {modules_hit[0]!r}) that are not "
                "boundaries: insert one with an exact FQN and a full contract"
            )
        else:
            close = close_matches(entry.match, derived_order, n=2)
            why = "; check the pattern ('*' crosses dots)" + (
                f", close boundaries: {', '.join(repr(c) for c in close)}" if close else ""
            )
        message = f"{source}: glob {entry.match!r} matched no derived boundary{why}."
        warnings.warn(message, OverrideMatchWarning, stacklevel=2)
        notes.append(message)
    return {fqn: state[fqn] for fqn in order if fqn in state}, notes
