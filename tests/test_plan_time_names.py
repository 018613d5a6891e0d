"""Names checked at plan time; providers from plugin metadata; providers recorded in plans
(issue 15 item 6: hp_core.plan_items, hp_core.plugins._declared, hp_core.plans.providers,
hp_core.runtime.region_call)."""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import tomllib
from pathlib import Path

import pytest
import torch

import hp_core
from hp_core import cli
from hp_core.artifact import ArtifactRegistryError, dumps_artifact, loads_artifact, make_artifact
from hp_core.injection import InjectionBindingError, UntrustedTargetError, local_compute
from hp_core.plan_items import check_plan_items
from hp_core.planner.lints import PlanningError
from hp_core.plans import PlanYAMLError, dump_plan, load_plan
from hp_core.plans.providers import record_providers
from hp_core.plugins import (
    ITEMS_GROUP,
    RecordedProvider,
    RegistryKind,
    UnknownRegistryItemError,
    declared_problems,
    declared_providers,
    register_compute_factory,
    registered_items,
    reset_plugins,
)
from hp_core.testing import get_world
from hp_core.testing.families import build_family
from tests._plugin_fakes import FakePlugins, clean_plugin_env
from tests.dist_tasks_names import region_wrapper_cases

ROOT = Path(__file__).resolve().parents[1]

ATTN = "model.layers.0.self_attn"
RING = """
from hp_core.hookspecs import hookimpl
from hp_core.injection import inner_wrapper

HP_PLUGIN_API = 2

@inner_wrapper
def ring(target_module, ctx):
    return None

@hookimpl
def hp_register_inner_wrappers(register):
    register("fake_ring", ring, needs_cp=False, region_dispatch=False)
"""


@local_compute
def scaled_mlp(ctx, scale=1.0):
    return None


@pytest.fixture
def env(monkeypatch):
    clean_plugin_env(monkeypatch)
    yield monkeypatch
    reset_plugins()


@pytest.fixture
def fakes(tmp_path, env):
    with FakePlugins(tmp_path) as plugins:
        yield plugins


def _model():
    return build_family("llama", seed=0)


def _wrap(name, **extra):
    return [{"match": ATTN, "inner_target": "self", "inner_wrapper": name, **extra}]


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [
        (n, type(m).__name__) for n, m in model.named_modules()
    ]


def _same(a, b):
    (sa, ma), (sb, mb) = a, b
    return ma == mb and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------ plan-time refusals


BAD = {
    "unknown_name": (_wrap("ring_attn_nobody", region_dispatch=False), UnknownRegistryItemError),
    "config_key": (
        [
            {
                "match": "model.layers.0.mlp",
                "local_compute_fn": {"_target_": "names_mlp", "scal": 2},
                "region_dispatch": False,
            }
        ],
        InjectionBindingError,
    ),
    "untrusted_path": (_wrap("os.path.join", region_dispatch=False), UntrustedTargetError),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_plan_refuses_what_apply_refuses_with_apply_s_error(env, case):
    env.setenv("HP_PLUGINS", "")  # no entry-point plugins: only what the test registers
    register_compute_factory("names_mlp", scaled_mlp)
    overrides, error = BAD[case]
    model = _model()
    before = _state(model)
    with pytest.raises(error) as planned:
        hp_core.plan(model, "tp=2", overrides=overrides)
    assert _same(before, _state(model))
    where = "model.layers.0.mlp'].local_compute_fn" if case == "config_key" else f"{ATTN}'].inner"
    assert str(planned.value).startswith(f"plan['{where}")
    # check_items=False: the old behaviour, the plan is made; apply's preflight (run here by
    # the verifier, on a fake process group) then raises the very same error.
    unchecked = hp_core.plan(model, "tp=2", overrides=overrides, check_items=False)
    with pytest.raises(error) as applied:
        hp_core.verify(model, unchecked)
    assert type(applied.value) is type(planned.value)
    assert str(applied.value) == str(planned.value)
    assert _same(before, _state(model))


def test_check_items_must_be_a_bool():
    with pytest.raises(PlanningError, match="check_items must be True or False"):
        hp_core.plan(_model(), "tp=2", check_items="no")


def test_a_resolvable_plan_is_unchanged_by_the_check(env):
    env.setenv("HP_PLUGINS", "")
    register_compute_factory("names_mlp", scaled_mlp)
    overrides = [
        {
            "match": "model.layers.0.mlp",
            "local_compute_fn": {"_target_": "names_mlp", "scale": 2},
            "region_dispatch": False,
        }
    ]
    checked = hp_core.plan(_model(), "tp=2", overrides=overrides)
    unchecked = hp_core.plan(_model(), "tp=2", overrides=overrides, check_items=False)
    assert checked == unchecked and checked.fingerprint() == unchecked.fingerprint()


# ------------------------------------------------------------------ declared providers


def _ring(fakes, *, items=None, dist="fake-ring", version="0.3", body=RING):
    module = f"fake_ring_{dist.replace('-', '_')}"
    fakes.add_distribution(
        dist,
        {"ring": module},
        version=version,
        modules={module: body},
        items=items if items is not None else {"inner_wrapper.fake_ring": module},
    )
    return module


def _unknown(name="fake_ring", **kw):
    with pytest.raises(UnknownRegistryItemError) as e:
        hp_core.plugins.lookup("inner_wrapper", name, **kw)
    return str(e.value)


def test_declared_and_loaded(fakes, env):
    env.setenv("HP_PLUGINS", "ring")
    module = _ring(fakes, items=None)
    (d,) = declared_providers("inner_wrapper", "fake_ring")
    assert (d.distribution, d.version, d.entry_point, d.module, d.status, d.loaded) == (
        "fake-ring",
        "0.3",
        "ring",
        module,
        "loaded",
        True,
    )
    assert hp_core.plugins.lookup("inner_wrapper", "fake_ring").distribution == "fake-ring"
    assert declared_providers(RegistryKind.INNER_WRAPPER, "fake_ring") == [d]
    assert declared_providers("compute_factory", "fake_ring") == []


def test_declared_but_disabled_names_the_distribution_and_hp_plugins(fakes, env):
    env.setenv("HP_PLUGINS", "moe")
    module = _ring(fakes)
    (d,) = declared_providers("inner_wrapper", "fake_ring")
    assert d.status == "disabled" and not d.loaded
    message = _unknown()
    assert (
        f"'fake_ring' is declared by the installed distribution fake-ring 0.3 (entry point "
        f"'ring = {module}'), but its plugin 'ring' is disabled (not listed in HP_PLUGINS=moe)."
    ) in message
    assert message.splitlines()[-1].startswith(
        "Fix: load plugin 'ring' (add it to HP_PLUGINS, or unset HP_PLUGINS and "
        "HP_DISABLE_PLUGIN_AUTOLOAD), then check with `hp plugins`"
    )


def test_declared_but_failed_says_why(fakes, env):
    env.setenv("HP_PLUGINS", "ring")
    _ring(fakes, body="raise ImportError('no such kernel library')\n")
    (d,) = declared_providers("inner_wrapper", "fake_ring")
    assert d.status == "failed" and "no such kernel library" in (d.reason or "")
    message = _unknown()
    assert "but its plugin 'ring' failed to load: " in message
    assert "ImportError: no such kernel library" in message
    assert "Fix: repair or reinstall fake-ring (`hp plugins` shows why plugin 'ring' fails)" in (
        message
    )


def test_declared_by_a_loaded_plugin_that_does_not_register_it(fakes, env):
    env.setenv("HP_PLUGINS", "ring")
    module = _ring(fakes, items={"inner_wrapper.fake_ghost": "fake_ring_fake_ring"})
    assert module == "fake_ring_fake_ring"
    message = _unknown("fake_ghost")
    assert "its plugin is loaded but did not register it (its metadata is out of date)" in message
    assert "Fix: reinstall fake-ring, or report it to its authors" in message


def test_declared_without_a_matching_entry_point(fakes, env):
    env.setenv("HP_PLUGINS", "ring")
    _ring(fakes, items={"inner_wrapper.fake_orphan": "somewhere.else"})
    (d,) = declared_providers("inner_wrapper", "fake_orphan")
    assert (d.entry_point, d.status) == (None, "no entry point")
    message = _unknown("fake_orphan")
    assert "fake-ring 0.3 (no hp_core entry point for module 'somewhere.else')" in message


def test_declared_by_nobody_says_so_and_uses_the_recorded_provider(fakes, env):
    env.setenv("HP_PLUGINS", "ring")
    _ring(fakes)
    message = _unknown("fake_rung")
    assert message.startswith("unknown inner wrapper 'fake_rung'. Did you mean 'fake_ring'?")
    assert (
        "No installed distribution declares the inner wrapper 'fake_rung' (entry-point group "
        "hp_core.items, entry 'inner_wrapper.fake_rung')."
    ) in message
    assert "pip install" not in message
    recorded = _unknown("fake_rung", recorded=RecordedProvider("ring-kernels", "2.1"))
    assert "The plan was made with 'fake_rung' from ring-kernels 2.1." in recorded
    assert "Fix: install it (pip install ring-kernels==2.1)" in recorded


def test_malformed_metadata_is_a_plugin_problem_in_hp_plugins(fakes, env, capsys):
    env.setenv("HP_PLUGINS", "ring")
    _ring(
        fakes,
        items={
            "inner_wrapper.fake_ring": "fake_ring_fake_ring",
            "widget.fake_ring": "fake_ring_fake_ring",
            "inner_wrapper.": "fake_ring_fake_ring",
        },
    )
    problems = declared_problems()
    assert len(problems) == 2
    assert any(
        "'widget.fake_ring = fake_ring_fake_ring': unknown kind 'widget'" in p for p in problems
    )
    assert any("an empty item name" in p for p in problems)
    assert [d.name for d in declared_providers("inner_wrapper", "fake_ring")] == ["fake_ring"]
    assert cli.main(["plugins"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: distribution fake-ring declares hp_core.items entry" in err
    assert "unknown kind 'widget'" in err and "Fix: name each entry" in err
    assert cli.main(["plugins", "--strict"]) == 1
    assert "metadata problems" in capsys.readouterr().err


# ------------------------------------------------------------------ first-party metadata


PLUGINS = {
    "hp_plugin_cp": "cp",
    "hp_plugin_moe": "moe",
    "plugins/hp-plugin-phi3": "phi3",
    "plugins/hp-plugin-bloom": "bloom",
}


@pytest.mark.parametrize("folder", sorted(PLUGINS))
def test_first_party_pyproject_declares_exactly_what_the_plugin_registers(env, folder):
    project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
    entry_point = PLUGINS[folder]
    module = project["entry-points"]["hp_core"][entry_point]
    declared = project["entry-points"][ITEMS_GROUP]
    assert set(declared.values()) == {module}
    registered = {
        f"{item.kind.value}.{item.name}"
        for item in registered_items()
        if item.provider == entry_point
    }
    assert registered and set(declared) == registered


# ------------------------------------------------------------------ providers in plans


def _ring_plan(fakes, env):
    env.setenv("HP_PLUGINS", "ring")
    _ring(fakes)
    model = _model()
    return model, hp_core.plan(model, "tp=2", overrides=_wrap("fake_ring", region_dispatch=False))


def test_yaml_records_providers_and_loads_them_back(fakes, env):
    model, planned = _ring_plan(fakes, env)
    text = dump_plan(planned)
    assert "providers:\n  inner_wrapper.fake_ring: {distribution: fake-ring, version: '0.3'}\n" in (
        text
    )
    loaded = load_plan(text)
    assert loaded.providers == {"inner_wrapper.fake_ring": RecordedProvider("fake-ring", "0.3")}
    assert loaded == planned and loaded.fingerprint() == planned.fingerprint()
    assert dump_plan(loaded) == text
    # A plan written before providers were recorded still loads.
    old = load_plan(text.split("providers:")[0])
    assert old.providers == {} and old.fingerprint() == planned.fingerprint()

    # Where the plugin is gone, apply (and plan-time checks) say what to install.
    env.setenv("HP_PLUGINS", "")
    fakes.hide()
    with pytest.raises(UnknownRegistryItemError) as checked:
        check_plan_items(loaded)
    with pytest.raises(UnknownRegistryItemError) as applied:
        hp_core.verify(model, loaded)
    assert str(checked.value) == str(applied.value)
    message = str(checked.value)
    assert message.startswith(f"plan['{ATTN}'].inner_wrapper: unknown inner wrapper 'fake_ring'.")
    assert "The plan was made with 'fake_ring' from fake-ring 0.3." in message
    assert "Fix: install it (pip install fake-ring==0.3)" in message
    # ...and the plan without the record can only say that nobody declares it.
    with pytest.raises(UnknownRegistryItemError) as bare:
        check_plan_items(old)
    assert "pip install" not in str(bare.value)


@pytest.mark.parametrize(
    ("providers", "where"),
    [
        ("[1, 2]", "providers: expected a mapping"),
        ("{inner_wrapper.x: {distribution: 3, version: '1'}}", "['inner_wrapper.x'].distribution"),
        ("{inner_wrapper.x: {distribution: d, version: 1}}", "['inner_wrapper.x'].version"),
        ("{gadget.x: {distribution: d, version: '1'}}", "providers['gadget.x']: expected a key"),
        ("{inner_wrapper.x: {distribution: d}}", "providers['inner_wrapper.x']: expected {"),
    ],
)
def test_malformed_providers_name_the_key(env, providers, where):
    env.setenv("HP_PLUGINS", "")
    text = dump_plan(hp_core.plan(_model(), "tp=2")) + f"providers: {providers}\n"
    with pytest.raises(PlanYAMLError) as e:
        load_plan(text)
    assert where in str(e.value) and "Fix: correct or delete the entry" in str(e.value)


def test_artifact_records_providers(fakes, env):
    model, planned = _ring_plan(fakes, env)
    artifact = make_artifact(planned, model=model)
    assert artifact.meta["providers"] == {
        "inner_wrapper.fake_ring": {"distribution": "fake-ring", "version": "0.3"}
    }
    data = dumps_artifact(artifact)
    back = loads_artifact(data)
    assert back.plan().providers == planned.providers or back.plan().providers == {
        "inner_wrapper.fake_ring": RecordedProvider("fake-ring", "0.3")
    }
    env.setenv("HP_PLUGINS", "")
    fakes.hide()
    with pytest.raises(ArtifactRegistryError) as e:
        loads_artifact(data)
    assert "it was frozen with fake-ring 0.3 (pip install fake-ring==0.3)" in str(e.value)
    # An artifact frozen before providers were recorded still reads.
    old = copy.deepcopy(artifact.meta)
    del old["providers"]
    assert hp_core.artifact.rebuild(old).providers == {}


def test_dump_records_only_items_with_a_distribution(env):
    env.setenv("HP_PLUGINS", "")
    register_compute_factory("names_mlp", scaled_mlp)
    overrides = [{"match": "model.layers.0.mlp", "local_compute_fn": "names_mlp"}]
    planned = hp_core.plan(_model(), "tp=2", overrides=overrides)
    assert "providers:" not in dump_plan(planned)  # a register_* call: nothing to install


# ------------------------------------------------------------------ region_dispatch wrappers


def test_region_dispatch_wrapper_failing_on_dtensors_names_the_module():
    ranks = get_world(2).run(region_wrapper_cases)
    assert ranks[0] == ranks[1]
    cases = ranks[0]
    failed = cases["validate_dispatch"]
    assert failed["type"] == "InjectionCallError" and failed["fqn"] == ATTN
    assert failed["name"] == "tests.dist_tasks_names.calls_nonzero"
    message = failed["message"]
    assert message.startswith(
        f"plan['{ATTN}'].inner_wrapper: the forward of inner wrapper "
        "'tests.dist_tasks_names.calls_nonzero' (from a function passed directly"
    )
    assert f"failed for module '{ATTN}' in validate mode: RuntimeError: " in message
    assert "aten.nonzero.default" in message
    assert (
        "so in validate mode it receives DTensors (here: hidden_states ([Replicate()])" in message
    )
    assert "Fix: make the wrapper DTensor-aware" in message
    assert "or set region_dispatch: false in the override for" in message
    assert failed["cause"].startswith("RuntimeError")
    # Controls: the same wrapper on local tensors works (production, or region_dispatch: false).
    assert cases["production_dispatch"] == {"type": None, "finite": True}
    assert cases["validate_local"] == {"type": None, "finite": True}


def test_installed_metadata_is_read_without_importing(env):
    """declared_providers reads entry points only: nothing of a plugin is imported."""
    seen = []
    real = importlib.metadata.EntryPoint.load

    def load(self):
        seen.append(self.name)
        return real(self)

    env.setattr(importlib.metadata.EntryPoint, "load", load)
    hp_core.plugins.current_state()  # discovery imports the plugins
    seen.clear()
    declared_providers("inner_wrapper", "anything")
    assert seen == []


def test_providers_record_each_registry_name_once_and_no_import_paths(fakes, env):
    env.setenv("HP_PLUGINS", "ring")
    _ring(fakes)
    overrides = [
        {"match": "*.self_attn", "inner_target": "self", "inner_wrapper": "fake_ring"},
        {"match": "*.mlp", "local_compute_fn": "hp_plugin_x.factories.mlp"},
    ]
    for entry in overrides:
        entry["region_dispatch"] = False
    planned = hp_core.plan(_model(), "tp=2", overrides=overrides, check_items=False)
    assert record_providers(planned) == {
        "inner_wrapper.fake_ring": RecordedProvider("fake-ring", "0.3")
    }


def test_hp_plan_refuses_a_config_key_typo_with_apply_s_error(env, tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    path.write_text(
        "- match: model.layers.*.mlp\n"
        "  local_compute_fn: {_target_: qwen2moe, capacity_factr: 2.0}\n"
        "  region_dispatch: false\n"
    )
    argv = ["plan", "--model", "qwen2moe", "--mesh", "tp=2", "--ep", "2", "--overrides", str(path)]
    assert cli.main(argv) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(
        "hp plan: error: InjectionBindingError: plan['model.layers.0.mlp'].local_compute_fn: "
        "unknown config key 'capacity_factr'"
    )
    assert "Did you mean 'capacity_factor'?" in err


def test_declared_by_a_distribution_installed_after_discovery(fakes, env):
    env.setenv("HP_PLUGINS", "ring")
    _ring(fakes)
    hp_core.plugins.current_state()  # discovered before the next distribution appears
    info = fakes.root / "fake_late-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-late\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[hp_core]\nring = fake_late\n\n[hp_core.items]\ninner_wrapper.fake_late = fake_late\n"
    )
    importlib.invalidate_caches()
    (d,) = declared_providers("inner_wrapper", "fake_late")
    assert (d.distribution, d.status) == ("fake-late", "not found")
    assert d.reason == (
        "no plugin named 'ring' from fake-late was loaded, which plugin 'ring' (fake-ring 0.3) uses"
    )
    assert "but no plugin named 'ring' from fake-late was loaded" in _unknown("fake_late")
