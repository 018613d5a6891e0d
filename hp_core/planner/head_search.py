"""Which values a tp-sharded block's forward divides by a head count: found, then proven.

A hand-written attention block reads its head counts where its author put them: a plain
config object it holds (``self.config.n_head``), an attribute under a name of its own
(``n_local_heads`` counting kv heads, ``dim`` the query width), or the input's own width
(``B, T, C = x.size()``). A list of names cannot know them all, so names are only a hint:
the candidates are every positive integer attribute of the block, and of each plain
(non-Module) object it holds, that tp divides and whose value the global program shows in
a shape; plus, where a caller offers it, the input's hidden width. The search tries sets
of them, known names first and smallest sets first, a bounded number of times, and keeps
the first set whose local program is the global one scaled (the local-program gate's
comparison, :func:`hp_core.planner.fused_proof._compare`). The proof is the reason a set is
chosen; no set found leaves the caller's refusal as it was.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hp_core.planner.local_width import INPUT_WIDTH

__all__ = ["candidates", "search_local_attrs", "shapes_shown"]
#: Names that usually count heads or hold a width made of heads: tried first.
_KNOWN = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "n_query_groups",
    "num_query_groups",
    "n_kv_head",
    "n_kv_heads",
    "num_kv_heads",
    "num_key_value_heads",
    "n_local_heads",
    "dim",
    "n_embd",
    "hidden_size",
    "embed_dim",
)
#: Names of a per-head width: tried last (dividing them is the usual wrong answer).
_PER_HEAD = ("head_dim", "head_size", "hd", "d_head", "head_width")
#: Per-layer indices and the like: never a head count.
_SKIP = frozenset(("layer_idx", "layer_id", "layer_number", "block_idx", "layer_index"))
#: At most this many attributes in one set, and this many sets tried per block.
MAX_SET = 3
MAX_TRIES = 48


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _plain_holder(value: Any) -> bool:
    """A plain object whose attributes a forward reads (a dataclass or transformers config)."""
    if isinstance(value, nn.Module | torch.Tensor | type) or callable(value):
        return False
    return hasattr(value, "__dict__") and not isinstance(value, type(torch))


def _rank(path: str) -> int:
    leaf = path.rpartition(".")[2]
    if leaf in _KNOWN:
        return _KNOWN.index(leaf)
    if leaf in _PER_HEAD:
        return len(_KNOWN) + 1
    return len(_KNOWN)


def candidates(block: nn.Module, tp: int, shown: set[int], taken: Iterable[str] = ()) -> list[str]:
    """The block's integer attributes (``name``) and its plain objects' (``holder.name``)
    that tp divides and whose value is a dim in ``shown`` (the global program's shapes),
    known head-count names first, per-head widths last; none of ``taken``."""
    skip = set(taken)
    found: list[str] = []

    def offer(path: str, value: Any) -> None:
        leaf = path.rpartition(".")[2]
        if leaf.startswith("_") or leaf in _SKIP or path in skip or not _int(value):
            return
        if value % tp == 0 and value in shown and path not in found:
            found.append(path)

    for name, value in vars(block).items():
        if name.startswith("_"):
            continue
        if _plain_holder(value):
            for leaf, inner in vars(value).items():
                offer(f"{name}.{leaf}", inner)
        else:
            offer(name, value)
    return sorted(found, key=_rank)  # stable: attribute order within a rank


def search_local_attrs(
    block: nn.Module,
    tp: int,
    shown: set[int],
    base: Mapping[str, tuple[int, int]],
    attempt: Callable[[dict[str, tuple[int, int]]], bool],
    *,
    width: int | None = None,
) -> dict[str, tuple[int, int]] | None:
    """The first set of candidates (added to ``base``) for which ``attempt(attrs)`` holds,
    as a tp-local attribute plan, or None.

    ``attempt`` runs the local program with ``attrs`` local (an ``INPUT_WIDTH`` entry: the
    region's input of that width read as local, :mod:`hp_core.planner.local_width`) and
    says whether it is the global program scaled. ``width``: the region input's hidden
    width, offered as the last candidate (None: not offered).
    """
    names = candidates(block, tp, shown, base)
    offer = width is not None and width % tp == 0 and INPUT_WIDTH not in base
    pool: list[str] = [*names, *([INPUT_WIDTH] if offer else [])]
    tries = 0
    for size in range(1, min(MAX_SET, len(pool)) + 1):
        for chosen in itertools.combinations(pool, size):
            tries += 1
            if tries > MAX_TRIES:
                return None
            attrs = dict(base)
            for path in chosen:
                value = width if path == INPUT_WIDTH else _value(block, path)
                if value is not None:
                    attrs[path] = (value, value // tp)
            if attempt(attrs):
                return attrs
    return None


def _value(block: nn.Module, path: str) -> int:
    holder, _, leaf = path.rpartition(".")
    owner = getattr(block, holder) if holder else block
    return int(getattr(owner, leaf))


def shapes_shown(ops: Mapping[str, Iterable[Any]]) -> set[int]:
    """Every dim size in the recorded ops (``fused_proof._Op``) of a program."""
    out: set[int] = set()
    for rel_ops in ops.values():
        for op in rel_ops:
            out.update(op.in_shape)
            for shape in op.outs:
                out.update(shape)
    return out
