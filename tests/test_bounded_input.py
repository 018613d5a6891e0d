"""Bounded input: size, depth and alias-expansion caps; NaN refusals; typed artifacts; ``--model``
configs."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest

from hp_core import cli, plan
from hp_core.artifact import (
    ArtifactFormatError,
    ArtifactLimitError,
    ArtifactSchemaError,
    ArtifactVersionError,
    canonical_json,
    content_signature,
    dumps_artifact,
    loads_artifact,
    make_artifact,
    read_artifact,
)
from hp_core.bounded import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_NODES,
    ENV_MAX_BYTES,
    ENV_MAX_DEPTH,
    ENV_MAX_NODES,
    InputLimitError,
    InputLimits,
    load_yaml,
    loads_json,
    read_bounded,
)
from hp_core.plans import PlanYAMLError, PlanYAMLInputLimitError, load_overrides, load_plan
from hp_core.presets import build_model, tiny_config
from hp_core.verifier.report import ReportFormatError, ReportFormatInputLimitError, VerifyReport
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("builtin_only")


@pytest.fixture(autouse=True)
def _default_limits(monkeypatch):
    for var in (ENV_MAX_BYTES, ENV_MAX_DEPTH, ENV_MAX_NODES):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", device="meta")


@pytest.fixture
def artifact(llama):
    overrides = [{"match": "model.layers.*.mlp", "when": "tp"}]
    return make_artifact(plan(llama, "tp=2", overrides=overrides), model=llama, overrides=overrides)


def _resigned(artifact, edit) -> bytes:
    """The artifact's document after ``edit(doc)``, re-signed so that the signature check passes."""
    doc = json.loads(dumps_artifact(artifact))
    edit(doc)
    doc["signature"] = content_signature({k: v for k, v in doc.items() if k != "signature"})
    return canonical_json(doc)


def _bomb(levels: int = 9, width: int = 9, indent: str = "        ") -> str:
    """YAML "billion laughs": anchor ``a0`` holds ``width`` scalars, each ``a<i>`` ``width`` aliases
    of ``a<i-1>``."""
    lines = [f"{indent}a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"{indent}a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


BOMB_OVERRIDES = (
    "overrides:\n"
    "  - match: model.layers.*.self_attn\n"
    "    inner_wrapper:\n"
    "      _target_: sdpa_hf\n"
    "      lol:\n" + _bomb()
)


# ------------------------------------------------------------------ the defaults


def test_default_limits_and_env_names():
    assert (DEFAULT_MAX_BYTES, DEFAULT_MAX_DEPTH, DEFAULT_MAX_NODES) == (
        8 * 1024 * 1024,
        64,
        100_000,
    )
    assert (ENV_MAX_BYTES, ENV_MAX_DEPTH, ENV_MAX_NODES) == (
        "HP_MAX_INPUT_BYTES",
        "HP_MAX_INPUT_DEPTH",
        "HP_MAX_YAML_NODES",
    )
    assert InputLimits.current() == InputLimits(8 * 1024 * 1024, 64, 100_000)


#: Unpickles the bytes on stdin in a fresh interpreter and prints what came back.
_UNPICKLE = (
    "import json, pickle, sys\n"
    "errors = pickle.loads(sys.stdin.buffer.read())\n"
    "print(json.dumps([[type(e).__module__, type(e).__qualname__, str(e), e.source, e.path, "
    "e.limit, e.env]"
    " for e in errors]))\n"
)


def _unpickled_elsewhere(errors: list[InputLimitError]) -> list[list]:
    """``errors`` pickled here and unpickled in another process (as the distributed test
    worlds pass errors between ranks): a class made at run time would fail there."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", _UNPICKLE],
        input=pickle.dumps(errors),
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def test_the_error_classes():
    for cls, base in (
        (PlanYAMLInputLimitError, PlanYAMLError),
        (ReportFormatInputLimitError, ReportFormatError),
        (ArtifactLimitError, ArtifactFormatError),
    ):
        assert issubclass(cls, base) and issubclass(cls, InputLimitError), cls
        # declared where its base is, so pickle finds it by name in any process
        assert cls.__module__ == base.__module__ and cls.__qualname__ == cls.__name__
        assert getattr(sys.modules[cls.__module__], cls.__name__) is cls
    assert issubclass(InputLimitError, ValueError)
    assert issubclass(ArtifactSchemaError, ArtifactFormatError)
    with pytest.raises(TypeError, match="expected a subclass of InputLimitError"):
        load_yaml("a: 1", error=PlanYAMLError)  # a plain base class is no longer turned into one


def test_limit_errors_survive_a_round_trip_through_another_process():
    with pytest.raises(PlanYAMLInputLimitError) as plan_info:
        load_plan("[" * 100 + "]" * 100)
    with pytest.raises(ReportFormatInputLimitError) as report_info:
        VerifyReport.loads('{"mesh": [["tp", NaN]]}', source="r.json")
    with pytest.raises(ArtifactLimitError) as artifact_info:
        loads_artifact(b"[" * 100 + b"]" * 100, source="a.json")
    errors = [plan_info.value, report_info.value, artifact_info.value]
    back = _unpickled_elsewhere(errors)
    assert [row[:2] for row in back] == [
        ["hp_core.plans.errors", "PlanYAMLInputLimitError"],
        ["hp_core.verifier.report", "ReportFormatInputLimitError"],
        ["hp_core.artifact.signed", "ArtifactLimitError"],
    ]
    assert back == [
        [type(e).__module__, type(e).__name__, str(e), e.source, e.path, e.limit, e.env]
        for e in errors
    ]
    assert plan_info.value.env == ENV_MAX_DEPTH and report_info.value.path == "mesh[0][1]"


# ------------------------------------------------------------------------ YAML


def test_an_alias_bomb_in_an_override_target_config_is_refused_fast(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(BOMB_OVERRIDES)
    start = time.perf_counter()
    with pytest.raises(InputLimitError) as info:
        load_overrides(path)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, elapsed
    assert isinstance(info.value, PlanYAMLError)
    message = str(info.value)
    assert message.startswith(
        f"{path}: overrides[0].inner_wrapper.lol.a5[0]: the document expands to over 100000 nodes"
    )
    assert "alias *a4 repeats" in message and "HP_MAX_YAML_NODES=" in message
    assert (info.value.source, info.value.limit, info.value.env) == (
        str(path),
        100_000,
        "HP_MAX_YAML_NODES",
    )
    assert info.value.path == "overrides[0].inner_wrapper.lol.a5[0]"


def test_an_alias_bomb_in_a_plan_document_and_on_the_command_line(capsys, tmp_path):
    start = time.perf_counter()
    with pytest.raises(
        InputLimitError,
        match=r"^<string>: bomb\.a5\[0\]: the document expands to over 100000 nodes",
    ):
        load_plan("bomb:\n" + _bomb(indent="  "))
    assert time.perf_counter() - start < 1.0
    path = tmp_path / "o.yaml"
    path.write_text(BOMB_OVERRIDES)
    start = time.perf_counter()
    code = cli.main(["plan", "--model", "llama", "--mesh", "tp=2", "--overrides", str(path)])
    out, err = capsys.readouterr()
    assert (
        time.perf_counter() - start < 10.0
    )  # the model build included; the refusal itself is instant
    assert (code, out) == (1, "")
    assert err.startswith(
        f"hp plan: error: PlanYAMLInputLimitError: {path}: overrides[0].inner_wrapper.lol."
    )
    assert (
        len(err.strip().splitlines()) == 1 and "Traceback" not in err and "HP_MAX_YAML_NODES" in err
    )


def test_a_recursive_alias_is_refused():
    with pytest.raises(
        InputLimitError,
        match=r"^<string>: a\[1\]: alias \*a refers to a node that contains it \(line 1, column "
        r"11\)",
    ):
        load_plan("a: &a [1, *a]\n")


def test_aliases_within_the_limit_load():
    assert load_yaml("a: &a {x: 1}\nb: *a\nc: {<<: *a, y: 2}\n") == {
        "a": {"x": 1},
        "b": {"x": 1},
        "c": {"x": 1, "y": 2},
    }


def test_a_50000_deep_yaml_list_is_refused_without_recursion_error():
    text = "[" * 50_000 + "]" * 50_000
    with pytest.raises(InputLimitError) as info:
        load_plan(text)
    assert isinstance(info.value, PlanYAMLError) and not isinstance(info.value, RecursionError)
    message = str(info.value)
    assert message.startswith(
        "<string>: [0][0][0][0][0][0][0][0]...: nesting depth over 64 (line 1, column 65)"
    )
    assert "HP_MAX_INPUT_DEPTH=128" in message
    assert (info.value.limit, info.value.env) == (64, "HP_MAX_INPUT_DEPTH")


def test_deep_block_yaml_names_the_path(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "overrides:\n  - match: x\n    config:\n"
        + "".join("  " * (i + 3) + "k:\n" for i in range(80))
        + "  " * 83
        + "1\n"
    )
    with pytest.raises(InputLimitError) as info:
        load_overrides(path)
    assert str(info.value).startswith(
        f"{path}: overrides[0].config.k.k.k.k.k...: nesting depth over 64 (line "
    )


def test_yaml_syntax_errors_stay_plan_yaml_errors():
    with pytest.raises(PlanYAMLError, match=r"^<string>:2:1: invalid YAML") as info:
        load_plan("a: [\n")
    assert not isinstance(info.value, InputLimitError)
    with pytest.raises(PlanYAMLError, match="duplicate key 'a'"):
        load_plan("a: 1\na: 2\n")


def test_an_oversize_yaml_document_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * (DEFAULT_MAX_BYTES // 10 + 1))
    with pytest.raises(PlanYAMLInputLimitError) as info:
        load_overrides(path)
    assert isinstance(info.value, PlanYAMLError) and isinstance(info.value, InputLimitError)
    assert str(info.value).startswith(
        f"{path}: 8388610 bytes, over the input limit of 8388608 bytes; hp refuses larger "
        "documents."
    )
    assert "HP_MAX_INPUT_BYTES=8388610" in str(info.value)


@pytest.mark.parametrize("load", [load_overrides, load_plan], ids=["overrides", "plan"])
def test_an_oversize_plan_file_is_refused_without_reading_it_whole(tmp_path, monkeypatch, load):
    path = tmp_path / "huge.yaml"
    with path.open("wb") as f:
        f.truncate(256 * 1024 * 1024)  # sparse: 256 MiB that cost no disk
    monkeypatch.setenv("HP_MAX_INPUT_BYTES", "1000")

    def whole(*args, **kwargs):
        raise AssertionError("the whole file was read before the size cap was applied")

    for name in ("read_text", "read_bytes"):
        monkeypatch.setattr(type(path), name, whole)
    start = time.perf_counter()
    with pytest.raises(PlanYAMLInputLimitError) as info:
        load(path)
    assert time.perf_counter() - start < 5
    # the size comes from the file's metadata: hp read at most the cap (plus one byte)
    assert str(info.value).startswith(
        f"{path}: 268435456 bytes, over the input limit of 1000 bytes"
    )
    assert (info.value.limit, info.value.env) == (1000, ENV_MAX_BYTES)


def test_a_bad_env_value_raises_the_callers_class(monkeypatch):
    monkeypatch.setenv(ENV_MAX_NODES, "lots")
    with pytest.raises(
        PlanYAMLInputLimitError, match=r"^HP_MAX_YAML_NODES='lots': expected a positive integer"
    ):
        load_overrides("- match: a\n")
    with pytest.raises(PlanYAMLInputLimitError, match=r"^HP_MAX_YAML_NODES='lots'"):
        load_plan("version: 1\n")
    monkeypatch.setenv(ENV_MAX_BYTES, "0")
    with pytest.raises(ReportFormatInputLimitError, match=r"^HP_MAX_INPUT_BYTES='0'"):
        VerifyReport.loads("{}")
    with pytest.raises(ArtifactLimitError, match=r"^HP_MAX_INPUT_BYTES='0'"):
        loads_artifact(b"{}")


# ------------------------------------------------------------------------ JSON


def test_a_100000_deep_json_artifact_is_refused_without_recursion_error(tmp_path):
    data = b'{"format": "hp-artifact", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ArtifactLimitError) as info:
        loads_artifact(data, source="a.json")
    assert isinstance(info.value, ArtifactFormatError) and isinstance(info.value, InputLimitError)
    assert str(info.value).startswith(
        "a.json: meta[0][0][0][0][0][0][0]...: nesting depth over 64 (line 1, column 98)"
    )
    assert "HP_MAX_INPUT_DEPTH=128" in str(info.value)
    path = tmp_path / "deep.json"
    path.write_bytes(data)
    with pytest.raises(ArtifactLimitError, match=rf"^{path}: meta\[0\].*nesting depth over 64"):
        read_artifact(path)


def test_brackets_inside_json_strings_do_not_count():
    doc = {"k": "[" * 1000, "n": [[[1]]]}
    assert loads_json(json.dumps(doc)) == doc


def test_an_oversize_artifact_is_refused_without_reading_it(artifact, tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    path.write_bytes(dumps_artifact(artifact))
    size = path.stat().st_size
    monkeypatch.setenv("HP_MAX_INPUT_BYTES", "1000")
    with pytest.raises(ArtifactLimitError) as info:
        read_artifact(path)
    assert str(info.value).startswith(f"{path}: {size} bytes, over the input limit of 1000 bytes")
    assert f"HP_MAX_INPUT_BYTES={size}" in str(info.value)
    with pytest.raises(
        ArtifactLimitError, match=r"^a\.json: \d+ bytes, over the input limit of 1000 bytes"
    ):
        loads_artifact(dumps_artifact(artifact), source="a.json")
    monkeypatch.setenv("HP_MAX_INPUT_BYTES", str(size))
    assert read_artifact(path) == artifact


@pytest.mark.parametrize(
    ("token", "where", "why"),
    [
        ("NaN", "meta.ep_size", "NaN is not a number hp accepts (JSON has no NaN or Infinity)"),
        ("Infinity", "inputs.model.model_type", "Infinity is not a number hp accepts"),
        ("-Infinity", "meta.param_plan[0].is_boundary", "-Infinity is not a number hp accepts"),
        ("1e999", "inputs.overrides[0].when", "1e999 overflows to infinity"),
        ("9" * 5000, "meta.ep_size", "an integer of 5000 digits is too long to read"),
    ],
)
def test_non_finite_numbers_in_an_artifact_are_refused_naming_the_key(artifact, token, where, why):
    doc = json.loads(dumps_artifact(artifact))
    target, key = doc, None
    parts = where.replace("[0]", ".0").split(".")
    for part in parts[:-1]:
        target = target[int(part) if part.isdigit() else part]
    key = parts[-1]
    target[key] = "@@"
    data = json.dumps(doc).replace('"@@"', token).encode()
    with pytest.raises(ArtifactLimitError) as info:
        loads_artifact(data, source="a.json")
    assert isinstance(info.value, ArtifactFormatError)
    assert str(info.value).startswith(f"a.json: {where}: {why}")
    assert info.value.path == where


def test_json_keys_are_quoted_when_not_identifiers():
    with pytest.raises(
        InputLimitError, match=r"^c\.json: \['model\.layers\.0'\]\.x\[2\]: NaN is not a number"
    ):
        loads_json('{"model.layers.0": {"x": [1, 2, NaN]}}', source="c.json")


# ----------------------------------------------------- typed sections, re-signed


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(meta=[]), "a.json: meta: expected a mapping, got list."),
        (
            lambda d: d["meta"].update(param_plan={}),
            "a.json: meta: param_plan: expected a list of {match: FQN, ...} rules, got {}.",
        ),
        (
            lambda d: d["meta"]["param_plan"].__setitem__(0, "model.embed_tokens"),
            "a.json: meta: param_plan[0]: expected a mapping with a string 'match' (a module "
            "FQN), got 'model.embed_tokens'.",
        ),
        (
            lambda d: d["meta"]["param_plan"][0].update(match=3),
            "a.json: meta: param_plan[0].match: expected a string (a module FQN), got int 3.",
        ),
        (
            lambda d: d["meta"].update(ep_size="1"),
            "a.json: meta: ep_size: expected a positive integer, got '1'.",
        ),
        (
            lambda d: d["meta"]["mesh"].update(shape="2"),
            "a.json: meta: mesh.shape: expected a list of axis sizes such as [4, 2], got str '2'.",
        ),
        (
            lambda d: d["meta"]["mesh"].update(axis_names="tp"),
            "a.json: meta: mesh.axis_names: expected a list of axis names such as [tp, cp], "
            "got str 'tp'.",
        ),
        (
            lambda d: d["meta"]["mesh"].update(shape=["2"]),
            "a.json: meta: mesh.shape: expected a list of axis sizes such as [4, 2], got "
            "list ['2'].",
        ),
        (
            lambda d: d["meta"].update(sequence_parallel="yes"),
            "a.json: meta: sequence_parallel: expected true or false, got str 'yes'.",
        ),
        (
            lambda d: d["meta"]["param_plan"][0]["params"]["weight"].update(tp=0),
            "a.json: meta: param_plan[0] ('model.embed_tokens').params.weight.tp: expected a "
            "placement string, got int 0.",
        ),
        (
            lambda d: d["inputs"].update(model="llama"),
            "a.json: inputs.model: expected a mapping with the keys class, digest, "
            "model_type, got str 'llama'.",
        ),
        (
            lambda d: d["inputs"]["model"].update(digest=5),
            "a.json: inputs.model.digest: expected a string, got int 5.",
        ),
        (
            lambda d: d["inputs"]["model"].pop("class"),
            "a.json: inputs.model: expected the keys class, digest, model_type, got "
            "['digest', 'model_type'].",
        ),
        (
            lambda d: d["inputs"].update(hp_version=3),
            "a.json: inputs.hp_version: expected a string, got int 3.",
        ),
        (
            lambda d: d["inputs"].update(mesh=["tp", 2]),
            "a.json: inputs.mesh: expected a string, got list ['tp', 2].",
        ),
        (
            lambda d: d["inputs"].update(plugins=[]),
            "a.json: inputs.plugins: expected a mapping of plugin name to {distribution, "
            "version}, got list [].",
        ),
        (
            lambda d: d["inputs"]["plugins"].update(builtin="0.1"),
            "a.json: inputs.plugins['builtin']: expected a mapping with the keys "
            "distribution, version, got str '0.1'.",
        ),
        (
            lambda d: d["inputs"]["plugins"]["builtin"].update(version=1.0),
            "a.json: inputs.plugins['builtin'].version: expected a string or null, got float 1.0.",
        ),
        (
            lambda d: d["inputs"].update(overrides={}),
            "a.json: inputs.overrides: expected a list of override entries, got dict {}.",
        ),
        (
            lambda d: d["inputs"]["overrides"].__setitem__(0, "x"),
            "a.json: inputs.overrides[0]: expected a mapping (an override entry), got str 'x'.",
        ),
        (
            lambda d: d["inputs"]["overrides"][0].update(match=["a"]),
            "a.json: inputs.overrides[0].match: expected a string, got list ['a'].",
        ),
    ],
    ids=[
        "meta-list",
        "param_plan-mapping",
        "module-entry-string",
        "match-number",
        "ep_size-string",
        "mesh-shape-string",
        "mesh-axes-string",
        "mesh-size-string",
        "bool-string",
        "placement-number",
        "model-string",
        "digest-number",
        "model-keys",
        "hp_version-number",
        "mesh-list",
        "plugins-list",
        "plugin-string",
        "plugin-version-number",
        "overrides-mapping",
        "override-string",
        "override-match-list",
    ],
)
def test_a_signed_artifact_with_a_wrongly_typed_section_is_refused_naming_the_key(
    artifact, edit, message
):
    data = _resigned(artifact, edit)
    with pytest.raises(ArtifactSchemaError) as info:
        loads_artifact(data, source="a.json")
    assert isinstance(
        info.value, ArtifactFormatError
    )  # the signature passed: the type check refused it
    assert str(info.value).startswith(message), str(info.value)
    assert str(info.value).endswith(
        "Re-create it with this hp: hp freeze --model ... --mesh ... -o ARTIFACT."
    )


def test_a_float_format_version_is_refused(artifact):
    with pytest.raises(ArtifactVersionError, match=r"^a\.json: artifact format version 1\.0; "):
        loads_artifact(_resigned(artifact, lambda d: d.update(format_version=1.0)), source="a.json")


def test_a_null_model_type_and_plugin_version_still_load(artifact):
    def edit(d):
        d["inputs"]["model"]["model_type"] = None
        d["inputs"]["plugins"]["builtin"]["version"] = None

    loaded = loads_artifact(_resigned(artifact, edit), source="a.json")
    assert loaded.inputs["model"]["model_type"] is None


# ------------------------------------------------------------ raising a limit


def test_env_vars_raise_the_limits(monkeypatch):
    deep = "[" * 70 + "]" * 70
    with pytest.raises(InputLimitError, match="nesting depth over 64"):
        load_yaml(deep, source="d.yaml")
    with pytest.raises(InputLimitError, match="nesting depth over 64"):
        loads_json(deep, source="d.json")
    monkeypatch.setenv("HP_MAX_INPUT_DEPTH", "100")
    assert load_yaml(deep) == loads_json(deep)
    with pytest.raises(
        InputLimitError, match=r"^d\.yaml: .*nesting depth over 10 .*HP_MAX_INPUT_DEPTH=20\."
    ):
        load_yaml(deep, source="d.yaml", max_depth=10)  # a keyword argument wins over the variable

    small_bomb = "b:\n" + _bomb(levels=4, width=10, indent="  ")  # 12,353 nodes once expanded
    assert load_yaml(small_bomb)["b"]["a3"][0][0][0][0] == "lol"
    monkeypatch.setenv("HP_MAX_YAML_NODES", "5000")
    with pytest.raises(InputLimitError) as info:
        load_yaml(small_bomb, source="s.yaml")
    assert str(info.value).startswith("s.yaml: b.a3[")
    assert "over 5000 nodes" in str(info.value) and "HP_MAX_YAML_NODES=50000" in str(info.value)
    monkeypatch.setenv("HP_MAX_YAML_NODES", "20000")
    assert load_yaml(small_bomb)["b"]["a3"][9][9][9][9] == "lol"

    with pytest.raises(
        InputLimitError, match=r"^s\.json: 12 bytes, over the input limit of 10 bytes"
    ):
        loads_json(b'"0123456789"', source="s.json", max_bytes=10)
    monkeypatch.setenv("HP_MAX_INPUT_BYTES", "10")
    with pytest.raises(InputLimitError, match=r"HP_MAX_INPUT_BYTES=12\.$"):
        loads_json(b'"0123456789"', source="s.json")
    monkeypatch.setenv("HP_MAX_INPUT_BYTES", "12")
    assert loads_json(b'"0123456789"') == "0123456789"


def test_a_refused_plan_loads_once_the_limit_is_raised(monkeypatch, tmp_path):
    path = tmp_path / "o.yaml"
    path.write_text(
        "- match: model.layers.*.self_attn\n  inner_wrapper: {_target_: sdpa_hf, pad: "
        + "[" * 70
        + "]" * 70
        + "}\n"
    )
    with pytest.raises(
        InputLimitError, match=rf"^{path}: \[0\]\.inner_wrapper\.pad\[0\].*nesting depth over 64"
    ):
        load_overrides(path)
    monkeypatch.setenv("HP_MAX_INPUT_DEPTH", "128")
    (entry,) = load_overrides(path)
    assert entry.spec.inner_wrapper.config["pad"] == json.loads("[" * 70 + "]" * 70)


@pytest.mark.parametrize("value", ["many", "0", "-3"])
def test_a_bad_env_value_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("HP_MAX_INPUT_DEPTH", value)
    with pytest.raises(
        InputLimitError,
        match=rf"^HP_MAX_INPUT_DEPTH='{value}': expected a positive integer; unset it to use the "
        r"default 64\.",
    ):
        load_yaml("a: 1")


def test_read_bounded(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100)
    assert read_bounded(path, max_bytes=100) == b"x" * 100
    with pytest.raises(
        InputLimitError, match=r"^f: 100 bytes, over the input limit of 99 bytes"
    ) as info:
        read_bounded(path, source="f", max_bytes=99)
    assert (info.value.limit, info.value.env) == (99, "HP_MAX_INPUT_BYTES")


# ---------------------------------------------------------------- reports


def test_a_deep_verifier_report_is_refused():
    with pytest.raises(ReportFormatError) as info:
        VerifyReport.loads(
            '{"format": "hp-verify-report", "checked": ' + "[" * 100_000 + "]" * 100_000 + "}",
            source="r.json",
        )
    assert isinstance(info.value, InputLimitError)
    assert str(info.value).startswith(
        "r.json: checked[0][0][0][0][0][0][0]...: nesting depth over 64"
    )
    with pytest.raises(ReportFormatError, match=r"^r\.json: mesh\[0\]\[1\]: NaN is not a number"):
        VerifyReport.loads('{"format": "hp-verify-report", "mesh": [["tp", NaN]]}', source="r.json")


# ---------------------------------------------------------------- hp --model


def _plan_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("model", ["llama", "config"])
def test_without_transformers_the_cli_names_the_extra(capsys, tmp_path, monkeypatch, model):
    if model == "config":
        tiny_config("llama").to_json_file(tmp_path / "config.json")
        model = str(tmp_path / "config.json")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    code, out, err = _plan_cli(capsys, "--model", model, "--mesh", "tp=2")
    assert (code, out) == (2, "")
    assert err.startswith("hp plan: error: --model needs transformers, which cannot be imported (")
    assert err.rstrip("\n").endswith("Install hp's Hugging Face extra: pip install 'hp-core[hf]'")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0."),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0."),
        ({"hidden_size": -8}, "hidden_size must be a positive integer, got -8."),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1."),
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0."),
        ({"hidden_size": "big"}, "hidden_size must be a positive integer, got str 'big'."),
        (
            {"num_attention_heads": 2.5},
            "num_attention_heads must be a positive integer, got float 2.5.",
        ),
        (
            {"intermediate_size": True},
            "intermediate_size must be a positive integer, got bool True.",
        ),
        (
            {"intermediate_size": [128, 0]},
            "intermediate_size[1] must be a positive integer, got 0.",
        ),
        (
            {"intermediate_size": []},
            "intermediate_size must be a positive integer, got list [].",
        ),
        (
            {"hidden_size": 30, "head_dim": None},
            "hidden_size (30) is not divisible by num_attention_heads (4); fix the sizes or "
            "set head_dim.",
        ),
        (
            {"hidden_size": 30},
            "transformers cannot build this config: StrictDataclassClassValidationError: ",
        ),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads (4) is not a multiple of num_key_value_heads (3).",
        ),
        (
            {"model_type": "lamma"},
            "transformers cannot build this config: unknown model_type 'lamma'. Did you mean "
            "'llama'?",
        ),
        (
            {"tie_word_embeddings": "yes"},
            "transformers cannot build this config: StrictDataclassFieldValidationError: ",
        ),
    ],
    ids=[
        "heads-0",
        "kv-heads-0",
        "negative-hidden",
        "negative-layers",
        "vocab-0",
        "string-size",
        "float-heads",
        "bool-size",
        "per-layer-size-0",
        "empty-per-layer-list",
        "not-divisible",
        "not-divisible-transformers",
        "kv-not-dividing",
        "unknown-model-type",
        "transformers-type-check",
    ],
)
def test_a_bad_model_config_exits_2_with_one_line(capsys, tmp_path, change, message):
    data = {**tiny_config("llama").to_dict(), **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    for command in ("plan", "freeze"):
        extra = ["-o", str(tmp_path / "a.json")] if command == "freeze" else []
        code = cli.main([command, "--model", str(path), "--mesh", "tp=2", *extra])
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), err
        assert err.startswith(f"hp {command}: error: --model: {str(path)!r}: {message}"), err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"model_type": "llama", "rope_theta": NaN}',
            "rope_theta: NaN is not a number hp accepts",
        ),
        (
            '{"model_type": "llama", "x": ' + "[" * 100 + "]" * 100 + "}",
            "x[0][0][0][0][0][0][0]...: nesting depth over 64",
        ),
    ],
)
def test_a_hostile_config_json_exits_2_with_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, out, err = _plan_cli(capsys, "--model", str(path), "--mesh", "tp=2")
    assert (code, out) == (2, "")
    assert err.startswith(f"hp plan: error: --model: {path}: {message}"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_oversize_config_json_exits_2(capsys, tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    tiny_config("llama").to_json_file(path)
    monkeypatch.setenv("HP_MAX_INPUT_BYTES", "100")
    code, out, err = _plan_cli(capsys, "--model", str(path), "--mesh", "tp=2")
    assert (code, out) == (2, "")
    assert err.startswith(
        f"hp plan: error: --model: {path}: {path.stat().st_size} bytes, over the input limit "
        "of 100 bytes"
    )
    assert "HP_MAX_INPUT_BYTES=" in err and len(err.strip().splitlines()) == 1


def test_load_yaml_needs_a_python_loader():
    import yaml

    if getattr(yaml, "CSafeLoader", None) is None:
        pytest.skip("PyYAML without libyaml")
    with pytest.raises(TypeError, match="CSafeLoader does not compose in Python"):
        load_yaml("a: 1", loader=yaml.CSafeLoader)
