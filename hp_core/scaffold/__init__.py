"""``hp plugin new``'s generator: an installable plugin skeleton that passes its own tests.

:func:`write_skeleton` writes ``hp-plugin-NAME/`` (pyproject with the ``hp_core`` entry
point, the ``hp_core.items`` table and a compatible ``hp-core`` range; the package with
``py.typed`` and a hook module; tests: the conformance suite with one equivalence case on
a tiny seeded model, and a rule test; a README). The file texts are in
:mod:`hp_core.scaffold.files`; :func:`skeleton_files` fills them in.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as importlib_metadata
import keyword
import re
from pathlib import Path

from hp_core.errors import HpError
from hp_core.hookspecs import PLUGIN_API_VERSION
from hp_core.plugins import BUILTIN_PLUGIN_NAME, USER_PROVIDER
from hp_core.scaffold.files import FILES, ITEM_NAMES
from hp_core.version import __version__

__all__ = [
    "ScaffoldError",
    "Skeleton",
    "check_architecture",
    "check_name",
    "hp_core_requirement",
    "skeleton_files",
    "write_skeleton",
]

_NAME = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
_MAX_NAME = 40
_PLACEHOLDER = re.compile(r"\{\{[a-z_]+\}\}")


class ScaffoldError(HpError, ValueError):
    """``hp plugin new`` cannot write the skeleton: a bad name or an existing folder."""


def check_name(name: str) -> str:
    """``name`` if it can name a plugin (entry point ``name``, package ``hp_plugin_name``).

    Lowercase letters, digits and single underscores, starting with a letter, at most 40
    characters, no Python keyword, not ``builtin``/``user`` (hp's own providers).
    """
    suggestion = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    suggestion = suggestion.removeprefix("hp_plugin_") or "my_model"
    if not suggestion[0].isalpha():
        suggestion = f"p{suggestion}"
    if keyword.iskeyword(suggestion) or suggestion in (BUILTIN_PLUGIN_NAME, USER_PROVIDER):
        suggestion = f"my_{suggestion}"
    if name.startswith(("hp_plugin", "hp-plugin")):
        why = "it already starts with hp_plugin (the generator adds that prefix)"
    elif not _NAME.fullmatch(name):
        why = (
            "a plugin name is lowercase letters, digits and single underscores, starting "
            "with a letter (it becomes the entry-point name and part of the package name)"
        )
    elif len(name) > _MAX_NAME:
        why = f"it is longer than {_MAX_NAME} characters"
    elif keyword.iskeyword(name) or name in (BUILTIN_PLUGIN_NAME, USER_PROVIDER):
        why = "hp or Python reserves it"
    else:
        return name
    raise ScaffoldError(
        f"plugin name {name!r}: {why}. Fix: pass a name like {suggestion[:_MAX_NAME]!r} "
        f"(hp plugin new {suggestion[:_MAX_NAME]})."
    )


def check_architecture(architecture: str) -> str:
    """``architecture`` if it is a class name (``GPT2LMHeadModel``), else :class:`ScaffoldError`."""
    if architecture.isidentifier() and not keyword.iskeyword(architecture):
        return architecture
    raise ScaffoldError(
        f"--architecture {architecture!r} is not a class name: hp matches an architecture "
        "against the model's config.architectures (a Hugging Face model) or its class name. "
        "Fix: pass the model class name, e.g. --architecture GPT2LMHeadModel."
    )


def hp_core_requirement(version: str) -> str:
    """``hp-core>=X.Y,<X.(Y+1)`` for hp-core ``version`` (one minor release: a minor release
    may change the plugin API)."""
    major, minor = (int(part) for part in re.findall(r"\d+", version)[:2])
    return f"hp-core>={major}.{minor},<{major}.{minor + 1}"


def _installed_version() -> str:
    try:
        return importlib_metadata.version("hp-core")
    except importlib_metadata.PackageNotFoundError:  # a source tree that is not installed
        return __version__


@dataclasses.dataclass(frozen=True)
class Skeleton:
    """What one skeleton is made of: its names, its architecture and the hp-core it targets."""

    name: str
    architecture: str
    hp_core_version: str

    @property
    def dist(self) -> str:
        """The distribution (and folder) name: ``hp-plugin-NAME`` with hyphens."""
        return "hp-plugin-" + self.name.replace("_", "-")

    @property
    def package(self) -> str:
        """The import package: ``hp_plugin_NAME``."""
        return f"hp_plugin_{self.name}"

    @property
    def model_class(self) -> str:
        """The tiny stand-in model's class: ``Tiny<Name>Model``."""
        return "Tiny" + "".join(part.capitalize() for part in self.name.split("_")) + "Model"

    @property
    def items(self) -> list[str]:
        """The ``hp_core.items`` entries the skeleton declares, ``kind.name``."""
        return [f"{kind}.{self.name}.{suffix}" for kind, suffix in ITEM_NAMES]

    def fields(self) -> dict[str, str]:
        """The value of each ``{{placeholder}}`` of the file templates."""
        module = f"{self.package}.plugin"
        return {
            "name": self.name,
            "dist": self.dist,
            "package": self.package,
            "architecture": self.architecture,
            "model_class": self.model_class,
            "requirement": hp_core_requirement(self.hp_core_version),
            "plugin_api": str(PLUGIN_API_VERSION),
            "items": "\n".join(f'"{item}" = "{module}"' for item in self.items),
        }


def _fill(text: str, fields: dict[str, str]) -> str:
    for key, value in fields.items():
        text = text.replace("{{" + key + "}}", value)
    left = _PLACEHOLDER.search(text)
    if left is not None:  # a template names a field fields() does not fill
        raise ScaffoldError(
            f"skeleton template field {left.group()} has no value. Fix: add it to "
            "hp_core.scaffold.Skeleton.fields (a bug in hp; please report it)."
        )
    return text


def skeleton_files(skeleton: Skeleton) -> dict[str, str]:
    """Relative path inside ``hp-plugin-NAME/`` -> the file's text."""
    fields = skeleton.fields()
    return {_fill(path, fields): _fill(text, fields) for path, text in FILES.items()}


def write_skeleton(
    name: str,
    parent: Path,
    *,
    architecture: str | None = None,
    force: bool = False,
    hp_core_version: str | None = None,
) -> tuple[Path, list[Path]]:
    """Write ``parent/hp-plugin-NAME/``; return the folder and the files written.

    ``architecture`` defaults to the tiny model's own class name. An existing folder is
    refused unless ``force`` (then the skeleton's files are overwritten and anything else
    in the folder is left alone). ``hp_core_version`` defaults to the installed hp-core's.
    """
    skeleton = Skeleton(
        name=check_name(name),
        architecture="",
        hp_core_version=hp_core_version or _installed_version(),
    )
    chosen = check_architecture(architecture) if architecture else skeleton.model_class
    skeleton = dataclasses.replace(skeleton, architecture=chosen)
    root = Path(parent) / skeleton.dist
    if root.exists() and not force:
        raise ScaffoldError(
            f"{root} already exists; hp plugin new does not overwrite it. Fix: pass --force "
            "to overwrite the skeleton's files there, or choose another --dir or name."
        )
    if root.exists() and not root.is_dir():
        raise ScaffoldError(
            f"{root} exists and is not a folder. Fix: remove it or choose another --dir."
        )
    written = []
    for rel, text in skeleton_files(skeleton).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return root, written
