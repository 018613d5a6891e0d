"""The artifact file: canonical bytes, signature, atomic writes, each refusal, model checks."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import hp_core
from hp_core import (
    ModuleShardingSpec,
    ShardingPlan,
    Target,
    inner_wrapper,
    plan,
    register_inner_wrapper,
)
from hp_core.artifact import (
    FORMAT_VERSION,
    Artifact,
    ArtifactFormatError,
    ArtifactRegistryError,
    ArtifactSchemaError,
    ArtifactSignatureError,
    ArtifactVersionError,
    FreezeError,
    canonical_json,
    check_against_model,
    content_signature,
    dumps_artifact,
    freeze,
    loads_artifact,
    make_artifact,
    missing_registry_items,
    model_digest,
    read_artifact,
    same_plan,
    version_drift,
    write_artifact,
)
from hp_core.plugins import unregister
from hp_core.presets import build_model
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._toy_models import head_attention_lm

pytestmark = pytest.mark.usefixtures("builtin_only")

CP_OVERRIDES = [
    {
        "match": "model.layers.*.self_attn",
        "inner_wrapper": "sdpa_hf",
        "inner_target": "self",
        "region_dispatch": False,
    }
]


@inner_wrapper
def user_wrapper(target_module, ctx):
    return target_module.forward


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", device="meta")


@pytest.fixture
def artifact(llama) -> Artifact:  # function scope: made after builtin_only fixes the plugin set
    return make_artifact(plan(llama, "tp=2"), model=llama)


def _resigned(artifact: Artifact, edit) -> bytes:
    """The artifact's document after ``edit(doc)``, with a signature that matches the edit."""
    doc = json.loads(dumps_artifact(artifact))
    edit(doc)
    doc["signature"] = content_signature({k: v for k, v in doc.items() if k != "signature"})
    return canonical_json(doc)


def _refusal(data: bytes, error: type[Exception]) -> str:
    with pytest.raises(error) as info:
        loads_artifact(data, source="a.json")
    assert type(info.value) is error
    return str(info.value)


# ------------------------------------------------------------------ content


def test_bytes_are_canonical_and_stable(llama, artifact):
    data = dumps_artifact(artifact)
    assert data.endswith(b"}\n") and data.count(b"\n") == 1
    doc = json.loads(data)
    assert canonical_json(doc) == data
    assert (
        json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        == data
    )
    assert list(doc) == ["format", "format_version", "inputs", "meta", "signature"]
    again = make_artifact(
        plan(build_model("llama", device="meta"), "tp=2"), model=build_model("llama", device="meta")
    )
    assert dumps_artifact(again) == data  # same inputs in a fresh build: identical bytes
    assert doc["meta"] == freeze(plan(llama, "tp=2"))
    assert doc["signature"] == content_signature({k: v for k, v in doc.items() if k != "signature"})
    assert doc["signature"].startswith("sha256:") and len(doc["signature"]) == 7 + 64


def test_inputs_record_what_produced_the_plan(llama, artifact, tmp_path):
    inputs = artifact.inputs
    assert inputs["hp_version"] == hp_core.__version__
    assert inputs["plugins"]["builtin"] == {
        "distribution": "hp-core",
        "version": hp_core.__version__,
    }
    assert inputs["mesh"] == "tp=2" and inputs["overrides"] == []
    assert inputs["model"] == {
        "class": "LlamaForCausalLM",
        "model_type": "llama",
        "digest": model_digest(llama),
    }
    path = tmp_path / "cp.yaml"
    path.write_text(
        "- match: model.layers.*.self_attn\n  inner_wrapper: sdpa_hf\n  inner_target: self\n "
        " region_dispatch: false\n"
    )
    planned = plan(llama, "cp=2", overrides=str(path), check_items=False)  # sdpa_hf not loaded
    cp = make_artifact(planned, model=llama, overrides=str(path))
    assert cp.inputs["overrides"] == CP_OVERRIDES and cp.inputs["mesh"] == "cp=2"
    assert cp.signature != artifact.signature


def test_unserializable_overrides_are_a_freeze_error(llama):
    def local(target_module, ctx):
        return None

    overrides = {
        "model.layers.0.self_attn": ModuleShardingSpec(
            inner_wrapper=inner_wrapper(local), inner_target="self", region_dispatch=False
        )
    }
    with pytest.raises(
        FreezeError,
        match=r"^overrides: overrides\['model.layers.0.self_attn'\].inner_wrapper: "
        r".*<locals>.local cannot be written to a file",
    ):
        make_artifact(plan(llama, "tp=2"), model=llama, overrides=overrides)


def test_model_digest():
    a = model_digest(build_model("llama", device="meta"))
    assert a == model_digest(build_model("llama", device="cpu"))  # device does not matter
    assert a != model_digest(build_model("llama", device="meta", num_hidden_layers=1))
    assert a != model_digest(build_model("qwen2", device="meta"))
    toy = model_digest(head_attention_lm())  # no config: class and parameter shapes
    assert toy == model_digest(head_attention_lm()) != model_digest(head_attention_lm(n_layers=1))


def test_model_digest_renders_any_config_value():
    class Config:
        def __init__(self, **values):
            self.values = values

        def to_dict(self):
            return {"transformers_version": "x", **self.values}

    def with_config(**values):
        model = head_attention_lm(n_layers=1)
        model.config = Config(**values)
        return model

    odd = {"dtype": torch.float32, "eps": float("nan"), "sizes": (1, 2), "nested": {3: [0.5]}}
    assert model_digest(with_config(**odd)) == model_digest(with_config(**odd))
    assert model_digest(with_config(**odd)) != model_digest(
        with_config(**{**odd, "dtype": torch.bfloat16})
    )
    assert model_digest(with_config(**odd)) != model_digest(head_attention_lm(n_layers=1))


def test_artifact_plan_rebuilds(llama, artifact):
    assert same_plan(artifact.plan(), plan(llama, "tp=2"))
    assert artifact.format_version == FORMAT_VERSION == 1


# ------------------------------------------------------------------ writing


def test_write_is_atomic_and_read_back(artifact, tmp_path):
    path = write_artifact(artifact, tmp_path / "plan.hp.json")
    assert path.read_bytes() == dumps_artifact(artifact)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.hp.json"]
    back = read_artifact(path)
    assert back == artifact
    os.chmod(path, 0o600)
    write_artifact(artifact, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # an existing file keeps its mode


def test_a_failed_write_leaves_the_old_file_and_no_temporary(artifact, tmp_path, monkeypatch):
    path = tmp_path / "plan.hp.json"
    path.write_bytes(b"old")

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_artifact(artifact, path)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.hp.json"]


# ------------------------------------------------------------------ refusals


def test_not_an_artifact():
    assert _refusal(b"\xff\xfe", ArtifactFormatError).startswith(
        "a.json: not an hp artifact (not UTF-8 JSON: "
    )
    assert _refusal(b"version: 1\n", ArtifactFormatError).startswith(
        "a.json: not an hp artifact (not UTF-8 JSON: "
    )
    message = _refusal(b"[1]", ArtifactFormatError)
    assert (
        message
        == "a.json: not an hp artifact (no \"format\": 'hp-artifact'). Artifacts are written by "
        "hp freeze; a plan YAML file is read with hp_core.load_plan instead."
    )
    message = _refusal(b'{"format": "hp-artifact", "format": "x"}', ArtifactFormatError)
    assert (
        message
        == "a.json: duplicate key 'format': an artifact is canonical JSON. Re-create it with "
        "this hp: hp freeze --model ... --mesh ... -o ARTIFACT."
    )


def test_another_format_version(artifact):
    data = _resigned(artifact, lambda d: d.update(format_version=2))
    assert _refusal(data, ArtifactVersionError) == (
        f"a.json: artifact format version 2; this hp (hp {hp_core.__version__}) reads "
        "version 1. Re-freeze the "
        "plan with this hp (hp freeze --model ... --mesh ... -o ARTIFACT), or use the hp "
        "version that wrote it."
    )
    assert "artifact format version True;" in _refusal(
        _resigned(artifact, lambda d: d.update(format_version=True)), ArtifactVersionError
    )


def test_missing_or_unknown_top_level_keys(artifact):
    data = _resigned(artifact, lambda d: d.update(comment="hi") or d.pop("inputs"))
    assert _refusal(data, ArtifactFormatError) == (
        "a.json: malformed artifact (missing keys ['inputs'], unknown keys ['comment']). "
        "Re-create it with "
        "this hp: hp freeze --model ... --mesh ... -o ARTIFACT."
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["meta"]["param_plan"][2]["params"]["q_proj.weight"].update(tp="shard(1)"),
        lambda d: d["inputs"].update(mesh="tp=4"),
        lambda d: d["inputs"]["overrides"].append({"match": "lm_head"}),
        lambda d: d.update(signature="sha256:" + "0" * 64),
    ],
    ids=["meta", "inputs-mesh", "inputs-overrides", "signature"],
)
def test_a_tampered_artifact_is_refused(artifact, edit):
    doc = json.loads(dumps_artifact(artifact))
    edit(doc)
    message = _refusal(canonical_json(doc), ArtifactSignatureError)
    assert message.startswith("a.json: signature mismatch: the artifact says sha256:")
    assert message.endswith(
        "it was edited or corrupted after hp freeze wrote it. Do not edit artifacts: change "
        "the overrides and "
        "re-freeze. Re-create it with this hp: hp freeze --model ... --mesh ... -o ARTIFACT."
    )


def test_whitespace_does_not_count_as_tampering(artifact):
    pretty = json.dumps(json.loads(dumps_artifact(artifact)), indent=2).encode()
    assert loads_artifact(pretty) == artifact


def test_a_signed_artifact_with_a_bad_schema(artifact):
    data = _resigned(artifact, lambda d: d["meta"]["param_plan"][0].update(params=[]))
    assert _refusal(data, ArtifactSchemaError) == (
        "a.json: meta: param_plan[0] ('model.embed_tokens').params: expected a mapping of name to "
        "{axis: placement}, got []. Re-create it with this hp: hp freeze --model ... --mesh "
        "... -o ARTIFACT."
    )
    data = _resigned(artifact, lambda d: d["inputs"].pop("plugins"))
    assert _refusal(data, ArtifactSchemaError).startswith(
        "a.json: inputs: expected the keys hp_version, mesh, model, overrides, plugins, got "
        "['hp_version', 'mesh', 'model', 'overrides']."
    )
    data = _resigned(artifact, lambda d: d.update(inputs=[]))
    assert (
        "a.json: inputs: expected the keys hp_version, mesh, model, overrides, plugins, got []."
        in _refusal(data, ArtifactSchemaError)
    )


def test_injections_must_name_installed_items(llama, tmp_path):
    cp = make_artifact(
        plan(llama, "cp=2", overrides=CP_OVERRIDES, check_items=False),
        model=llama,
        overrides=CP_OVERRIDES,
    )
    message = _refusal(dumps_artifact(cp), ArtifactRegistryError)
    assert message.startswith(
        "a.json: the plan injects items that no installed plugin provides:\n"
        "  modules['model.layers.0.self_attn'].inner_wrapper: 'sdpa_hf' is not a registered "
        "inner wrapper (registered: sharded_qk_norm)\n"
        "  modules['model.layers.1.self_attn'].inner_wrapper: 'sdpa_hf' is not a registered "
        "inner wrapper (registered: sharded_qk_norm)\n"
        "Install the plugin that provides them (hp plugins lists what is installed"
    )
    assert (
        "register them with register_inner_wrapper / register_compute_factory before "
        "loading, or re-freeze the plan without them." in message
    )
    assert loads_artifact(dumps_artifact(cp), check_registry=False) == cp
    register_inner_wrapper("sdpa_hf", user_wrapper)
    try:
        assert loads_artifact(dumps_artifact(cp)) == cp
    finally:
        unregister("inner_wrapper", "sdpa_hf")


def test_registry_check_on_targets_and_dotted_paths():
    spec = ModuleShardingSpec(
        inner_wrapper=Target("missing_wrapper"),
        inner_target="self",
        local_compute_fn="nonexistent_pkg_xyz.compute.factory",
        region_dispatch=False,
    )
    p = ShardingPlan(
        {
            "m": spec,
            "n": ModuleShardingSpec(
                local_compute_fn="hp_core.artifact.freeze", region_dispatch=False
            ),
        },
        ("tp",),
        (2,),
    )
    assert missing_registry_items(p) == [
        "modules['m'].inner_wrapper: 'missing_wrapper' is not a registered inner wrapper "
        "(registered: sharded_qk_norm)",
        "modules['m'].local_compute_fn: 'nonexistent_pkg_xyz.compute.factory': package "
        "'nonexistent_pkg_xyz' is not installed",
    ]


def test_version_drift(artifact):
    assert version_drift(artifact) == []
    old = loads_artifact(
        _resigned(
            artifact,
            lambda d: d["inputs"].update(
                hp_version="0.0.1",
                plugins={
                    "builtin": {"distribution": "hp-core", "version": hp_core.__version__},
                    "cp": {"distribution": "hp-plugin-cp", "version": "0.0.9"},
                },
            ),
        )
    )
    assert version_drift(old) == [
        f"hp 0.0.1 froze it; hp {hp_core.__version__} is installed",
        "plugin 'cp': 0.0.9 when frozen, absent now",
    ]


# ------------------------------------------------------------------ model checks


def test_check_against_the_right_model(llama, artifact):
    assert check_against_model(artifact, llama) == []


def test_check_against_another_model(artifact):
    problems = check_against_model(
        artifact, build_model("llama", device="meta", num_hidden_layers=1)
    )
    assert problems[0].startswith(
        "model: the artifact was frozen for another model (digest sha256:"
    )
    assert problems[0].endswith(
        "class, config or parameter shapes differ). Re-freeze it for this model."
    )
    assert problems[1:] == [
        f"modules['model.layers.1{sub}']: not a module of this model. Closest module: "
        f"'model.layers.0{sub}'."
        for sub in ("", ".self_attn", ".mlp", ".input_layernorm", ".post_attention_layernorm")
    ]


def test_check_runs_the_planner_lints(llama):
    live = plan(llama, "tp=2")
    modules = {fqn: spec for fqn, spec in live.items() if fqn != "lm_head"}
    holed = make_artifact(ShardingPlan(modules, ("tp",), (2,), sequence_parallel=True), model=llama)
    (problem,) = check_against_model(holed, llama)
    assert problem.startswith(
        "CoverageError: trainable parameter(s) lm_head.weight are not declared by any boundary"
    )


def test_check_needs_mesh_sizes(llama):
    live = plan(llama, "tp=2")
    shapeless = make_artifact(
        ShardingPlan(dict(live.modules), ("tp",), None, sequence_parallel=True), model=llama
    )
    assert shapeless.inputs["mesh"] == ""
    assert check_against_model(shapeless, llama) == [
        "mesh: the artifact has no mesh sizes, so shapes cannot be checked. Re-freeze it."
    ]
