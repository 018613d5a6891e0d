"""hp-core's version, in one place: the package, artifacts and reports read it from here."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
