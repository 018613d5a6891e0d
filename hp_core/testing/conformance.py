"""The conformance suite every hp plugin runs: subclass :class:`PluginConformance` in its tests.

::

    from hp_core.testing.conformance import EquivalenceCase, PluginConformance

    class TestConformance(PluginConformance):
        distribution = "hp-plugin-gpt"   # the distribution name (pyproject [project] name)
        entry_point = "gpt"              # its entry point in the hp_core group
        package = "hp_plugin_gpt"        # its import package
        equivalence = [EquivalenceCase(model_factory=tiny_gpt, batch_factory=gpt_batch)]

pytest collects the ``test_*`` methods: the entry point is declared and importable, the
``hp-core`` requirement admits the installed hp-core and has an upper bound, the plugin
declares the plugin API this hp-core speaks, it loads with provenance, it registers
exactly the items its metadata declares (entry-point group ``hp_core.items``), it can be
left out with ``HP_PLUGINS`` without touching the others, it imports only hp-core's public
surface, and each equivalence case matches one device through
:func:`hp_core.testing.check_equivalence`. A plugin with nothing to compare sets
``equivalence = ()`` and says why in ``no_equivalence_reason``; leaving ``equivalence``
unset fails. Every failure names the plugin, what is wrong and the fix. ``docs/conformance.md``
describes each check.

This module imports pytest (its fixtures and ``pytest.fail``), so it is not imported by
``hp_core.testing`` itself; import it from here.
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import importlib.util
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from hp_core.hookspecs import PLUGIN_API_ATTRIBUTE, PLUGIN_API_VERSION
from hp_core.plugins import (
    ENTRY_POINT_GROUP,
    ENV_DISABLE_AUTOLOAD,
    ENV_PLUGINS,
    ENV_STRICT,
    ITEMS_GROUP,
    RegisteredItem,
    declared_items,
    declared_problems,
    plugin_packages,
    plugin_report,
    registered_items,
    reset_plugins,
)
from hp_core.scaffold import hp_core_requirement
from hp_core.testing.equivalence import check_equivalence
from hp_core.testing.equivalence_case import EquivalenceCase
from hp_core.testing.equivalence_report import EquivalenceError, EquivalenceReport
from hp_core.testing.surface import private_hp_imports

__all__ = ["EquivalenceCase", "PluginConformance"]

_CORE_DIST = "hp-core"


def _declared_by(dist: str) -> tuple[dict[tuple[str, str], str], list[str]]:
    """What ``dist`` declares in ``hp_core.items``: ``(kind, name) -> module``, and the
    messages of its malformed entries (``hp_core.plugins.declared_problems``)."""
    mine = canonicalize_name(dist)
    declared = {
        (item.kind.value, item.name): item.module
        for item in declared_items()
        if canonicalize_name(item.distribution) == mine
    }
    problems = [p for p in declared_problems() if f"distribution {dist} " in p]
    return declared, problems


def _key(item: RegisteredItem) -> tuple[str, str]:
    return (item.kind.value, item.name)


def _load_problem(ep: importlib_metadata.EntryPoint) -> str | None:
    """``Type: message`` of what importing the entry point raised, or None."""
    try:
        ep.load()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _run_case(case: EquivalenceCase) -> EquivalenceReport | Exception:
    """The case's report, or the exception the check raised (reported by the caller outside
    the ``except`` block, so pytest shows the message and not two tracebacks)."""
    try:
        return check_equivalence(case.model_factory, case.batch_factory, **case.kwargs())
    except Exception as e:
        return e


class PluginConformance:
    """The public conformance tests of an hp plugin; subclass it as ``Test...`` and set the
    class attributes below (``docs/conformance.md``)."""

    #: The distribution name, as in the plugin's ``pyproject.toml`` (``hp-plugin-gpt``).
    distribution: ClassVar[str] = ""
    #: Its entry-point name in the ``hp_core`` group (how ``HP_PLUGINS`` names it).
    entry_point: ClassVar[str] = ""
    #: Its import package (the public-surface check reads this package's source).
    package: ClassVar[str] = ""
    #: The equivalence cases; ``()`` with :attr:`no_equivalence_reason` opts out explicitly.
    equivalence: ClassVar[Sequence[EquivalenceCase] | None] = None
    #: Why the plugin has no equivalence case (required when ``equivalence = ()``).
    no_equivalence_reason: ClassVar[str] = ""

    # ------------------------------------------------------------------ helpers

    @pytest.fixture(autouse=True)
    def _hp_plugin_env(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        """No HP_* plugin switches from outside; a fresh discovery before and after."""
        for var in (ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_STRICT):
            monkeypatch.delenv(var, raising=False)
        reset_plugins()
        yield
        reset_plugins()

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """One ``test_equivalence`` per case (one that checks the opt-out when there is none)."""
        if "case" not in metafunc.fixturenames:
            return
        cases = list(type(self).equivalence or ())
        if cases:
            metafunc.parametrize("case", cases, ids=[case.id for case in cases])
        else:
            metafunc.parametrize("case", [None], ids=["no-cases"])

    def _who(self) -> str:
        return f"plugin {self.entry_point!r} ({self.distribution})"

    def _fail(self, what: str, fix: str) -> NoReturn:
        pytest.fail(f"{self._who()}: {what}\nFix: {fix}", pytrace=False)

    def _dist(self) -> importlib_metadata.Distribution:
        cls = type(self).__name__
        for attr in ("distribution", "entry_point", "package"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr):
                pytest.fail(
                    f"{cls} (a PluginConformance) does not set {attr!r}.\nFix: set the class "
                    "attributes distribution = 'hp-plugin-x', entry_point = 'x' and "
                    "package = 'hp_plugin_x'.",
                    pytrace=False,
                )
        try:
            return importlib_metadata.distribution(self.distribution)
        except importlib_metadata.PackageNotFoundError:
            self._fail(
                "no installed distribution of that name: hp discovers plugins from installed "
                "metadata, so it cannot find this one.",
                "install it (pip install -e <the plugin's folder>), or correct "
                f"{type(self).__name__}.distribution.",
            )

    def _entry_point(self) -> importlib_metadata.EntryPoint:
        dist = self._dist()
        mine = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        for ep in mine:
            if ep.name == self.entry_point:
                return ep
        names = ", ".join(f"{ep.name} = {ep.value}" for ep in mine) or "none"
        self._fail(
            f"the distribution declares no entry point {self.entry_point!r} in the "
            f"{ENTRY_POINT_GROUP!r} group (it declares: {names}).",
            f"add [project.entry-points.{ENTRY_POINT_GROUP}] {self.entry_point} = "
            f'"{self.package}.plugin" to its pyproject.toml and reinstall it.',
        )

    def _mine(self) -> list[RegisteredItem]:
        return [
            item
            for item in registered_items()
            if item.provider == self.entry_point or item.distribution == self.distribution
        ]

    # ------------------------------------------------------------------ the tests

    def test_entry_point_is_declared_and_importable(self) -> None:
        """The distribution declares the entry point, in its own package, and it imports."""
        ep = self._entry_point()
        if ep.module.split(".", 1)[0] != self.package:
            self._fail(
                f"its entry point {ep.name} = {ep.value} is outside its package {self.package!r}.",
                f"point the entry point at a module of {self.package} (or correct "
                f"{type(self).__name__}.package).",
            )
        clashes = sorted(
            f"{other.dist.metadata['Name'] if other.dist else '?'} ({other.value})"
            for other in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
            if other.name == ep.name
            and other.dist is not None
            and canonicalize_name(other.dist.metadata["Name"])
            != canonicalize_name(self.distribution)
        )
        if clashes:
            self._fail(
                f"another distribution declares the entry point name {ep.name!r} too: "
                f"{', '.join(clashes)}; only one of them can load.",
                "give the plugin an entry-point name no other installed plugin uses.",
            )
        problem = _load_problem(ep)
        if problem is not None:
            self._fail(
                f"importing its entry point {ep.name} = {ep.value} raised {problem}",
                f"make the module import without errors (python -c 'import {ep.module}' "
                "shows the traceback).",
            )

    def test_requires_a_compatible_hp_core(self) -> None:
        """The ``hp-core`` requirement admits the installed version and has an upper bound."""
        dist = self._dist()
        installed = importlib_metadata.version(_CORE_DIST)
        suggested = hp_core_requirement(installed)
        reqs = [Requirement(text) for text in dist.requires or ()]
        core = [r for r in reqs if canonicalize_name(r.name) == _CORE_DIST and not r.marker]
        if not core:
            self._fail(
                f"its metadata does not require {_CORE_DIST} (requires: "
                f"{', '.join(map(str, reqs)) or 'nothing'}).",
                f'add dependencies = ["{suggested}"] to its pyproject.toml.',
            )
        (req,) = core
        if not req.specifier.contains(installed, prereleases=True):
            self._fail(
                f"it requires {req}, which excludes the installed hp-core {installed}.",
                f'widen the requirement to "{suggested}" once the plugin works with {installed}.',
            )
        if not any(spec.operator in ("<", "<=", "==", "~=", "===") for spec in req.specifier):
            self._fail(
                f"it requires {req} with no upper bound: a later hp-core may change the hook "
                "specs (the plugin API) under it.",
                f'bound it to the minor releases it was tested with: "{suggested}".',
            )

    def test_declares_the_plugin_api(self) -> None:
        """The plugin object declares ``HP_PLUGIN_API`` equal to this hp-core's version."""
        plugin: Any = self._entry_point().load()
        declared = getattr(plugin, PLUGIN_API_ATTRIBUTE, None)
        if declared != PLUGIN_API_VERSION:
            self._fail(
                f"it declares {PLUGIN_API_ATTRIBUTE} = {declared!r}; this hp-core speaks plugin "
                f"API {PLUGIN_API_VERSION} and refuses the plugin.",
                f"set {PLUGIN_API_ATTRIBUTE} = {PLUGIN_API_VERSION} in {plugin.__name__} after "
                "porting it to this API (docs/plugins.md lists what changed).",
            )

    def test_loads_with_provenance(self) -> None:
        """``plugin_report`` shows it loaded; each of its items names its distribution."""
        version = self._dist().version
        rows = [r for r in plugin_report() if r.name == self.entry_point]
        if len(rows) != 1 or rows[0].status != "loaded":
            seen = "; ".join(f"{r.status}: {r.error or r.note or ''}" for r in rows) or "absent"
            self._fail(
                f"hp did not load it (plugin_report row: {seen}).",
                "run `hp plugins` to see why, and repair what its error names.",
            )
        row, mine = rows[0], self._mine()
        if (row.distribution, row.version) != (self.distribution, version):
            self._fail(
                f"its report row names {row.distribution} {row.version}, not "
                f"{self.distribution} {version}: another distribution provides this entry point.",
                "uninstall the other distribution or rename the entry point.",
            )
        if not mine:
            self._fail(
                "it loaded but registered nothing.",
                "implement at least one hp_register_* hook (see docs/plugins.md).",
            )
        foreign = [
            f"{item.kind.value} {item.name!r} ({item.provider}, {item.distribution})"
            for item in mine
            if (item.provider, item.distribution, item.version)
            != (self.entry_point, self.distribution, version)
        ]
        if foreign or row.items != len(mine):
            self._fail(
                f"its report row counts {row.items} item(s), the registries hold {len(mine)} "
                f"from it; mismatched provenance: {', '.join(foreign) or 'none'}.",
                "register items only through the hooks' register callbacks, never with the "
                "register_* functions at import time.",
            )

    def test_registers_exactly_the_declared_items(self) -> None:
        """What it registers is what its ``hp_core.items`` metadata declares, no more, no less."""
        self._dist()
        ep = self._entry_point()
        declared, problems = _declared_by(self.distribution)
        registered = {_key(item) for item in self._mine()}
        lines = "\n".join(f'"{k}.{n}" = "{ep.value}"' for k, n in sorted(registered))
        table = f'[project.entry-points."{ITEMS_GROUP}"]\n{lines}'
        if not declared and not problems:
            self._fail(
                f"its metadata declares no items (entry-point group {ITEMS_GROUP!r}), so hp "
                "cannot name it when one of its items is missing.",
                f"add to its pyproject.toml and reinstall:\n{table}",
            )
        undeclared = sorted(f"{k}.{n}" for k, n in registered - declared.keys())
        unregistered = sorted(f"{k}.{n}" for k, n in declared.keys() - registered)
        wrong_module = sorted(f"{k}.{n} = {v}" for (k, n), v in declared.items() if v != ep.value)
        if problems or undeclared or unregistered or wrong_module:
            self._fail(
                "its registrations and its declared items differ: "
                f"malformed entries {problems or 'none'}; "
                f"registered but not declared {undeclared or 'none'}; declared but not "
                f"registered {unregistered or 'none'}; declared for another module than its "
                f"entry point ({ep.value}): {wrong_module or 'none'}.",
                f"make the pyproject's table list exactly what the hooks register, and "
                f"reinstall:\n{table}",
            )

    def test_can_be_left_out_with_hp_plugins(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Left out with ``HP_PLUGINS`` nothing of it is registered and the other plugins are
        unchanged; selected again it comes back with the same items."""
        self._entry_point()
        before = {_key(item): item.provider for item in registered_items()}
        mine = {_key(item) for item in self._mine()}
        others = sorted(
            r.name for r in plugin_report() if r.status == "loaded" and r.name != self.entry_point
        )
        monkeypatch.setenv(ENV_PLUGINS, ",".join(others))
        reset_plugins()
        rows = [r for r in plugin_report() if r.name == self.entry_point]
        left = {
            _key(item): item.provider
            for item in registered_items()
            if item.provider == self.entry_point
            or item.distribution == self.distribution
            or getattr(item.value, "__module__", "").split(".")[0] == self.package
        }
        rest = {_key(item): item.provider for item in registered_items()}
        expected_rest = {k: v for k, v in before.items() if k not in mine}
        if left or [r.status for r in rows] != ["disabled"] or self.package in plugin_packages():
            self._fail(
                f"with {ENV_PLUGINS}={','.join(others)} it is still active: report "
                f"{[r.status for r in rows]}, items {sorted(left)}, trusted package "
                f"{self.package in plugin_packages()}.",
                "register items only from the hooks (nothing at import time), so leaving the "
                "plugin out leaves nothing of it behind.",
            )
        if rest != expected_rest:
            changed = sorted(set(rest.items()) ^ set(expected_rest.items()))
            self._fail(
                f"leaving it out changed the other plugins' items: {changed}.",
                "do not register, replace or remove other plugins' items; only the hooks' "
                "register callbacks may add this plugin's own.",
            )
        monkeypatch.delenv(ENV_PLUGINS)
        reset_plugins()
        back = {_key(item) for item in self._mine()}
        if back != mine:
            self._fail(
                f"selected again it registered {sorted(back)} instead of {sorted(mine)}.",
                "make the hooks register the same items on every discovery (no state kept "
                "between calls).",
            )

    def test_imports_only_the_public_hp_core_surface(self) -> None:
        """Its source imports only hp-core's public modules and names (read with ``ast``)."""
        self._dist()
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            self._fail(
                f"its package {self.package!r} is not importable.",
                f"install the plugin, or correct {type(self).__name__}.package.",
            )
        origin = Path(spec.origin)
        root = origin.parent if spec.submodule_search_locations else origin
        bad = private_hp_imports(root)
        if bad:
            self._fail(
                "it imports private hp-core modules or names, which may change in any "
                "release:\n" + "\n".join(bad),
                "import from hp_core, hp_core.hookspecs, hp_core.injection, "
                "hp_core.collectives, hp_core.context, hp_core.plugins or hp_core.testing "
                "(docs/plugins.md lists the public surface), or ask for the name to be made "
                "public.",
            )

    def test_equivalence(self, case: EquivalenceCase | None) -> None:
        """Each case: sharded matches one device in both modes (``check_equivalence``)."""
        if case is None:
            self._require_opt_out()
            return
        outcome = _run_case(case)
        if isinstance(outcome, EquivalenceError):
            self._fail(
                f"equivalence case {case.id!r} does not match one device:\n{outcome}",
                "correct the role, template or injection the worst tensor's placements point "
                "at (hp plan --explain-roles shows which rule assigned each role).",
            )
        if isinstance(outcome, Exception):
            self._fail(
                f"equivalence case {case.id!r} could not run: {type(outcome).__name__}: {outcome}",
                "make the plan apply (the error above names the culprit), or correct the case.",
            )
        if not outcome.worst:
            self._fail(
                f"equivalence case {case.id!r} compared nothing.",
                "give the case a model with parameters and a batch that produces a loss.",
            )

    def _require_opt_out(self) -> None:
        reason = type(self).no_equivalence_reason
        if type(self).equivalence is None:
            self._fail(
                f"{type(self).__name__} declares no equivalence cases, so nothing shows the "
                "sharded model matches one device.",
                "set equivalence = [EquivalenceCase(model_factory=..., batch_factory=..., "
                "mesh='tp=2')] on a tiny model, or equivalence = () with "
                "no_equivalence_reason = '<where the plugin's equivalence is tested>'.",
            )
        if not isinstance(reason, str) or len(reason.split()) < 3:
            self._fail(
                f"{type(self).__name__} sets equivalence = () without saying why "
                f"(no_equivalence_reason = {reason!r}).",
                "set no_equivalence_reason to a sentence naming where the plugin's "
                "equivalence is tested, or add an EquivalenceCase.",
            )
