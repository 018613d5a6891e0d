"""``python -m hp_core.cli``: the ``hp`` command."""

from __future__ import annotations

import sys

from hp_core.cli import main

if __name__ == "__main__":  # importing this module (a package walk) must not run hp
    sys.exit(main())
