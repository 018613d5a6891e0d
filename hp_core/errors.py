"""The root of hp's exceptions.

Every error hp raises because of what a user gave it (a plan, an override, a model, an
input batch) derives from :class:`HpError`, so ``except hp_core.HpError`` catches them
all; each also derives from the builtin type that describes it (``ValueError``, ...).
"""

from __future__ import annotations

__all__ = ["HpError"]


class HpError(Exception):
    """Something hp refuses, with a message that names the culprit and the fix."""
