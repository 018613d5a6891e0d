"""Which checkpoint tensors make each model tensor: prefixes, renamings, stacked experts.

A checkpoint's keys need not be the model's names. ``save_pretrained`` of a bare
``LlamaModel`` has no ``model.`` prefix that ``LlamaForCausalLM`` has (or the other way
round); and transformers 5 keeps the routed experts of an MoE block batched
(``mlp.experts.gate_up_proj [E, 2I, H]``) while its checkpoints store them one expert at a
time (``mlp.experts.3.gate_proj.weight``), converted on load by the model type's
``WeightConverter`` entries (stack the experts, then concatenate gate and up). This
module reads those entries and describes each model tensor as ``Piece``\\ s: which
checkpoint tensor lands at which expert and offset, so a rank can read the slices of
just the experts and rows it owns. Conversions other than stacking and concatenating are
not interpreted; their tensors show up as missing and unexpected keys. hp's own stacks
(a per-expert ``ModuleList`` that expert parallelism turned into one ``[E, ...]``
parameter, ``hp_core.checkpoint.names``) are pieces the same way: expert ``i`` is the
``i``-th per-expert key.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from hp_core.checkpoint.names import stacked_names
from hp_core.checkpoint.safetensors_files import TensorEntry

__all__ = ["Piece", "Source", "map_keys"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """A checkpoint tensor inside a model tensor: at ``expert`` along dim 0 (None: the piece
    is the whole model tensor), from ``offset`` along the concatenated dim."""

    entry: TensorEntry
    expert: int | None = None
    offset: int = 0


@dataclasses.dataclass(frozen=True)
class Source:
    """The checkpoint tensors that make one model tensor, and the shape they make."""

    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]

    @property
    def keys(self) -> list[str]:
        return [p.entry.key for p in self.pieces]

    def describe(self) -> str:
        keys = self.keys
        return keys[0] if len(keys) == 1 else f"{len(keys)} stacked tensors ({keys[0]}, ...)"


@dataclasses.dataclass(frozen=True)
class _Stacking:
    patterns: tuple[re.Pattern[str], ...]  # one per concatenated part; group 1 is the expert
    target: str
    concat: bool  # parts concatenated along dim 1 of the stack (else one part)


def _conversions(model: Any) -> tuple[list[tuple[str, str]], list[_Stacking]]:
    """The model type's renamings and expert stackings (transformers' conversion table)."""
    # transformers is the hf extra; a model without a config gets no conversions.
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    config = getattr(model, "config", None)
    # The class's own name first, then its bases': FSDP2's fully_shard swaps the model's
    # class for a subclass named FSDP<Class>, which the table does not know.
    table = next(
        (t for c in type(model).__mro__ if (t := get_checkpoint_conversion_mapping(c.__name__))),
        None,
    )
    if table is None and config is not None:
        table = get_checkpoint_conversion_mapping(getattr(config, "model_type", None))
    renames: list[tuple[str, str]] = []
    stackings: list[_Stacking] = []
    for item in table or []:
        ops = [type(op).__name__ for op in getattr(item, "operations", [])]
        sources, targets = list(item.source_patterns), list(item.target_patterns)
        if not ops and len(sources) == len(targets) == 1:
            renames.append((sources[0], targets[0]))
            continue
        merge = ops[:1] == ["MergeModulelist"] and item.operations[0].dim == 0
        concat = ops[1:] == ["Concatenate"] and item.operations[1].dim == 1
        if merge and len(targets) == 1 and (concat or (len(ops) == 1 and len(sources) == 1)):
            pats = tuple(re.compile(s.replace("*", r"(\d+)")) for s in sources)
            stackings.append(_Stacking(pats, targets[0], concat))
    return renames, stackings


def _rename(key: str, renames: Iterable[tuple[str, str]]) -> str:
    for src, dst in renames:
        key = re.sub(src, dst, key)
    return key


def _with_prefix(keys: Iterable[str], names: set[str], prefix: str) -> dict[str, str]:
    """``checkpoint key → model name`` under the prefix rule that matches the most names."""
    keys = list(keys)
    rules = [lambda k: k]
    if prefix:
        rules += [lambda k: f"{prefix}.{k}", lambda k: k.removeprefix(f"{prefix}.")]
    best = max(rules, key=lambda rule: sum(rule(k) in names for k in keys))
    return {k: best(k) for k in keys}


def map_keys(
    model: Any, entries: Mapping[str, TensorEntry], names: Iterable[str]
) -> tuple[dict[str, Source], list[str]]:
    """``model name → Source`` for each of ``names`` the checkpoint holds, and the checkpoint
    keys that went unused."""
    names = set(names)
    renames, stackings = _conversions(model)
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    renamed = {_rename(k, renames): k for k in entries}
    # Stacked experts: group the per-expert keys by target, expert and part.
    parts: dict[str, dict[tuple[int, int], TensorEntry]] = {}
    used: set[str] = set()
    for new, old in renamed.items():
        for stacking in stackings:
            for part, pattern in enumerate(stacking.patterns):
                m = pattern.search(new)
                if m is None:
                    continue
                target = new[: m.start()] + stacking.target + new[m.end() :]
                parts.setdefault(target, {})[int(m.group(1)), part] = entries[old]
                used.add(old)
    plain = _with_prefix([k for k in renamed if renamed[k] not in used], names, prefix)
    stacked = _with_prefix(parts, names, prefix)
    sources: dict[str, Source] = {}
    # hp's stacks: the model's name is the stack, the checkpoint's are the per-expert names.
    by_name = {name: renamed[new] for new, name in plain.items()}
    for name, originals in stacked_names(model).items():
        keys = [by_name.get(o) for o in originals]
        if name in names and all(k is not None for k in keys):
            found = [entries[k] for k in keys if k is not None]
            pieces = tuple(Piece(entry, e) for e, entry in enumerate(found))
            sources[name] = Source(pieces, (len(found), *found[0].shape))
            used.update(k for k in keys if k is not None)
    for new, name in plain.items():
        if name in names:
            entry = entries[renamed[new]]
            sources[name] = Source((Piece(entry),), entry.shape)
            used.add(renamed[new])
    for target, name in stacked.items():
        if name in names:
            sources[name] = _stack(parts[target])
    return sources, sorted(k for k in entries if k not in used)


def _stack(parts: Mapping[tuple[int, int], TensorEntry]) -> Source:
    experts = sorted({e for e, _ in parts})
    count = max(experts) + 1
    pieces: list[Piece] = []
    width = 0
    rest: tuple[int, ...] = ()
    for e in range(count):
        offset = 0
        for p in sorted(q for x, q in parts if x == e):
            entry = parts[e, p]
            pieces.append(Piece(entry, e, offset))
            offset += entry.shape[0]
            rest = entry.shape[1:]
        width = max(width, offset)
    return Source(tuple(pieces), (count, width, *rest))
