"""The plugin conformance suite itself: each check passes a good plugin and fails a broken
one with a message naming the plugin, what is wrong and the fix.

The plugins are fake distributions in the per-test sandbox (``hp_plugins``); each check is
called as the method it is, the way pytest calls it in a plugin's ``TestConformance``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from hp_core.testing import EquivalenceCase, FamilyModel
from hp_core.testing.conformance import PluginConformance
from hp_core.testing.equivalence_case import EquivalenceCaseError
from hp_core.testing.surface import PUBLIC_SURFACE
from tests import _conformance_cases as cases

Failed = pytest.fail.Exception
MODULE = "hp_plugin_fk.plugin"
GOOD = """
from hp_core import Role, RoleRule
from hp_core.hookspecs import hookimpl

HP_PLUGIN_API = 2

@hookimpl
def hp_register_templates(register):
    register(RoleRule("fk.rule", r"fc_in\\.weight$", Role.COLWISE, ("FakeArch",)))
"""
ITEMS = {"template.fk.rule": MODULE}
CHECKS = [
    "test_entry_point_is_declared_and_importable",
    "test_requires_a_compatible_hp_core",
    "test_declares_the_plugin_api",
    "test_loads_with_provenance",
    "test_registers_exactly_the_declared_items",
    "test_imports_only_the_public_hp_core_surface",
]


def _install(
    sandbox,
    body: str = GOOD,
    *,
    items=ITEMS,
    requires=("hp-core>=0.1,<0.2",),
    entry: str = MODULE,
) -> Path:
    info = sandbox.add_distribution(
        "hp-plugin-fk",
        {"fk": entry},
        modules={"hp_plugin_fk.__init__": "", MODULE: body},
        items=items,
    )
    with (info / "METADATA").open("a") as f:
        f.writelines(f"Requires-Dist: {r}\n" for r in requires)
    return info


def _suite(**attrs) -> PluginConformance:
    fields = {"distribution": "hp-plugin-fk", "entry_point": "fk", "package": "hp_plugin_fk"}
    return type("TestFake", (PluginConformance,), {**fields, **attrs})()


def _fails(check: str, *words: str, **attrs) -> str:
    with pytest.raises(Failed) as failed:
        getattr(_suite(**attrs), check)()
    text = str(failed.value)
    who = f"plugin {attrs.get('entry_point', 'fk')!r} ({attrs.get('distribution', 'hp-plugin-fk')})"
    assert text.startswith((who, "TestFake")), text
    assert "\nFix: " in text, text
    for word in words:
        assert word in text, (word, text)
    return text


def test_a_good_plugin_passes_every_check(hp_plugins, monkeypatch):
    _install(hp_plugins)
    suite = _suite()
    for check in CHECKS:
        getattr(suite, check)()
    suite.test_can_be_left_out_with_hp_plugins(monkeypatch)


def test_an_undeclared_and_an_unregistered_item_are_named(hp_plugins):
    _install(hp_plugins, items={"template.fk.other": MODULE, "template.fk.rule": "x.y"})
    _fails(
        "test_registers_exactly_the_declared_items",
        "registered but not declared none",
        "declared but not registered ['template.fk.other']",
        "template.fk.rule = x.y",
        '"template.fk.rule" = "hp_plugin_fk.plugin"',
    )


def test_no_items_table_is_a_failure_with_the_table_to_paste(hp_plugins):
    _install(hp_plugins, items=None)
    _fails("test_registers_exactly_the_declared_items", "declares no items", "template.fk.rule")


def test_a_malformed_items_entry_is_named(hp_plugins):
    _install(hp_plugins, items={**ITEMS, "gadget.fk.x": MODULE})
    _fails("test_registers_exactly_the_declared_items", "malformed entries", "gadget")


@pytest.mark.parametrize(
    ("requires", "words"),
    [
        ((), ["does not require hp-core", 'dependencies = ["hp-core>=0.1,<0.2"]']),
        (("hp-core>=0.2",), ["excludes the installed hp-core"]),
        (("hp-core>=0.1",), ["no upper bound", "hp-core>=0.1,<0.2"]),
    ],
    ids=["missing", "excludes", "unbounded"],
)
def test_a_bad_hp_core_requirement_is_named(hp_plugins, requires, words):
    _install(hp_plugins, requires=requires)
    _fails("test_requires_a_compatible_hp_core", *words)


def test_another_plugin_api_is_refused(hp_plugins):
    _install(hp_plugins, GOOD.replace("HP_PLUGIN_API = 2", "HP_PLUGIN_API = 1"))
    _fails("test_declares_the_plugin_api", "HP_PLUGIN_API = 1", "set HP_PLUGIN_API = 2")
    _fails("test_loads_with_provenance", "hp did not load it", "hp plugins")


def test_a_plugin_registering_nothing_fails(hp_plugins):
    _install(hp_plugins, "HP_PLUGIN_API = 2\n", items={"template.fk.rule": MODULE})
    _fails("test_loads_with_provenance", "registered nothing")


def test_entry_point_problems_are_named(hp_plugins):
    _install(hp_plugins, "raise RuntimeError('boom')\n")
    _fails("test_entry_point_is_declared_and_importable", "RuntimeError: boom")
    _fails(
        "test_entry_point_is_declared_and_importable", "no entry point 'other'", entry_point="other"
    )
    _fails(
        "test_entry_point_is_declared_and_importable", "outside its package", package="elsewhere"
    )


def test_an_uninstalled_distribution_and_missing_attributes_fail():
    _fails("test_loads_with_provenance", "no installed distribution", distribution="hp-plugin-no")
    _fails("test_loads_with_provenance", "does not set 'package'", package="")


def test_a_private_import_is_named(hp_plugins):
    _install(hp_plugins, GOOD + "from hp_core.planner.templates import Role as _R\n")
    _fails(
        "test_imports_only_the_public_hp_core_surface",
        "imports module hp_core.planner.templates",
        PUBLIC_SURFACE[1],
    )


def test_left_out_the_others_are_unchanged_and_it_comes_back(hp_plugins, monkeypatch):
    _install(hp_plugins)
    hp_plugins.add_distribution(
        "hp-plugin-other",
        {"other": "hp_plugin_other"},
        modules={"hp_plugin_other": GOOD.replace("fk.rule", "other.rule")},
    )
    _suite().test_can_be_left_out_with_hp_plugins(monkeypatch)


# ------------------------------------------------------------------ equivalence


def test_no_cases_fails_unless_the_opt_out_says_why():
    with pytest.raises(Failed, match=r"(?s)declares no equivalence cases.*no_equivalence_reason"):
        _suite().test_equivalence(None)
    with pytest.raises(Failed, match="without saying why"):
        _suite(equivalence=(), no_equivalence_reason="no").test_equivalence(None)
    _suite(equivalence=(), no_equivalence_reason="tested in test_x.py on gloo").test_equivalence(
        None
    )


def _fails_case(case: EquivalenceCase, *words: str) -> None:
    with pytest.raises(Failed) as failed:
        _suite().test_equivalence(case)
    for word in ("plugin 'fk' (hp-plugin-fk): equivalence case", "\nFix: ", *words):
        assert word in str(failed.value), (word, str(failed.value))


def test_a_case_that_cannot_run_fails_with_the_refusal():
    case = EquivalenceCase(FamilyModel("llama"), cases.batch_differing_per_rank)
    _fails_case(case, "could not run: InputMismatchError")


def test_the_case_generator_parametrizes_one_test_per_case():
    suite = _suite(equivalence=[EquivalenceCase.family("phi3"), EquivalenceCase.family("bloom")])

    class Meta:
        fixturenames = ["case"]
        calls: list = []

        def parametrize(self, name, values, ids):
            self.calls.append((name, [v and v.id for v in values], ids))

    meta = Meta()
    suite.pytest_generate_tests(meta)  # type: ignore[arg-type]
    assert meta.calls == [("case", ["phi3-tp=2", "bloom-tp=2"], ["phi3-tp=2", "bloom-tp=2"])]
    Meta.calls = []
    _suite().pytest_generate_tests(meta)  # type: ignore[arg-type]
    assert meta.calls == [("case", [None], ["no-cases"])]
    Meta.calls, Meta.fixturenames = [], ["monkeypatch"]
    _suite().pytest_generate_tests(meta)  # type: ignore[arg-type]
    assert meta.calls == []  # the other tests are not parametrized


def test_family_factories_are_seeded_and_picklable():
    case = EquivalenceCase.family("llama", {"tp": 2}, steps=3)
    assert (case.id, case.kwargs()["steps"], case.kwargs()["mesh"]) == ("llama-tp=2", 3, {"tp": 2})
    model, again = case.model_factory(), pickle.loads(pickle.dumps(case)).model_factory()
    assert all(a.equal(b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    assert model.config.pad_token_id is None
    first, second = case.batch_factory(0), case.batch_factory(1)
    assert first["input_ids"].equal(case.batch_factory(0)["labels"])
    assert not first["input_ids"].equal(second["input_ids"])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"model_factory": 3}, "model_factory=3"),
        ({"steps": 0}, "steps=0"),
        ({"modes": ("fast",)}, "modes=('fast',)"),
    ],
)
def test_a_bad_case_is_refused_when_built(kwargs, words):
    fields = {"model_factory": FamilyModel("llama"), "batch_factory": "m:f", **kwargs}
    with pytest.raises(EquivalenceCaseError, match="Fix:") as refused:
        EquivalenceCase(**fields)
    assert words in str(refused.value)
