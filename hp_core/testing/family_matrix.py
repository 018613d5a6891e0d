"""The differential test matrix: :data:`FAMILIES_MATRIX`, tiny configs of many HF families.

The rows live in :mod:`~hp_core.testing.families_required`,
:mod:`~hp_core.testing.families_extra` and :mod:`~hp_core.testing.families_dense`; the row
type and the shared shape in :mod:`~hp_core.testing.family_config`; the builders that turn a
row into a config, a model or a batch are in :mod:`hp_core.testing.families`. Data only:
importing this module imports no ``transformers``.
"""

from __future__ import annotations

from hp_core.testing.families_dense import DENSE_FAMILIES
from hp_core.testing.families_extra import EXTRA_FAMILIES
from hp_core.testing.families_hybrid import HYBRID_FAMILIES
from hp_core.testing.families_moe import MOE_FAMILIES
from hp_core.testing.families_required import REQUIRED_FAMILIES
from hp_core.testing.family_config import (
    BOS_ID,
    EOS_ID,
    FIRST_ORDINARY_ID,
    PAD_ID,
    PER_LAYER_KEYS,
    Family,
    UnknownFamilyError,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "FAMILIES_MATRIX",
    "FAMILY_NAMES",
    "FIRST_ORDINARY_ID",
    "PAD_ID",
    "PER_LAYER_KEYS",
    "Family",
    "UnknownFamilyError",
]

#: Every family of the matrix, by name, in a stable order.
FAMILIES_MATRIX: dict[str, Family] = {
    f.name: f
    for f in (
        *REQUIRED_FAMILIES,
        *EXTRA_FAMILIES,
        *DENSE_FAMILIES,
        *MOE_FAMILIES,
        *HYBRID_FAMILIES,
    )
}
#: The family names, in the table's order.
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES_MATRIX)
