"""The wheels: they build cleanly, carry the declared metadata, and work installed (not editable).

Offline throughout: the wheels are built without build isolation or an index, from a copy
of the sources (so no ``build/`` folder of the checkout, stale or in use, is read or
written). A fresh venv gets the wheels through ``pip install --no-deps --no-index``; its
third-party packages (torch, pluggy, pyyaml, rich, transformers, ...) are this
environment's, reached through a folder of symlinks that leaves out every hp distribution
and editable finder, so hp_core and the plugins can only come from the wheels.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# distribution -> (source folder relative to the root, import package)
DISTS = {
    "hp-core": (".", "hp_core"),
    "hp-plugin-cp": ("hp_plugin_cp", "hp_plugin_cp"),
    "hp-plugin-moe": ("hp_plugin_moe", "hp_plugin_moe"),
    "hp-plugin-phi3": ("plugins/hp-plugin-phi3", "hp_plugin_phi3"),
    "hp-plugin-bloom": ("plugins/hp-plugin-bloom", "hp_plugin_bloom"),
}
SOURCE_JUNK = (
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".coverage*",
)
OWN = re.compile(
    r"^(hp[_-]|__editable__|__pycache__$)", re.IGNORECASE
)  # never linked into the fresh venv


def _clean_env(**extra: str) -> dict[str, str]:
    """An environment that cannot leak this checkout (PYTHONPATH), coverage, hp plugin settings or
    an index."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("PYTHON", "PIP_", "COV_", "COVERAGE_", "HP_", "VIRTUAL_ENV", "TORCHELASTIC_")
        )
    }
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PYTHONNOUSERSITE="1",
        OMP_NUM_THREADS="1",
        COLUMNS="200",
        **extra,
    )
    return env


def _run(
    cmd: list[str], cwd: Path, timeout: int = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel per distribution, the verbose build log): all four built by one offline
    ``pip wheel``."""
    tmp = tmp_path_factory.mktemp("wheels")
    src = tmp / "src"
    junk = shutil.ignore_patterns(*SOURCE_JUNK)
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name in (
        "pyproject.toml",
        core["readme"],
        *core["license-files"],
    ):  # what the root build reads
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    for dist, (folder, package) in DISTS.items():
        tree = (
            package if dist == "hp-core" else folder
        )  # the core's sources; a plugin's whole folder
        shutil.copytree(ROOT / tree, src / tree, ignore=junk)
    out = tmp / "dist"
    # -v: pip shows the backend's own output (setuptools' warnings) only when verbose.
    proc = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--no-cache-dir",
            "-w",
            out,
            *(f"./{folder}" for folder, _ in DISTS.values()),
        ],
        cwd=src,
        timeout=180,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    wheels = {}
    for dist in DISTS:
        found = sorted(out.glob(f"{dist.replace('-', '_')}-*-py3-none-any.whl"))
        assert len(found) == 1, (dist, sorted(p.name for p in out.iterdir()))
        wheels[dist] = found[0]
    return wheels, log


def _metadata(wheel: Path) -> tuple[object, list[str]]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(zf.read(meta).decode()), names


def test_wheels_build_without_deprecation_warnings(built):
    _, log = built
    # the verbose log really holds the backend's output, for each of the four builds
    assert log.count("running bdist_wheel") == len(DISTS), log[-3000:]
    bad = [line for line in log.splitlines() if re.search(r"deprecat", line, re.IGNORECASE)]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("dist", DISTS)
def test_wheel_metadata_license_and_ranges(built, dist):
    wheels, _ = built
    meta, names = _metadata(wheels[dist])
    assert meta["Metadata-Version"] in ("2.4", "2.5")
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["License"] is None  # the free-text field is gone (PEP 639)
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert len(licenses) == 1
    with zipfile.ZipFile(wheels[dist]) as zf:
        assert "Apache License" in zf.read(licenses[0]).decode()
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    if dist == "hp-core":
        base = {r.name: r for r in reqs if r.marker is None}
        assert set(base) == {"torch", "pluggy", "pyyaml", "rich"}
        assert base["torch"].specifier.contains("2.13.0") and not base["torch"].specifier.contains(
            "2.14.0"
        )
        assert not base["torch"].specifier.contains("2.12.0")
        assert "hf" in meta.get_all("Provides-Extra") and "test" in meta.get_all("Provides-Extra")
        hf = [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "hf"})]
        assert [(r.name, str(r.specifier)) for r in hf] == [
            ("transformers", str(Requirement("transformers<6,>=5.0").specifier))
        ]
        test = {
            r.name for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "test"})
        }
        assert "transformers" in test or "hp-core" in test
    else:
        (core,) = reqs
        version = _metadata(wheels["hp-core"])[0]["Version"]
        assert core.name == "hp-core" and core.marker is None
        assert core.specifier.contains(version) and not core.specifier.contains("0.2.0"), core
    assert any(n.startswith(f"{DISTS[dist][1]}/") and n.endswith("py.typed") for n in names)


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """A fresh venv with the four wheels installed (non-editable) and this environment's third-party
    packages."""
    wheels, _ = built
    tmp = tmp_path_factory.mktemp("venv")
    env_dir = tmp / "env"
    proc = _run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    python = env_dir / "bin" / "python"
    site = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp
        ).stdout.strip()
    )
    assert site.is_dir() and site.is_relative_to(env_dir), site

    deps = tmp / "third_party"  # symlinks to this environment's packages, minus anything of hp's
    deps.mkdir()
    for folder in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        for entry in Path(folder).iterdir():
            if OWN.match(entry.name) or entry.suffix == ".pth" or (deps / entry.name).exists():
                continue
            (deps / entry.name).symlink_to(entry)
    assert not [p.name for p in deps.iterdir() if p.name.lower().startswith(("hp_", "hp-"))]
    (site / "_hp_test_third_party.pth").write_text(f"{deps}\n")
    # negative control: before the wheels go in, the third-party packages import, and no hp package
    # does
    probe = (
        "import importlib.util as u, importlib.metadata as md, torch, pluggy, yaml, rich;"
        "print([m for m in ('hp_core', 'hp_plugin_cp', 'hp_plugin_moe', 'hp_plugin_phi3', "
        "'hp_plugin_bloom') if "
        "u.find_spec(m)]"
        " + [d.metadata['Name'] for d in md.distributions() if "
        "d.metadata['Name'].startswith('hp-')])"
    )
    proc = _run([python, "-c", probe], cwd=tmp)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr

    # pip of this environment, installing into the fresh one (pip>=22.3: --python).
    proc = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            *wheels.values(),
        ],
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return env_dir, tmp


def test_fresh_venv_imports_hp_from_the_wheels(venv):
    env_dir, tmp = venv
    code = textwrap.dedent(
        """
        import json, importlib.metadata as md, torch
        import hp_core, hp_plugin_cp, hp_plugin_moe, hp_plugin_phi3, hp_plugin_bloom
        mods = (hp_core, hp_plugin_cp, hp_plugin_moe, hp_plugin_phi3, hp_plugin_bloom)
        dists = ("hp-core", "hp-plugin-cp", "hp-plugin-moe", "hp-plugin-phi3", "hp-plugin-bloom")
        print(json.dumps({
            "files": [m.__file__ for m in mods],
            "dists": [str(md.distribution(d).locate_file("")) for d in dists],
            "direct_url": [
                json.loads(md.distribution(d).read_text("direct_url.json") or "{}")
                for d in dists
            ],
            "torch": torch.__version__,
        }))
        """
    )
    proc = _run([env_dir / "bin" / "python", "-c", code], cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    site = env_dir.resolve()
    for path in info["files"] + info["dists"]:
        assert Path(path).resolve().is_relative_to(site), (path, site)
        assert not Path(path).resolve().is_relative_to(ROOT.resolve()), path
    # installed from the built wheel files, not editable from a folder
    for url in info["direct_url"]:
        assert "dir_info" not in url and url["url"].endswith(".whl"), url
    assert info["torch"].startswith("2.13.0")


def test_hp_plugins_in_fresh_venv_lists_cp_and_moe_loaded(venv):
    env_dir, tmp = venv
    proc = _run([env_dir / "bin" / "hp", "plugins", "--strict"], cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) >= 4:
            rows.setdefault(cells[0], cells)
    for name, dist in (
        ("cp", "hp-plugin-cp"),
        ("moe", "hp-plugin-moe"),
        ("phi3", "hp-plugin-phi3"),
        ("bloom", "hp-plugin-bloom"),
    ):
        assert name in rows, proc.stdout
        assert rows[name][1:4] == [dist, "0.1.0", "loaded"], rows[name]
    assert rows["builtin"][1] == "hp-core"


DIST_CHECK = """
import copy, json, sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.presets import build_model

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
model = build_model("llama", seed=0)
reference = copy.deepcopy(model)
plan = hp_core.plan(model, mesh)
hp_core.apply(model, plan, mesh)
ref_params = dict(reference.named_parameters())
sharded = [
    n
    for n, p in model.named_parameters()
    if isinstance(p, DTensor) or p.shape != ref_params[n].shape
]
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    out = model(input_ids=ids, use_cache=False).logits
    ref = reference(input_ids=ids, use_cache=False).logits
out = out.full_tensor() if isinstance(out, DTensor) else out
diff = (out - ref).abs().max().item()
ok = bool(sharded) and out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
result = {
    "ok": ok, "world": world, "sharded": len(sharded), "diff": diff, "hp_core": hp_core.__file__
}
# files: rank outputs interleave
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
sys.exit(0 if ok else 1)
"""


@pytest.mark.distributed
def test_tp2_gloo_plan_apply_in_fresh_venv_matches_single_process(venv):
    env_dir, tmp = venv
    script = tmp / "dist_check.py"
    script.write_text(DIST_CHECK)
    results = tmp / "dist_results"
    results.mkdir()
    proc = _run(
        [
            env_dir / "bin" / "python",
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            script,
            results,
        ],
        cwd=tmp,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert sorted(p.name for p in results.iterdir()) == ["rank0.json", "rank1.json"], out[-6000:]
    for rank in (0, 1):
        result = json.loads((results / f"rank{rank}.json").read_text())
        assert result["ok"] and result["world"] == 2 and result["sharded"] > 0, result
        assert Path(result["hp_core"]).resolve().is_relative_to(env_dir.resolve()), result
