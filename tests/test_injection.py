"""The injection discipline: decorators, meta, binding, forward compatibility, Target."""

from __future__ import annotations

import dataclasses
import functools
import sys

import pytest

from hp_core import injection as I
from hp_core import resolve as R
from hp_core.injection import (
    InjectionBindingError,
    InjectionDefinitionError,
    InjectionMeta,
    Target,
    TargetError,
    UntrustedTargetError,
    bind_injection,
    check_forward_compatible,
    inner_wrapper,
    local_compute,
    require_injection_meta,
)
from hp_core.resolve import resolve_injection

# ------------------------------------------------------------------ decoration


def test_local_compute_stamps_meta():
    @local_compute
    def factory(module, ctx, capacity, jitter=0.0):
        return None

    meta = factory._injection_meta
    assert meta == InjectionMeta(
        "local_compute", ("module", "ctx"), ("capacity", "jitter"), ("capacity",)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.kind = "x"  # frozen


def test_local_compute_module_is_optional():
    @local_compute
    def factory(ctx):
        return None

    assert factory._injection_meta.context == ("ctx",)


def test_inner_wrapper_stamps_meta():
    @inner_wrapper
    def wrap(target_module, ctx):
        return None

    assert wrap._injection_meta.kind == "inner_wrapper"
    assert wrap._injection_meta.config_keys == ()


def test_kwargs_rejected_at_decoration():
    with pytest.raises(TypeError, match=r"@local_compute .*factory: '\*\*kwargs' is not allowed"):

        @local_compute
        def factory(ctx, **kwargs):
            return None


def test_varargs_rejected_at_decoration():
    with pytest.raises(
        InjectionDefinitionError, match=r"'\*args' is not allowed.*target_module, ctx"
    ):

        @inner_wrapper
        def wrap(target_module, ctx, *args):
            return None


def test_context_default_rejected():
    with pytest.raises(
        InjectionDefinitionError,
        match=r"context parameter 'ctx' must not have a default.*'ctx=None'",
    ):

        @local_compute
        def factory(module, ctx=None):
            return None


def test_missing_context_rejected_with_typo_hint():
    with pytest.raises(InjectionDefinitionError) as e:

        @local_compute
        def factory(module, cxt):
            return None

    msg = str(e.value)
    assert "missing required context parameter(s) ctx" in msg
    assert "'cxt' looks like a misspelling of 'ctx'" in msg
    with pytest.raises(
        InjectionDefinitionError,
        match=r"missing required context parameter\(s\) target_module\. @inner_wrapper",
    ):

        @inner_wrapper
        def wrap(ctx):
            return None


def test_positional_only_rejected():
    with pytest.raises(InjectionDefinitionError, match=r"parameter 'module' is positional-only"):
        exec(
            "@local_compute\ndef f(module, /, ctx):\n    pass",
            {"local_compute": local_compute},
        )


def test_signature_must_be_introspectable():
    with pytest.raises(InjectionDefinitionError, match=r"signature cannot be introspected"):
        local_compute(min)  # a builtin with no introspectable signature
    with pytest.raises(InjectionDefinitionError, match=r"applies to a function, got 3"):
        inner_wrapper(3)


def test_require_injection_meta():
    @local_compute
    def factory(ctx):
        return None

    assert (
        require_injection_meta(factory, "local_compute", source="overrides[0]").kind
        == "local_compute"
    )

    def plain(mesh):
        return None

    with pytest.raises(
        TypeError,
        match=r"test_injection\..*plain \(from overrides\[0\]\) is not decorated with "
        r"@local_compute",
    ):
        require_injection_meta(plain, "local_compute", source="overrides[0]")
    with pytest.raises(
        TypeError,
        match=r"is decorated with @local_compute but is used where @inner_wrapper is needed",
    ):
        require_injection_meta(factory, "inner_wrapper", source="x")
    with pytest.raises(ValueError, match="unknown injection kind 'compute'"):
        require_injection_meta(factory, "compute", source="x")


def test_fn_name_of_unusual_callables():
    class C:
        __module__ = None

        def __call__(self, mesh):
            return None

    assert I.injection_name(C()).startswith("<")  # no module, no qualname on the instance: its repr
    partial = functools.partial(_factory)
    assert "functools.partial(" in I.injection_name(partial)


# ------------------------------------------------------------------ binding


@local_compute
def _factory(module, ctx, capacity, jitter=0.0):
    return {"module": module, "ctx": ctx, "capacity": capacity, "jitter": jitter}


def test_bind_fills_context_none_for_inactive_axes_and_binds_config():
    got = bind_injection(
        _factory, _factory._injection_meta, context={"ctx": "C"}, config={"capacity": 2}, source="s"
    )
    assert got == {"module": None, "ctx": "C", "capacity": 2, "jitter": 0.0}


def test_bind_config_typo_lists_valid_and_closest():
    with pytest.raises(InjectionBindingError) as e:
        bind_injection(
            _factory,
            _factory._injection_meta,
            context={},
            config={"capacty": 2},
            source="overrides[1].local_compute_fn",
        )
    msg = str(e.value)
    assert msg.startswith("overrides[1].local_compute_fn: unknown config key 'capacty'")
    assert "Did you mean 'capacity'?" in msg and "Valid config keys: ['capacity', 'jitter']" in msg


def test_bind_config_no_keys_at_all():
    @inner_wrapper
    def wrap(target_module, ctx):
        return None

    with pytest.raises(
        InjectionBindingError, match=r"unknown config key 'zzz'.*Valid config keys: none"
    ):
        bind_injection(wrap, wrap._injection_meta, context={}, config={"zzz": 1}, source="s")


def test_bind_config_context_collision():
    with pytest.raises(
        InjectionBindingError,
        match=r"config key\(s\) \['ctx'\] collide with framework context names",
    ):
        bind_injection(
            _factory,
            _factory._injection_meta,
            context={},
            config={"ctx": 1, "capacity": 1},
            source="s",
        )


def test_bind_missing_required_config():
    with pytest.raises(
        InjectionBindingError, match=r"needs config key\(s\) \['capacity'\].*capacity: \.\.\."
    ):
        bind_injection(_factory, _factory._injection_meta, context={}, config={}, source="s")


# ------------------------------------------------------------------ forward compatibility


class _Attn:
    def forward(self, hidden_states, attention_mask=None, *, position_embeddings=None):
        return hidden_states


def test_forward_compatible_ok():
    def same(hidden_states, attention_mask=None, *, position_embeddings=None):
        return hidden_states

    def loose(*args, **kwargs):
        return None

    def compute(module, hidden_states, attention_mask=None, position_embeddings=None):
        return None

    check_forward_compatible(same, _Attn().forward, source="s")
    check_forward_compatible(loose, _Attn().forward, source="s")
    check_forward_compatible(compute, _Attn().forward, leading=1, source="s")

    def fwd_var(x, *rest, **kw):
        return x

    def rep_var(x, *rest, **kw):
        return x

    check_forward_compatible(rep_var, fwd_var, source="s")

    def rep_more_var(*rest):
        return rest

    def fwd_two(a, b):
        return a

    check_forward_compatible(rep_more_var, fwd_two, source="s")


@pytest.mark.parametrize(
    "replacement_src,forward_src,problem",
    [
        (
            "def r(x): pass",
            "def f(hidden_states): pass",
            "parameter 0 of the forward is 'hidden_states', the replacement has 'x'",
        ),
        (
            "def r(x): pass",
            "def f(x, y): pass",
            "parameter 1 of the forward is 'y', the replacement has nothing there",
        ),
        (
            "def r(x): pass",
            "def f(x, *a): pass",
            "the forward takes *a but the replacement does not",
        ),
        (
            "def r(x): pass",
            "def f(x, **k): pass",
            "the forward takes **k but the replacement does not",
        ),
        (
            "def r(x): pass",
            "def f(x, *, mask=None): pass",
            "the forward takes keyword 'mask' but the replacement does not",
        ),
    ],
)
def test_forward_incompatible(replacement_src, forward_src, problem):
    ns: dict = {}
    exec(replacement_src, ns)
    exec(forward_src, ns)
    with pytest.raises(InjectionBindingError) as e:
        check_forward_compatible(ns["r"], ns["f"], source="model.layers.0.self_attn")
    msg = str(e.value)
    assert msg.startswith("model.layers.0.self_attn: ")
    assert problem in msg and "Give it the same parameters as the module's forward." in msg


def test_forward_compat_leading_module_missing():
    def compute():
        return None

    with pytest.raises(InjectionBindingError, match=r"must take 1 leading positional parameter"):
        check_forward_compatible(compute, _Attn().forward, leading=1, source="s")

    def bad(module, x):
        return None

    with pytest.raises(InjectionBindingError, match="after the leading module parameter"):
        check_forward_compatible(bad, _Attn().forward, leading=1, source="s")


def test_forward_compat_uninspectable():
    with pytest.raises(InjectionBindingError, match="cannot introspect a signature"):
        check_forward_compatible(min, _Attn().forward, source="s")


# ------------------------------------------------------------------ Target


def test_target_dict_round_trip():
    t = Target.from_dict(
        {"_target_": "qwen2moe", "capacity": 1.5}, path="overrides[0].local_compute_fn"
    )
    assert t == Target("qwen2moe", {"capacity": 1.5})
    assert t.to_dict() == {"_target_": "qwen2moe", "capacity": 1.5}
    assert not t.is_path and Target("pkg.mod.f").is_path and Target("pkg.mod:f").is_path


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"capacity": 1}, r"^x: expected \{_target_: NAME_OR_PATH"),
        ("qwen2moe", r"^x: expected \{_target_"),
        ({"_target_": ""}, r"^x: Target: _target_ must be a non-empty string"),
        ({"_target_": 5}, r"^x: Target: _target_ must be a non-empty string"),
    ],
)
def test_target_from_dict_errors(raw, match):
    with pytest.raises(TargetError, match=match):
        Target.from_dict(raw, path="x")


def test_target_constructor_errors():
    with pytest.raises(TargetError, match="config must be a mapping"):
        Target("a", [1])  # type: ignore[arg-type]
    with pytest.raises(TargetError, match="config keys must be strings"):
        Target("a", {1: 2})  # type: ignore[dict-item]


@pytest.fixture
def trusted_pkg(tmp_path, monkeypatch):
    """A throw-away package ``hp_test_trustpkg`` with decorated and plain functions."""
    pkg = tmp_path / "hp_test_trustpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "factories.py").write_text(
        "from hp_core import local_compute, inner_wrapper\n"
        "@local_compute\n"
        "def moe(ctx, capacity=1.0):\n"
        "    return ('moe', capacity)\n"
        "@inner_wrapper\n"
        "def attn(target_module, ctx):\n"
        "    return None\n"
        "def plain(mesh):\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(I, "_USER_TRUSTED", set())
    monkeypatch.delenv("HP_TRUSTED_PACKAGES", raising=False)
    yield "hp_test_trustpkg"
    for name in [m for m in sys.modules if m.startswith("hp_test_trustpkg")]:
        del sys.modules[name]


def test_dotted_path_refused_unless_trusted(trusted_pkg, monkeypatch):
    with pytest.raises(UntrustedTargetError) as e:
        resolve_injection(
            Target("hp_test_trustpkg.factories.moe"),
            "local_compute",
            source="overrides[3].local_compute_fn",
            trusted=(),
        )
    msg = str(e.value)
    assert msg.startswith(
        "overrides[3].local_compute_fn: refusing to import 'hp_test_trustpkg.factories.moe'"
    )
    assert (
        "hp_core.trust_packages('hp_test_trustpkg')" in msg
        and "HP_TRUSTED_PACKAGES=hp_test_trustpkg" in msg
    )
    assert "hp_test_trustpkg.factories" not in sys.modules  # nothing was imported


def test_dotted_path_trusted_by_call(trusted_pkg, monkeypatch):
    monkeypatch.setattr("hp_core.resolve.plugin_packages", lambda: frozenset(), raising=False)
    I.trust_packages(trusted_pkg)
    assert trusted_pkg in R.trusted_packages()
    r = resolve_injection(
        Target("hp_test_trustpkg.factories:moe", {"capacity": 4.0}), "local_compute", source="s"
    )
    assert r.name == "hp_test_trustpkg.factories:moe" and r.provider == "hp_test_trustpkg"
    assert r.bind({}, source="s") == ("moe", 4.0)


def test_dotted_path_trusted_by_env(trusted_pkg, monkeypatch):
    monkeypatch.setattr("hp_core.resolve.plugin_packages", lambda: frozenset(), raising=False)
    monkeypatch.setenv("HP_TRUSTED_PACKAGES", f" other , {trusted_pkg} ")
    r = resolve_injection("hp_test_trustpkg.factories.attn", "inner_wrapper", source="s")
    assert r.meta.kind == "inner_wrapper" and r.config == {}


def test_dotted_path_import_and_attribute_errors(trusted_pkg):
    trusted = [trusted_pkg]
    with pytest.raises(TargetError, match=r"cannot import module 'hp_test_trustpkg.nope'"):
        resolve_injection("hp_test_trustpkg.nope.f", "local_compute", source="s", trusted=trusted)
    with pytest.raises(
        TargetError,
        match=r"module 'hp_test_trustpkg.factories' has no attribute 'mo'\. Did you mean 'moe'\?",
    ):
        resolve_injection(
            "hp_test_trustpkg.factories.mo", "local_compute", source="s", trusted=trusted
        )
    with pytest.raises(TargetError) as e:
        resolve_injection(
            "hp_test_trustpkg.factories.zzzzzzz", "local_compute", source="s", trusted=trusted
        )
    assert "Did you mean" not in str(e.value)
    with pytest.raises(TypeError, match=r"plain \(from s\) is not decorated with @local_compute"):
        resolve_injection(
            "hp_test_trustpkg.factories.plain", "local_compute", source="s", trusted=trusted
        )
    with pytest.raises(
        InjectionBindingError, match=r"unknown config key 'capcity'.*Did you mean 'capacity'"
    ):
        resolve_injection(
            Target("hp_test_trustpkg.factories.moe", {"capcity": 1}),
            "local_compute",
            source="s",
            trusted=trusted,
        )


def test_trust_packages_validates_names():
    with pytest.raises(ValueError, match="expected top-level package names"):
        I.trust_packages("a.b")
    with pytest.raises(ValueError, match="expected top-level package names"):
        I.trust_packages("")


def test_resolve_direct_callable_and_errors():
    @local_compute
    def no_config(ctx):
        return "compute"

    r = resolve_injection(no_config, "local_compute", source="s")
    assert r.fn is no_config and r.provider == "direct" and r.name.endswith("no_config")
    assert r.bind({}, source="s") == "compute"
    with pytest.raises(
        TargetError, match=r"expected a registry name, a @inner_wrapper function or a Target, got 3"
    ):
        resolve_injection(3, "inner_wrapper", source="s")
    with pytest.raises(ValueError, match="unknown injection kind"):
        resolve_injection(_factory, "bogus", source="s")
    with pytest.raises(InjectionBindingError, match=r"needs config key\(s\) \['capacity'\]"):
        resolve_injection(_factory, "local_compute", source="s")


def test_api1_mesh_parameters_refused_with_the_new_contract():
    with pytest.raises(
        InjectionDefinitionError,
        match=r"parameter 'tp_mesh' is a context name of plugin API 1.*as 'ctx'",
    ):

        @local_compute
        def factory(module, tp_mesh):
            return None

    with pytest.raises(
        InjectionDefinitionError,
        match=r"'mesh' is a context name of plugin API 1.*target_module, ctx\.",
    ):

        @inner_wrapper
        def wrap(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
            return None
