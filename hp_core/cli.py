"""The ``hp`` command line.

Each subcommand is one ``add_<name>_command(subparsers)`` function that declares its
arguments and sets ``handler``; a handler takes ``(args, out, err)`` (two rich
consoles) and returns the exit code. ``main`` wires them together.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from hp_core.plugins import RegisteredItem

__all__ = [
    "add_check_command",
    "add_demo_command",
    "add_freeze_command",
    "add_plan_command",
    "add_plugins_command",
    "build_parser",
    "cmd_check",
    "cmd_demo",
    "cmd_freeze",
    "cmd_plan",
    "cmd_plugins",
    "main",
]

Handler = Callable[[argparse.Namespace, Console, Console], int]

#: Width used when output is not a terminal, so nothing is truncated in logs and pipes.
PIPE_WIDTH = 240


def _console(file: TextIO) -> Console:
    is_tty = hasattr(file, "isatty") and file.isatty()
    return Console(file=file, width=None if is_tty else PIPE_WIDTH, highlight=False, soft_wrap=False)


# --------------------------------------------------------------------- hp plugins


def add_plugins_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp plugins [--strict]``: list plugins and every registered item."""
    parser = subparsers.add_parser(
        "plugins",
        help="list installed plugins and every registered item with its provider",
        description=(
            "List the plugins hp found (name, distribution, version, status) and every item "
            "they registered. Honors HP_DISABLE_PLUGIN_AUTOLOAD and HP_PLUGINS."
        ),
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 if any plugin failed to load (also HP_PLUGINS_STRICT=1)",
    )
    parser.set_defaults(handler=cmd_plugins)


def _describe_item(item: RegisteredItem) -> str:
    parts = []
    if "type" in item.meta:
        parts.append(str(item.meta["type"]))
    role = getattr(item.value, "role", None) if item.kind == "template" else None
    if role is not None:
        parts.append(f"role={role}")
    for key, value in item.meta.items():
        if key == "type":
            continue
        if key == "architectures":
            if value:
                parts.append(f"architectures={','.join(value)}")
            continue
        parts.append(f"{key}={value}")
    return " ".join(parts)


def cmd_plugins(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Print the plugin table and the item table; with ``--strict`` fail on broken plugins."""
    from hp_core.plugins import RegistryKind
    from hp_core.plugins._manager import current_state, strict_from_env

    # The diagnostic view never raises for a broken plugin: it is how you find it.
    state = current_state(strict=False)

    plugins = Table(title="hp plugins", title_justify="left")
    for column in ("name", "distribution", "version", "status", "items", "details"):
        plugins.add_column(column, overflow="fold")
    for info in state.report:
        style = {"failed": "red", "disabled": "dim"}.get(info.status, "")
        plugins.add_row(
            Text(info.name),
            Text(info.distribution or "-"),
            Text(info.version or "-"),
            Text(info.status, style=style),
            Text(str(info.items)),
            Text(info.error or info.note or ""),
        )
    out.print(plugins)

    items = Table(title="registered items", title_justify="left")
    for column in ("kind", "name", "provider", "distribution", "details"):
        items.add_column(column, overflow="fold")
    for kind in RegistryKind:
        for item in state.items[kind].values():
            items.add_row(
                Text(kind.value),
                Text(item.name),
                Text(item.provider),
                Text(item.distribution or "-"),
                Text(_describe_item(item)),
            )
    out.print(items)

    for warning in state.warnings:
        err.print(Text(f"warning: {warning}", style="yellow"))

    strict = args.strict or strict_from_env()
    failures = state.failures()
    if strict and (failures or state.warnings):
        for info in failures:
            version = f" {info.version}" if info.version else ""
            err.print(
                Text(
                    f"hp plugins --strict: plugin {info.name!r} from distribution "
                    f"{info.distribution or '(none)'}{version} failed to load: {info.error}",
                    style="red",
                )
            )
        if state.warnings:
            err.print(Text("hp plugins --strict: plugin selection problems (see warnings above).", style="red"))
        err.print(
            Text("Fix: repair or uninstall the failing plugin, or leave it out with HP_PLUGINS=<names>.")
        )
        return 1
    return 0


# ------------------------------------------------------------------------ hp plan


class _UsageError(Exception):
    """Bad command-line input (exit 2)."""


#: Plan/freeze anyway when the plan names registry items no installed plugin provides.
ALLOW_MISSING_PLUGINS = "--allow-missing-plugins"
_ALLOW_MISSING_HELP = (
    "warn instead of refusing (exit 2) when the plan names an inner wrapper or compute factory "
    "that no installed plugin provides (hp_core.apply still refuses such a plan)"
)
_DOING = {"plan": "planning", "freeze": "freezing"}


def add_plan_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp plan --model NAME_OR_CONFIG --mesh tp=8,cp=2 ...``: plan on the meta device and explain."""
    parser = subparsers.add_parser(
        "plan",
        help="plan a model for a mesh on the meta device and print the plan",
        description=(
            "Build the model on the meta device (no weights, no processes, no process group), "
            "plan it for the mesh and print every boundary with the collectives it costs, then "
            "the collectives of one training step. Nothing is downloaded. With --verify, also "
            "run the plan verifier on meta copies of the model (an in-process fake process "
            "group of the mesh's size, so any mesh works on a laptop): exit 1 with its message "
            "if it refuses the plan."
        ),
    )
    _add_planning_args(parser)
    parser.add_argument("--yaml", action="store_true", help="print the plan as YAML instead of the explanation")
    parser.add_argument(
        "--verify",
        action="store_true",
        help=(
            "verify the plan on meta copies (hp_core.verify) and print its report; the collectives "
            "per step then count the gradient reductions it derived (exit 1 if it refuses)"
        ),
    )
    parser.add_argument(ALLOW_MISSING_PLUGINS, action="store_true", help=_ALLOW_MISSING_HELP)
    parser.set_defaults(handler=cmd_plan)


def _check_plugin_items(plan: Any, args: argparse.Namespace, err: Console, verb: str) -> None:
    """Refuse (exit 2) a plan naming registry items that are not installed; with
    ``--allow-missing-plugins`` print one warning line per missing item instead.

    The message is ``hp_core.apply``'s: the items are resolved with the function its
    preflight uses (``hp_core.injection.resolve_injection``).
    """
    from hp_core.plugins._plan_items import missing_plan_items

    missing = missing_plan_items(plan)
    if not missing:
        return
    if args.allow_missing_plugins:
        for item in missing:
            err.print(
                Text(
                    f"warning: {item.one_line().rstrip('.')}; {_DOING[verb]} anyway "
                    f"({ALLOW_MISSING_PLUGINS}): hp_core.apply refuses this plan until a plugin "
                    "provides it."
                ),
                soft_wrap=True,
            )
        return
    first = missing[0].one_line()
    also = "".join(f" Also missing: {m.name!r} ({m.where})." for m in missing[1:])
    stop = "" if first.endswith(".") else "."
    raise _Failed(2, f"{first}{stop}{also} To {verb} anyway, pass {ALLOW_MISSING_PLUGINS}.")


def _add_planning_args(parser: argparse.ArgumentParser) -> None:
    """The model, mesh and planning options shared by ``hp plan`` and ``hp freeze``."""
    from hp_core.presets import PRESETS

    parser.add_argument(
        "--model",
        required=True,
        metavar="NAME_OR_CONFIG",
        help=f"a preset ({', '.join(PRESETS)}) or a path to an HF config.json (or its folder)",
    )
    parser.add_argument("--mesh", required=True, help="mesh axes and sizes, e.g. tp=8,cp=2 or dp=2,tp=4")
    parser.add_argument("--overrides", metavar="FILE", help="a YAML overrides file")
    parser.add_argument(
        "--sp",
        dest="sequence_parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sequence parallelism between blocks when tp > 1 (default: on)",
    )
    parser.add_argument(
        "--loss-parallel", action="store_true", help="keep the logits vocab-sharded for a parallel loss"
    )
    parser.add_argument(
        "--ep", type=_positive_int, default=1, metavar="N", help="expert-parallel size for MoE blocks (default 1)"
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


#: ``pip install`` line for the optional dependencies ``--model`` needs.
HF_EXTRA_INSTALL = "pip install 'hp-core[hf]'"
#: HF config sizes that must be positive integers wherever a config sets them.
_CONFIG_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "num_hidden_layers",
    "vocab_size",
    "head_dim",
)


def _one_line(error: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line (whitespace collapsed), at most ``limit`` characters."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _require_transformers() -> None:
    """``--model`` builds a transformers model: refuse (exit 2) with the install line if it cannot be imported."""
    import importlib

    try:
        importlib.import_module("transformers")
    except ImportError as e:
        raise _UsageError(
            f"--model needs transformers, which cannot be imported ({' '.join(str(e).split())}). "
            f"Install hp's Hugging Face extra: {HF_EXTRA_INSTALL}"
        ) from None


def _config_problem(get: Callable[[str], Any], *, has_head_dim: bool) -> str | None:
    """What is wrong with a config's sizes (``get(key)``: the value or None), or None."""
    for key in _CONFIG_SIZES:
        value = get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key} must be a positive integer, got {type(value).__name__} {value!r}"
        if value < 1:
            return f"{key} must be a positive integer, got {value}"
    hidden, heads, kv = get("hidden_size"), get("num_attention_heads"), get("num_key_value_heads")
    if not has_head_dim and hidden and heads and hidden % heads:
        return (
            f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}); fix the sizes "
            "or set head_dim"
        )
    if heads and kv and heads % kv:
        return f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})"
    return None


def _load_config(model: str) -> Any:
    """A preset name or a local HF config (file or folder) → a transformers config. Offline.

    Every bad config (unreadable, over hp's input limits, an unknown model type, a size
    that is not a positive integer, heads that do not divide) is a :class:`_UsageError`
    naming the file, as is a missing ``transformers``.
    """
    import json
    from pathlib import Path

    from hp_core.bounded import InputLimitError, loads_json, read_bounded
    from hp_core.spec import close_matches
    from hp_core.presets import PRESETS, UnknownModelPresetError, preset_config

    path = Path(model)
    looks_like_path = path.exists() or model.endswith(".json") or "/" in model or "\\" in model
    if not looks_like_path:
        if model in PRESETS:
            _require_transformers()
        try:
            return preset_config(model)
        except UnknownModelPresetError as e:
            raise _UsageError(f"--model: {e} Or pass a path to an HF config.json.") from None
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise _UsageError(
            f"--model: {str(file)!r}: no such file. Pass an HF config.json (or its folder) "
            f"or a preset: {', '.join(PRESETS)}."
        )
    try:
        data = loads_json(read_bounded(file), source=str(file))
    except InputLimitError as e:
        raise _UsageError(f"--model: {e}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _UsageError(f"--model: {str(file)!r} is not a readable JSON config: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise _UsageError(
            f"--model: {str(file)!r} has no 'model_type'; an HF config.json names its model type "
            "(e.g. \"model_type\": \"llama\")."
        )
    data = dict(data)
    problem = _config_problem(data.get, has_head_dim=data.get("head_dim") is not None)
    if problem is not None:
        raise _UsageError(f"--model: {str(file)!r}: {problem}.")
    _require_transformers()
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.pop("model_type")
    cannot = f"--model: {str(file)!r}: transformers cannot build this config"
    if model_type not in CONFIG_MAPPING:
        best = close_matches(model_type, CONFIG_MAPPING.keys(), n=1)
        hint = f" Did you mean {best[0]!r}?" if best else ""
        raise _UsageError(
            f"{cannot}: unknown model_type {model_type!r}.{hint} (transformers "
            f"{transformers.__version__} does not know it; a newer one may.)"
        )
    try:
        config = AutoConfig.for_model(model_type, **data)
    except Exception as e:  # transformers validates with many types (ValueError, ZeroDivisionError, StrictDataclassError, ...)
        raise _UsageError(f"{cannot}: {_one_line(e)}") from None
    problem = _config_problem(lambda key: getattr(config, key, None), has_head_dim=True)
    if problem is not None:
        raise _UsageError(f"--model: {str(file)!r}: {problem}.")
    return config


class _Failed(Exception):
    """A command failed: ``code`` is the exit status (1 problem, 2 usage)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _load_model(name: str) -> Any:
    """``--model``: a preset or an HF config, built on the meta device (usage errors exit 2)."""
    from hp_core.presets import model_from_config

    try:
        config = _load_config(name)
    except _UsageError as e:
        raise _Failed(2, str(e)) from None
    try:
        return model_from_config(config, device="meta")
    except Exception as e:  # any failure to build from the user's config is a bad config (exit 2)
        raise _Failed(2, f"--model: cannot build a causal LM from {name!r}: {_one_line(e)}") from None


def _plan_from_args(args: argparse.Namespace, err: Console) -> tuple[Any, Any]:
    """Plan ``--model`` for ``--mesh`` with the planning options; returns ``(plan, model)``.

    Raises :class:`_Failed`; prints hp's own warnings (e.g. a glob matching nothing) to ``err``.
    """
    import warnings
    from pathlib import Path

    from hp_core.mesh import MeshSpec, MeshSpecError

    try:
        mesh = MeshSpec.parse(args.mesh)
    except MeshSpecError as e:
        raise _Failed(2, f"--mesh: {e}") from None
    if args.overrides is not None and not Path(args.overrides).is_file():
        raise _Failed(2, f"--overrides: {args.overrides!r}: no such file.")
    model = _load_model(args.model)

    from hp_core.planner import plan

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = plan(
                model,
                mesh,
                overrides=args.overrides,
                sequence_parallel=args.sequence_parallel,
                loss_parallel=args.loss_parallel,
                ep_size=args.ep,
            )
        except ValueError as e:  # PlanError and friends: every planner error is a ValueError
            raise _Failed(1, f"{type(e).__name__}: {e}") from None
    for w in caught:
        if w.category.__module__.startswith("hp_core"):
            err.print(Text(f"warning: {w.message}"))
    return result, model


def _verify_plan(model: Any, plan: Any, mesh: Any, err: Console) -> Any:
    """``hp_core.verify(model, plan, mesh)`` on the meta-device model; returns the report.

    Raises :class:`_Failed` (exit 1) with the refusal's message; prints hp's own warnings.
    """
    import warnings

    from hp_core import verify
    from hp_core.errors import HpError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report = verify(model, plan, mesh)
        except (HpError, ValueError) as e:  # VerificationError, preflight, placement errors
            raise _Failed(1, f"{type(e).__name__}: {e}") from None
    for w in caught:
        if w.category.__module__.startswith("hp_core"):
            err.print(Text(f"warning: {w.message}"), soft_wrap=True)
    return report


def cmd_plan(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Plan ``--model`` for ``--mesh`` on the meta device; print ``explain()`` or the YAML plan.

    A plan naming an inner wrapper or compute factory that no installed plugin provides is
    refused with exit 2 and ``hp_core.apply``'s message (``--allow-missing-plugins``: a
    warning instead). With ``--verify``, verify it first (a refusal prints only the error and exits 1); the
    collectives per step then count the verified gradient reductions
    (``explain(report)``), and the verifier's summary follows the plan.
    """
    from hp_core.sharding_plan import dump_plan

    try:
        result, model = _plan_from_args(args, err)
        _check_plugin_items(result, args, err, "plan")
        report = _verify_plan(model, result, args.mesh, err) if args.verify else None
    except _Failed as e:
        err.print(Text(f"hp plan: error: {e.message}"), soft_wrap=True)
        return e.code
    if args.yaml:
        text = dump_plan(result).rstrip("\n")
        if report is not None:  # as YAML comments, so the output still loads as a plan
            text += "\n" + "\n".join(f"# {line}" for line in report.summary().split("\n"))
    else:
        text = result.explain(report)
        if report is not None:
            text = text.rstrip("\n") + "\n\n" + report.summary()
    out.print(Text(text.rstrip("\n")), soft_wrap=True)
    return 0


# ---------------------------------------------------------------------- hp freeze


def add_freeze_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp freeze --model ... --mesh ... -o ARTIFACT``: plan and write a signed artifact."""
    parser = subparsers.add_parser(
        "freeze",
        help="plan a model for a mesh and write the plan as a signed artifact",
        description=(
            "Plan the model on the meta device (as hp plan does) and write the frozen plan, the "
            "inputs that produced it (model digest, mesh, overrides, hp and plugin versions) and "
            "a sha256 signature over both to ARTIFACT: canonical JSON, written atomically. "
            "Freezing the same inputs twice gives identical bytes. See docs/artifacts.md."
        ),
    )
    _add_planning_args(parser)
    parser.add_argument("-o", "--output", required=True, metavar="ARTIFACT", help="the artifact file to write")
    parser.add_argument(ALLOW_MISSING_PLUGINS, action="store_true", help=_ALLOW_MISSING_HELP)
    parser.set_defaults(handler=cmd_freeze)


def cmd_freeze(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Plan, freeze, sign and write ``--output``; exit 1 for planning/freezing problems, 2 for usage
    and for a plan naming registry items no installed plugin provides (unless
    ``--allow-missing-plugins``)."""
    from pathlib import Path

    from hp_core.codegen import FreezeError, make_artifact, write_artifact

    target = Path(args.output)
    try:
        if target.is_dir() or not target.parent.is_dir():
            why = "is a directory" if target.is_dir() else "its folder does not exist"
            raise _Failed(2, f"-o/--output: {args.output!r}: {why}; name the artifact file to write.")
        result, model = _plan_from_args(args, err)
        _check_plugin_items(result, args, err, "freeze")
        try:
            artifact = make_artifact(result, model=model, overrides=args.overrides)
        except FreezeError as e:
            raise _Failed(1, f"FreezeError: {e}") from None
        try:
            write_artifact(artifact, target)
        except OSError as e:
            raise _Failed(1, f"cannot write {args.output!r}: {e}") from None
    except _Failed as e:
        err.print(Text(f"hp freeze: error: {e.message}"), soft_wrap=True)
        return e.code
    injected = len(artifact.meta["injections"])
    out.print(
        Text(
            f"hp freeze: wrote {args.output}: {len(result)} modules, {injected} with injections, "
            f"mesh {artifact.inputs['mesh']}, signature {artifact.signature}"
        ),
        soft_wrap=True,
    )
    return 0


# ----------------------------------------------------------------------- hp check


def add_check_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp check ARTIFACT [--model ...]``: verify an artifact, and that it fits a model."""
    parser = subparsers.add_parser(
        "check",
        help="verify an artifact (signature, format, schema, registry items) and that it fits a model",
        description=(
            "Verify ARTIFACT: its format version, its signature, that its meta rebuilds into a "
            "plan and that every injected registry item is installed. With --model, also check "
            "that it was frozen for that model, that every planned module exists in it and that "
            "the planner's lints pass (every trainable parameter covered by exactly one boundary, "
            "shapes divisible), then run the plan verifier (hp_core.verify) on meta copies of the "
            "model for the artifact's mesh. The artifact records only the model's digest, so "
            "without --model the model checks and the verifier are skipped. "
            "Exit 0: ok; 1: a problem or a refused plan; 2: usage."
        ),
    )
    parser.add_argument("artifact", metavar="ARTIFACT", help="an artifact written by hp freeze")
    parser.add_argument(
        "--model",
        metavar="NAME_OR_CONFIG",
        help=(
            "the model to check and verify against: a preset or a path to an HF config.json "
            "(or its folder)"
        ),
    )
    parser.add_argument(
        "--report",
        metavar="PATH",
        help=(
            "with --model: write the verifier's report (signed JSON) to PATH; a later run passes "
            "apply(..., verify=hp_core.VerifyReport.loads(text)) and skips the verifier"
        ),
    )
    parser.set_defaults(handler=cmd_check)


def cmd_check(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Verify the artifact, then (with ``--model``) that it applies to that model and that the
    verifier proves its plan for it."""
    from pathlib import Path

    from hp_core.codegen import ArtifactError, check_against_model, read_artifact, version_drift

    path = Path(args.artifact)
    try:
        if not path.is_file():
            raise _Failed(2, f"{args.artifact!r}: no such file.")
        if args.report and args.model is None:
            raise _Failed(2, "--report needs --model: the report is the verifier's, and hp verifies only against a model.")
        model = _load_model(args.model) if args.model is not None else None
        try:
            artifact = read_artifact(path)
        except ArtifactError as e:
            raise _Failed(1, f"{type(e).__name__}: {e}") from None
        except OSError as e:
            raise _Failed(1, f"cannot read {args.artifact!r}: {e}") from None
    except _Failed as e:
        err.print(Text(f"hp check: error: {e.message}"), soft_wrap=True)
        return e.code
    plan = artifact.plan()
    out.print(
        Text(
            f"hp check: {args.artifact}: signature ok ({artifact.signature}), format "
            f"{artifact.format_version}, {len(plan)} modules, mesh {artifact.inputs['mesh']}, "
            "injected registry items installed"
        ),
        soft_wrap=True,
    )
    for note in version_drift(artifact):
        err.print(
            Text(f"warning: {note} (the artifact still verifies; re-freeze if the plan should change)"),
            soft_wrap=True,
        )
    if model is None:
        out.print(Text("model: not checked (pass --model NAME_OR_CONFIG to check module names and coverage)"))
        out.print(
            Text(
                "verify: skipped (the artifact records only the model's digest, so hp cannot "
                "build the model; pass --model NAME_OR_CONFIG to verify the plan)"
            ),
            soft_wrap=True,
        )
        return 0
    problems = check_against_model(artifact, model)
    for problem in problems:
        err.print(Text(f"hp check: problem: {problem}"), soft_wrap=True)
    if problems:
        out.print(Text("verify: skipped (the model checks failed)"))
        return 1
    out.print(
        Text(
            f"model {args.model}: frozen for this model, every planned module exists, lints pass "
            "(every trainable parameter covered)"
        ),
        soft_wrap=True,
    )
    try:
        report = _verify_plan(model, artifact.plan(model=model), artifact.inputs["mesh"], err)
    except _Failed as e:
        err.print(Text(f"hp check: problem: {e.message}"), soft_wrap=True)
        return e.code
    out.print(Text(report.summary()), soft_wrap=True)
    if args.report:
        try:
            Path(args.report).write_text(report.dumps())
        except OSError as e:
            err.print(Text(f"hp check: error: cannot write the report to {args.report!r}: {e}"), soft_wrap=True)
            return 2
        out.print(Text(f"report written to {args.report}"), soft_wrap=True)
    return 0


# ----------------------------------------------------------------------- hp demo


def add_demo_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp demo``: train a tiny HF model on CPU ranks with tp x cp x ep; compare every loss."""
    from hp_core.demo import MODELS

    parser = subparsers.add_parser(
        "demo",
        help="train a tiny HF model on CPU ranks with tp/cp/ep and check every loss against one process",
        description=(
            "Spawn CPU ranks (gloo), build a tiny real Hugging Face model, plan it for tp x cp x ep "
            "(the default uses every installed plugin: a cp axis with hp-plugin-cp, expert "
            "parallelism with hp-plugin-moe), apply it in production mode, train AdamW steps on a "
            "synthetic next-token task and compare each loss with a single-process copy. "
            "Exit 0 only if every step matches within rtol=atol=1e-5."
        ),
    )
    parser.add_argument("--model", default="qwen2moe", choices=MODELS, help="tiny model preset (default qwen2moe)")
    parser.add_argument("--world", type=_positive_int, default=None, help="number of ranks (default 4; 2 without hp-plugin-cp)")
    parser.add_argument("--mesh", default=None, help="tp and cp sizes, e.g. tp=2,cp=2 (default: from --world and the plugins)")
    parser.add_argument("--ep", type=_positive_int, default=None, help="expert-parallel size (default 2 for MoE models with hp-plugin-moe)")
    parser.add_argument("--steps", type=_positive_int, default=20, help="training steps (default 20)")
    parser.add_argument("--batch", type=_positive_int, default=2, help="sequences per step (default 2)")
    parser.add_argument("--seq", type=_positive_int, default=16, help="tokens per sequence (default 16)")
    parser.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Choose the setup, print the plan summary, train on spawned ranks, print the table and verdict."""
    from hp_core import demo
    from hp_core.presets import build_model

    try:
        setup = demo.default_setup(
            args.model, world=args.world, mesh=args.mesh, ep=args.ep,
            steps=args.steps, batch=args.batch, seq=args.seq,
        )
    except demo.DemoError as e:
        err.print(Text(f"hp demo: error: {e}"), soft_wrap=True)
        return 2
    for note in setup.notes:
        out.print(Text(f"note: {note}"), soft_wrap=True)
    try:
        plan = demo.plan_for(setup, build_model(args.model, device="meta"), setup.mesh_text)
    except ValueError as e:  # every planner error is a ValueError
        err.print(Text(f"hp demo: error: cannot plan {args.model} for {setup.mesh_text}: {e}"), soft_wrap=True)
        return 1
    out.print(
        Text(f"hp demo: {args.model} on {setup.world} CPU ranks, mesh {setup.mesh_text}, ep={setup.ep}, "
             f"{setup.steps} steps of batch {setup.batch} x seq {setup.seq}, production mode"),
        soft_wrap=True,
    )
    for line in demo.plan_summary(plan):
        out.print(Text(line), soft_wrap=True)
    try:
        reports = demo.run_demo(setup)
    except demo.DemoError as e:
        err.print(Text(f"hp demo: error: {e}"), soft_wrap=True)
        return 1
    total = sum(p.numel() for p in build_model(args.model, device="meta").parameters())
    per_rank = ", ".join(str(r["params"]) for r in reports)
    out.print(Text(f"params per rank: {per_rank} (unsharded model: {total})"), soft_wrap=True)
    out.print(Text(f"training adapters: {', '.join(reports[0]['adapters']) or 'none'}"), soft_wrap=True)
    for line in demo.measured_lines(reports[0]["measured"]):
        out.print(Text(line), soft_wrap=True)
    rows = [demo.StepRow(i, a, b) for i, (a, b) in enumerate(reports[0]["losses"])]
    table = Table(title="loss per step: sharded vs single device", title_justify="left")
    for column in ("step", "sharded", "single", "|diff|", "ok"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r.step), f"{r.sharded:.6f}", f"{r.single:.6f}", f"{r.diff:.2e}",
                      Text("ok" if r.ok() else "MISMATCH", style="" if r.ok() else "red"))
    out.print(table)
    code = demo.verdict(rows)
    if code == 0:
        out.print(Text(f"every step matches the single-device run (rtol={demo.RTOL}, atol={demo.ATOL})"))
    else:
        bad = [r.step for r in rows if not r.ok()]
        err.print(Text(f"MISMATCH at step(s) {bad}: the sharded loss differs from the single-device loss", style="red"))
    return code


# ---------------------------------------------------------------------- wiring

#: Subcommands in help order; add ``add_<name>_command`` functions here.
COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    add_plugins_command,
    add_plan_command,
    add_freeze_command,
    add_check_command,
    add_demo_command,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``hp`` argument parser with every subcommand in :data:`COMMANDS`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        hp_version = version("hp-core")
    except PackageNotFoundError:  # running from a source tree without installing
        hp_version = "unknown"
    parser = argparse.ArgumentParser(
        prog="hp",
        description="Parallelize PyTorch models over a DeviceMesh from declared sharding contracts.",
    )
    parser.add_argument("--version", action="version", version=f"hp {hp_version}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hp`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return handler(args, _console(sys.stdout), _console(sys.stderr))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
