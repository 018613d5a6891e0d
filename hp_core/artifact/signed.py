"""The artifact file: a frozen plan, the inputs that produced it, and a content signature.

An artifact is canonical JSON (sorted keys, ``(",", ":")`` separators, UTF-8, one
trailing newline)::

    {"format": "hp-artifact", "format_version": 1,
     "inputs": {"hp_version": ..., "plugins": {...}, "model": {...}, "mesh": "tp=2",
                "overrides": [...]},
     "meta": <freeze(plan)>,
     "signature": "sha256:<hex of the canonical JSON of everything else>"}

The signature covers the meta and the inputs, so editing either (or the format
version) is detected. It is an integrity check, not authentication: it catches edits,
corruption and mix-ups, but whoever can write the file can also re-sign it. Files are
written atomically (a temporary file in the same directory, then ``os.replace``), so a
reader never sees half an artifact.

Reading refuses, each with its own :class:`ArtifactError` subclass and a message that
says what to do: a file that is not an artifact (:class:`ArtifactFormatError`), another
format version (:class:`ArtifactVersionError`), a signature mismatch
(:class:`ArtifactSignatureError`), a meta or inputs that do not validate
(:class:`ArtifactSchemaError`: every wrongly typed section or field, named by its key
path), and injections that name registry items no installed plugin provides
(:class:`ArtifactRegistryError`). A file over hp's input limits (size, nesting depth) or
holding a non-finite number is refused before it is parsed, or with its key path, by
:class:`ArtifactLimitError` (see :mod:`hp_core.bounded`). A schema or limit error is also
an :class:`ArtifactFormatError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from hp_core.artifact.freeze import FreezeError, freeze, json_value
from hp_core.artifact.rebuild import MetaError, rebuild
from hp_core.bounded import InputLimitError, loads_json, read_bounded
from hp_core.errors import HpError
from hp_core.plan_items import (
    INJECTION_FIELDS,
    is_import_path,
    missing_plan_items,
    named_injections,
)
from hp_core.plans.errors import PlanError
from hp_core.plans.model import ShardingPlan
from hp_core.plans.overrides import OverridesLike, overrides_to_list
from hp_core.plugins import PluginRegistry, plugin_report
from hp_core.version import __version__

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INJECTION_REGISTRIES",
    "Artifact",
    "ArtifactError",
    "ArtifactFormatError",
    "ArtifactLimitError",
    "ArtifactRegistryError",
    "ArtifactSchemaError",
    "ArtifactSignatureError",
    "ArtifactVersionError",
    "canonical_json",
    "content_signature",
    "dumps_artifact",
    "installed_versions",
    "loads_artifact",
    "make_artifact",
    "missing_registry_items",
    "model_digest",
    "read_artifact",
    "version_drift",
    "write_artifact",
]

FORMAT = "hp-artifact"
#: The artifact layout this hp writes and reads.
FORMAT_VERSION = 1
_SIGNATURE_PREFIX = "sha256:"
_KEYS = ("format", "format_version", "inputs", "meta", "signature")
_INPUT_KEYS = ("hp_version", "mesh", "model", "overrides", "plugins")
#: Config keys that record where or with what a config was saved, not what the model is.
_CONFIG_BOOKKEEPING = ("transformers_version", "_name_or_path", "_commit_hash")
#: Injection field → the registry its plain names refer to (from the one table the plan-time
#: check uses too, :data:`hp_core.plan_items.INJECTION_FIELDS`).
INJECTION_REGISTRIES: Mapping[str, str] = {
    field: registry for field, (_, registry) in INJECTION_FIELDS.items()
}
_REFREEZE = "Re-create it with this hp: hp freeze --model ... --mesh ... -o ARTIFACT."


class ArtifactError(HpError, ValueError):
    """An artifact that cannot be used (base class)."""


class ArtifactFormatError(ArtifactError):
    """Not an hp artifact: unreadable, not JSON, or missing its top-level keys."""


class ArtifactVersionError(ArtifactError):
    """An artifact written in another format version."""


class ArtifactSignatureError(ArtifactError):
    """The content does not match its signature: the file changed after hp wrote it."""


class ArtifactSchemaError(ArtifactFormatError):
    """A correctly signed artifact whose meta or inputs do not validate (a wrongly typed
    section or field included); the message names the key path."""


class ArtifactLimitError(ArtifactFormatError, InputLimitError):
    """An artifact over hp's input limits (size, nesting depth) or holding a number JSON
    cannot represent (NaN, Infinity): refused before or while it is parsed."""


class ArtifactRegistryError(ArtifactError):
    """Injections that name registry items no installed plugin provides."""


def canonical_json(data: Any) -> bytes:
    """Sorted keys, fixed separators, UTF-8, no NaN, one trailing newline: stable bytes."""
    text = json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return (text + "\n").encode("utf-8")


def _digest(data: Any) -> str:
    return _SIGNATURE_PREFIX + hashlib.sha256(canonical_json(data)).hexdigest()


def content_signature(body: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical JSON of an artifact's body (all but its signature)."""
    return _digest(body)


def _plain(value: Any) -> Any:
    """A JSON-safe rendering of a config value (unknown objects by their ``str``)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and value == value and value not in (float("inf"), float("-inf")):
        return value
    return str(value)


def model_digest(model: nn.Module) -> str:
    """``sha256:...`` of the model's class, config (less bookkeeping keys) and parameter shapes.

    Equal for two builds of the same architecture and config (meta device or not), different
    when a size, a layer count or the class changes.
    """
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    config_data = None
    if callable(to_dict):
        config_data = {k: v for k, v in to_dict().items() if k not in _CONFIG_BOOKKEEPING}
    cls = type(model)
    return _digest(
        {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "config": _plain(config_data),
            "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()],
        }
    )


def installed_versions() -> dict[str, Any]:
    """hp's version and each loaded plugin's ``{distribution, version}`` (the built-in too)."""
    plugins = {
        info.name: {"distribution": info.distribution, "version": info.version}
        for info in plugin_report()
        if info.status in ("builtin", "loaded")
    }
    return {"hp_version": __version__, "plugins": plugins}


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A frozen plan with its inputs and signature. ``plan()`` rebuilds the plan."""

    meta: dict[str, Any]
    inputs: dict[str, Any]
    signature: str
    format_version: int = FORMAT_VERSION

    def body(self) -> dict[str, Any]:
        """Everything the signature covers."""
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "inputs": self.inputs,
            "meta": self.meta,
        }

    def plan(self, *, model: nn.Module | None = None) -> ShardingPlan:
        """The plan (``rebuild(meta, model=model)``)."""
        return rebuild(self.meta, model=model)


def make_artifact(
    plan: ShardingPlan, *, model: nn.Module, overrides: OverridesLike = None
) -> Artifact:
    """Freeze ``plan`` and sign it together with the inputs that produced it.

    ``model`` is the model the plan was made for (its digest is recorded) and ``overrides``
    the overrides passed to ``plan()`` (recorded in their normalized YAML-document form).
    """
    meta = freeze(plan)
    try:
        override_data = overrides_to_list(overrides)
    except PlanError as e:
        raise FreezeError(f"overrides: {e}") from None
    config = getattr(model, "config", None)
    inputs = {
        **installed_versions(),
        "mesh": ",".join(
            f"{n}={s}" for n, s in zip(plan.mesh_axis_names, plan.mesh_shape or (), strict=False)
        ),
        "model": {
            "class": type(model).__qualname__,
            "model_type": getattr(config, "model_type", None),
            "digest": model_digest(model),
        },
        "overrides": json_value(override_data, "overrides"),
    }
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, "inputs": inputs, "meta": meta}
    return Artifact(meta=meta, inputs=inputs, signature=_digest(body))


def dumps_artifact(artifact: Artifact) -> bytes:
    """The artifact's canonical bytes (what :func:`write_artifact` writes)."""
    return canonical_json({**artifact.body(), "signature": artifact.signature})


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ArtifactFormatError(
                f"duplicate key {key!r}: an artifact is canonical JSON. {_REFREEZE}"
            )
        out[key] = value
    return out


def _schema_error(source: str, path: str, expected: str, got: Any) -> ArtifactSchemaError:
    shown = repr(got)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ArtifactSchemaError(
        f"{source}: {path}: expected {expected}, got {type(got).__name__} {shown}. {_REFREEZE}"
    )


def _check_str(source: str, path: str, value: Any, *, optional: bool = False) -> None:
    if isinstance(value, str) or (optional and value is None):
        return
    raise _schema_error(source, path, "a string or null" if optional else "a string", value)


def _check_keys(source: str, path: str, value: Any, keys: tuple[str, ...]) -> None:
    if not isinstance(value, dict):
        raise _schema_error(source, path, f"a mapping with the keys {', '.join(keys)}", value)
    if sorted(value) != sorted(keys):
        raise ArtifactSchemaError(
            f"{source}: {path}: expected the keys {', '.join(keys)}, got {sorted(value)}. "
            f"{_REFREEZE}"
        )


def _check_inputs(source: str, inputs: dict[str, Any]) -> None:
    """Every field of a signed artifact's inputs has the type hp freeze writes."""
    _check_str(source, "inputs.hp_version", inputs["hp_version"])
    _check_str(source, "inputs.mesh", inputs["mesh"])
    model = inputs["model"]
    _check_keys(source, "inputs.model", model, ("class", "digest", "model_type"))
    _check_str(source, "inputs.model.class", model["class"])
    _check_str(source, "inputs.model.digest", model["digest"])
    _check_str(source, "inputs.model.model_type", model["model_type"], optional=True)
    overrides = inputs["overrides"]
    if not isinstance(overrides, list):
        raise _schema_error(source, "inputs.overrides", "a list of override entries", overrides)
    for i, entry in enumerate(overrides):
        if not isinstance(entry, dict):
            raise _schema_error(
                source, f"inputs.overrides[{i}]", "a mapping (an override entry)", entry
            )
        if "match" not in entry:
            raise ArtifactSchemaError(
                f"{source}: inputs.overrides[{i}]: has no 'match'. {_REFREEZE}"
            )
        _check_str(source, f"inputs.overrides[{i}].match", entry["match"])
    plugins = inputs["plugins"]
    if not isinstance(plugins, dict):
        raise _schema_error(
            source, "inputs.plugins", "a mapping of plugin name to {distribution, version}", plugins
        )
    for name, info in plugins.items():
        where = f"inputs.plugins[{name!r}]"
        _check_keys(source, where, info, ("distribution", "version"))
        _check_str(source, f"{where}.distribution", info["distribution"], optional=True)
        _check_str(source, f"{where}.version", info["version"], optional=True)


def _meta_error(source: str, error: MetaError) -> ArtifactSchemaError:
    message = str(error)
    if not message.startswith(("meta:", "meta.", "meta[")):  # rebuild's paths are inside the meta
        message = f"meta: {message}"
    return ArtifactSchemaError(f"{source}: {message} {_REFREEZE}")


def loads_artifact(
    data: bytes | str, *, source: str = "<artifact>", check_registry: bool = True
) -> Artifact:
    """Parse and verify an artifact (format, version, signature, schema, registry items).

    The text is read under hp's input limits (:mod:`hp_core.bounded`): a file that is too
    large or too deeply nested, or that holds NaN or Infinity, is an :class:`ArtifactLimitError`.
    """
    if not isinstance(data, bytes | str):
        raise ArtifactFormatError(
            f"{source}: expected the artifact's text or bytes, got {type(data).__name__}; to read "
            "a file use read_artifact(path)."
        )
    try:
        doc = loads_json(
            data, source=source, object_pairs_hook=_no_duplicates, error=ArtifactLimitError
        )
    except ArtifactLimitError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactFormatError(
            f"{source}: not an hp artifact (not UTF-8 JSON: {e}). {_REFREEZE}"
        ) from None
    except ArtifactFormatError as e:
        raise ArtifactFormatError(f"{source}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ArtifactFormatError(
            f'{source}: not an hp artifact (no "format": {FORMAT!r}). Artifacts are written by '
            f"hp freeze; a plan YAML file is read with hp_core.load_plan instead."
        )
    version = doc.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise ArtifactVersionError(
            f"{source}: artifact format version {version!r}; this hp ({_hp_version()}) reads "
            f"version {FORMAT_VERSION}. Re-freeze the plan with this hp (hp freeze --model ... "
            "--mesh ... -o ARTIFACT), or use the hp version that wrote it."
        )
    missing = [k for k in _KEYS if k not in doc]
    extra = sorted(k for k in doc if k not in _KEYS)
    if missing or extra:
        raise ArtifactFormatError(
            f"{source}: malformed artifact (missing keys {missing}, unknown keys {extra}). "
            f"{_REFREEZE}"
        )
    body = {k: doc[k] for k in _KEYS if k != "signature"}
    expected = _digest(body)
    if doc["signature"] != expected:
        raise ArtifactSignatureError(
            f"{source}: signature mismatch: the artifact says {str(doc['signature'])[:23]}... but "
            f"its content hashes to {expected[:23]}...; it was edited or corrupted after hp freeze "
            f"wrote it. Do not edit artifacts: change the overrides and re-freeze. {_REFREEZE}"
        )
    inputs = doc["inputs"]
    if not isinstance(inputs, dict) or sorted(inputs) != sorted(_INPUT_KEYS):
        raise ArtifactSchemaError(
            f"{source}: inputs: expected the keys {', '.join(_INPUT_KEYS)}, got "
            f"{sorted(inputs) if isinstance(inputs, dict) else inputs!r}. {_REFREEZE}"
        )
    _check_inputs(source, inputs)
    artifact = Artifact(
        meta=doc["meta"], inputs=inputs, signature=doc["signature"], format_version=version
    )
    try:
        plan = artifact.plan()
    except MetaError as e:
        raise _meta_error(source, e) from None
    if check_registry:
        problems = missing_registry_items(plan)
        if problems:
            raise ArtifactRegistryError(
                f"{source}: the plan injects items that no installed plugin provides:\n  "
                + "\n  ".join(problems)
                + "\nInstall the plugin that provides them (hp plugins lists what is installed; "
                "HP_PLUGINS / HP_DISABLE_PLUGIN_AUTOLOAD may be hiding one), register them with "
                "register_inner_wrapper / register_compute_factory before loading, or re-freeze "
                "the plan without them."
            )
    return artifact


def _hp_version() -> str:
    return f"hp {__version__}"


def missing_registry_items(plan: ShardingPlan) -> list[str]:
    """One line per injection whose registry name is not registered (or whose dotted path's
    package is not installed). Nothing is imported.

    Whether a name is registered is decided by the finder ``hp plan`` / ``hp freeze`` use
    (:func:`hp_core.plan_items.missing_plan_items`, which resolves it as
    ``hp_core.apply`` does); this renders one line per module that names it.
    """
    missing = {(item.field, item.name) for item in missing_plan_items(plan)}
    problems = []
    for fqn, field, name in named_injections(plan):
        where = f"modules[{fqn!r}].{field}"
        if is_import_path(name):
            top = name.split(":", 1)[0].split(".", 1)[0]
            if importlib.util.find_spec(top) is None:
                problems.append(f"{where}: {name!r}: package {top!r} is not installed")
        elif (field, name) in missing:
            kind = INJECTION_REGISTRIES[field]
            known = ", ".join(sorted(PluginRegistry(kind))) or "none"
            recorded = plan.providers.get(f"{kind}.{name}")
            made = (
                f"; it was frozen with {recorded.distribution} {recorded.version or ''}".rstrip()
                + f" (pip install {recorded.requirement()})"
                if recorded is not None
                else ""
            )
            problems.append(
                f"{where}: {name!r} is not a registered {kind.replace('_', ' ')} (registered: "
                f"{known}){made}"
            )
    return problems


def version_drift(artifact: Artifact) -> list[str]:
    """Where the installed hp and plugins differ from the ones that froze the artifact."""
    now = installed_versions()
    then_plugins = artifact.inputs.get("plugins") or {}
    notes = []
    if artifact.inputs.get("hp_version") != now["hp_version"]:
        notes.append(
            f"hp {artifact.inputs.get('hp_version')} froze it; hp {now['hp_version']} is installed"
        )
    for name in sorted(set(then_plugins) | set(now["plugins"])):
        was = (then_plugins.get(name) or {}).get("version")
        has = (now["plugins"].get(name) or {}).get("version")
        if was != has:
            notes.append(f"plugin {name!r}: {was or 'absent'} when frozen, {has or 'absent'} now")
    return notes


def write_artifact(artifact: Artifact, path: str | os.PathLike[str]) -> Path:
    """Write ``artifact`` to ``path`` atomically (a temporary file, then ``os.replace``)."""
    target = Path(path)
    data = dumps_artifact(artifact)
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def read_artifact(path: str | os.PathLike[str], *, check_registry: bool = True) -> Artifact:
    """Read and verify an artifact file (see :func:`loads_artifact`); a file over the size
    limit is refused without being read whole."""
    try:
        data = read_bounded(path, source=str(path), error=ArtifactLimitError)
    except FileNotFoundError:
        raise ArtifactFormatError(
            f"{path}: no such artifact file. Write one with hp freeze (-o PATH)."
        ) from None
    except OSError as e:  # a directory, no permission, ...
        raise ArtifactFormatError(f"{path}: cannot read the artifact: {e.strerror or e}.") from None
    return loads_artifact(data, source=str(path), check_registry=check_registry)
