"""Readers that refuse oversized or hostile documents.

hp reads YAML plans and overrides, JSON artifacts, verifier reports and HF config files
that users (or anyone who can write those files) hand it. These readers put caps on
what a document may cost before it becomes Python data:

* its size in bytes (``HP_MAX_INPUT_BYTES``, default 8 MiB);
* its nesting depth (``HP_MAX_INPUT_DEPTH``, default 64), checked before the parser
  recurses, so a 100,000-deep document is refused instead of raising ``RecursionError``;
* for YAML, the number of nodes the document holds once every alias is expanded
  (``HP_MAX_YAML_NODES``, default 100,000), so a "billion laughs" alias bomb is refused
  while it is being read instead of exhausting memory later, and a recursive alias is
  refused outright;
* for JSON, numbers that are not finite (``NaN``, ``Infinity``, ``-Infinity``, ``1e999``)
  and integers too long for Python to read.

Each refusal raises :class:`InputLimitError`, or the subclass of it a caller passes as
``error=`` (one that also derives from the caller's own error class, such as
``PlanYAMLInputLimitError``, so that ``except PlanYAMLError`` catches it too), with a
message naming the source, the path inside the document where it is known, the limit,
and the environment variable that raises it::

    plan.yaml: overrides[3].config: nesting depth over 64 (line 12, column 17); hp refuses
    deeper documents. If the document is legitimate, raise the limit: HP_MAX_INPUT_DEPTH=128.

A keyword argument (``max_bytes=``, ``max_depth=``, ``max_nodes=``) overrides the
environment variable, which overrides the default. The environment is read at each call;
a malformed value there (``HP_MAX_INPUT_DEPTH=lots``) raises the same ``error=`` class.
"""

from __future__ import annotations

from hp_core.bounded.json_reader import loads_json
from hp_core.bounded.limits import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_NODES,
    ENV_MAX_BYTES,
    ENV_MAX_DEPTH,
    ENV_MAX_NODES,
    InputLimitError,
    InputLimits,
    check_size,
    read_bounded,
)
from hp_core.bounded.yaml_reader import load_yaml

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_NODES",
    "ENV_MAX_BYTES",
    "ENV_MAX_DEPTH",
    "ENV_MAX_NODES",
    "InputLimitError",
    "InputLimits",
    "check_size",
    "load_yaml",
    "loads_json",
    "read_bounded",
]
