"""A per-test plugin sandbox: fake installed distributions on a temp path, nothing leaking.

``importlib.metadata`` finds a distribution through any ``<name>-<version>.dist-info``
folder on ``sys.path``, so writing one (METADATA + entry_points.txt) next to the plugin's
modules is enough to make a plugin appear, without pip; deleting it makes it disappear.
:class:`PluginSandbox` does that in a temp folder, clears the ``HP_*`` plugin switches of
the outer environment, resets hp's plugin discovery before and after, and on
:meth:`PluginSandbox.close` removes everything it installed (files, ``sys.path`` entries,
imported modules) and restores the environment. It needs no pytest: the ``hp_plugins``
fixture of :mod:`hp_core.testing.pytest_plugin` is one sandbox per test.
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
import os
import re
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from hp_core.errors import HpError
from hp_core.plugins import (
    ENTRY_POINT_GROUP,
    ENV_DISABLE_AUTOLOAD,
    ENV_IMPORT_TIMEOUT,
    ENV_PLUGINS,
    ENV_STRICT,
    PluginInfo,
    plugin_report,
    reset_plugins,
)

__all__ = [
    "ITEMS_GROUP",
    "PLUGIN_ENV_VARS",
    "PluginSandbox",
    "SandboxError",
    "SandboxModuleClashError",
    "SandboxNameError",
    "SandboxNotInstalledError",
]

#: The entry-point group in which a distribution declares the items it provides.
ITEMS_GROUP = "hp_core.items"

#: The environment switches of plugin discovery the sandbox clears and restores.
PLUGIN_ENV_VARS = (ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_STRICT, ENV_IMPORT_TIMEOUT)

# PEP 508 distribution names.
_DIST_NAME = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)
_ENTRY_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class SandboxError(HpError, ValueError):
    """A :class:`PluginSandbox` call got a name or module it cannot install."""


class SandboxNameError(SandboxError):
    """A distribution, entry-point or module name is not valid."""


class SandboxModuleClashError(SandboxError):
    """A module to install is already imported (from elsewhere) in this process."""


class SandboxNotInstalledError(SandboxError, LookupError):
    """``uninstall`` of a distribution this sandbox did not install."""


@dataclass
class _Installed:
    info: Path
    modules: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    path_entry: str | None = None


def _check_module_name(module: str, dist: str) -> None:
    if not module or not all(part.isidentifier() for part in module.split(".")):
        raise SandboxNameError(
            f"module name {module!r} of distribution {dist!r} is not a dotted Python "
            "identifier. Fix: name it like 'my_plugin' or 'my_plugin.plugin'."
        )


class PluginSandbox:
    """Fake plugin distributions in ``root`` (a fresh temp folder by default) on ``sys.path``.

    Use it as a context manager or call :meth:`close`; the ``hp_plugins`` pytest fixture
    does that around each test.
    """

    def __init__(self, root: Path | None = None) -> None:
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="hp-plugins-")) if root is None else Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.installed: dict[str, _Installed] = {}
        self.on_path = False
        self._saved_env = {var: os.environ.get(var) for var in PLUGIN_ENV_VARS}
        for var in PLUGIN_ENV_VARS:
            os.environ.pop(var, None)
        self.show()

    # -- installing -------------------------------------------------------------------

    def install(
        self,
        name: str,
        modules: Mapping[str, str],
        *,
        dist: str | None = None,
        version: str = "0.1.0",
        entry_point: str | None = None,
        items: Mapping[str, str] | None = None,
    ) -> str:
        """Install a plugin with entry point ``name`` and ``modules`` (module -> source).

        The entry point's value is ``entry_point`` (default the first module); ``items``
        (``"<kind>.<item>" -> module``) becomes the ``hp_core.items`` group. Returns the
        distribution name (default ``hp-plugin-<name>``).
        """
        if not modules:
            raise SandboxNameError(
                f"install({name!r}) got no modules. Fix: pass modules={{'module': 'source'}}."
            )
        dist = dist or f"hp-plugin-{name}"
        self.add_distribution(
            dist,
            {name: entry_point or next(iter(modules))},
            version=version,
            modules=modules,
            items=items,
        )
        return dist

    def install_path(
        self,
        src: Path,
        *,
        dist: str,
        version: str = "0.1.0",
        entry_point: str,
        items: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> str:
        """Install the packages already in folder ``src`` (e.g. a plugin's ``src/``).

        ``entry_point`` is the ``hp_core`` entry point's value (``pkg.plugin``); its name is
        ``name`` (default the distribution name without an ``hp-plugin-`` prefix).
        """
        src = Path(src).resolve()
        if not src.is_dir():
            raise SandboxNameError(
                f"install_path: {src} is not a folder. Fix: pass the folder that holds the "
                "plugin's package (its src/)."
            )
        entry_name = name or re.sub(r"^hp[-_]plugin[-_]", "", dist)
        self.add_distribution(dist, {entry_name: entry_point}, version=version, items=items)
        entry = str(src)
        if entry not in sys.path:
            sys.path.insert(0, entry)
            self.installed[dist].path_entry = entry
        importlib.invalidate_caches()
        reset_plugins()
        return dist

    def add_distribution(
        self,
        dist: str,
        entry_points: Mapping[str, str],
        *,
        version: str = "0.1.0",
        modules: Mapping[str, str] | None = None,
        items: Mapping[str, str] | None = None,
        record: Iterable[str] | None = None,
    ) -> Path:
        """The general form: any ``hp_core`` entry points (name -> value), modules, items and
        an optional RECORD (file list); returns the dist-info folder."""
        self._check_names(dist, entry_points, modules or {})
        info = self.root / f"{re.sub(r'[-_.]+', '_', dist)}-{version}.dist-info"
        info.mkdir(parents=True)
        installed = _Installed(info)
        self.installed[dist] = installed
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        text = f"[{ENTRY_POINT_GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        if items:
            text += f"\n[{ITEMS_GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items())
        (info / "entry_points.txt").write_text(text)
        if record is not None:
            (info / "RECORD").write_text("".join(f"{path},,\n" for path in record))
        for module, source in (modules or {}).items():
            path = self.root / (module.replace(".", "/") + ".py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
            installed.modules.append(module)
            installed.files.append(path)
        self.show()
        return info

    def _check_names(
        self, dist: str, entry_points: Mapping[str, str], modules: Mapping[str, str]
    ) -> None:
        if not isinstance(dist, str) or not _DIST_NAME.match(dist):
            raise SandboxNameError(
                f"distribution name {dist!r} is not a valid package name (PEP 508). "
                "Fix: use letters, digits, '-', '_' or '.', e.g. 'hp-plugin-mine'."
            )
        if dist in self.installed:
            raise SandboxNameError(
                f"distribution {dist!r} is already installed in this sandbox. Fix: "
                f"uninstall({dist!r}) first or pick another dist name."
            )
        for name, value in entry_points.items():
            if not _ENTRY_NAME.match(name):
                raise SandboxNameError(
                    f"entry-point name {name!r} of {dist!r} is not valid. Fix: use letters, "
                    "digits, '_', '-' or '.'."
                )
            _check_module_name(value.split(":", 1)[0].strip(), dist)
        ours = {m for inst in self.installed.values() for m in inst.modules}
        for module in modules:
            _check_module_name(module, dist)
            if module in sys.modules and module not in ours:
                origin = getattr(sys.modules[module], "__file__", None) or "built in"
                raise SandboxModuleClashError(
                    f"module {module!r} of distribution {dist!r} is already imported in this "
                    f"process (from {origin}); the plugin would get that module, not the "
                    "source given here. Fix: give the plugin's module a unique name."
                )
            if module in ours:
                raise SandboxModuleClashError(
                    f"module {module!r} of distribution {dist!r} is already installed by "
                    "another distribution of this sandbox. Fix: give it a unique name."
                )

    def uninstall(self, dist: str) -> None:
        """Remove distribution ``dist``: its dist-info, its files, its imported modules."""
        installed = self.installed.pop(dist, None)
        if installed is None:
            raise SandboxNotInstalledError(
                f"uninstall({dist!r}): this sandbox did not install {dist!r}; installed: "
                f"{sorted(self.installed) or 'none'}. Fix: pass the name install() returned."
            )
        shutil.rmtree(installed.info, ignore_errors=True)
        for path in installed.files:
            path.unlink(missing_ok=True)
        self._forget_modules(installed)
        if installed.path_entry is not None and installed.path_entry in sys.path:
            sys.path.remove(installed.path_entry)
        importlib.invalidate_caches()
        reset_plugins()

    @staticmethod
    def _forget_modules(installed: _Installed) -> None:
        prefixes = [m.removesuffix(".__init__") for m in installed.modules]
        if installed.path_entry is not None:
            entry = installed.path_entry
            prefixes += [
                name
                for name, mod in list(sys.modules.items())
                if (getattr(mod, "__file__", None) or "").startswith(entry + os.sep)
            ]
        for name in list(sys.modules):
            if any(name == p or name.startswith(p + ".") for p in prefixes):
                sys.modules.pop(name, None)

    # -- selecting --------------------------------------------------------------------

    def disable(self, name: str) -> None:
        """Leave entry point ``name`` out of ``HP_PLUGINS`` (every other one stays on)."""
        raw = os.environ.get(ENV_PLUGINS)
        if raw is None:
            names = {ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}
        else:
            names = {n.strip() for n in raw.split(",") if n.strip()}
        os.environ[ENV_PLUGINS] = ",".join(sorted(names - {name}))
        reset_plugins()

    def enable_only(self, *names: str) -> None:
        """``HP_PLUGINS`` lists exactly ``names`` (none: no entry-point plugin loads)."""
        os.environ[ENV_PLUGINS] = ",".join(names)
        reset_plugins()

    def report(self) -> list[PluginInfo]:
        """:func:`hp_core.plugins.plugin_report`, after this sandbox's changes."""
        return plugin_report()

    # -- the sandbox folder on sys.path -----------------------------------------------

    def show(self) -> None:
        """Put the sandbox folder on ``sys.path`` (done by every install)."""
        if not self.on_path:
            sys.path.insert(0, str(self.root))
            self.on_path = True
        importlib.invalidate_caches()
        reset_plugins()

    def hide(self) -> None:
        """Take the sandbox folder off ``sys.path``: its distributions disappear (kept on
        disk; :meth:`show` brings them back)."""
        if self.on_path:
            while str(self.root) in sys.path:
                sys.path.remove(str(self.root))
            self.on_path = False
        importlib.invalidate_caches()
        reset_plugins()

    def close(self) -> None:
        """Uninstall everything, take the folder off ``sys.path``, restore the environment."""
        for dist in list(self.installed):
            self.uninstall(dist)
        self.hide()
        for var, value in self._saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        reset_plugins()

    def __enter__(self) -> PluginSandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
