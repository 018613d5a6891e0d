"""``hp check ARTIFACT [--model ...]``: verify an artifact, and that it fits a model."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.text import Text

# The package, looked up at call time: tests replace its functions there.
import hp_core.artifact as artifacts
from hp_core.cli.failure import CommandFailed, command, failing, typed_message
from hp_core.cli.model_args import load_model
from hp_core.cli.planning import verify_plan

__all__ = ["add_check_command", "cmd_check"]


def add_check_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hp check ARTIFACT [--model ...]``: verify an artifact, and that it fits a model."""
    parser = subparsers.add_parser(
        "check",
        help=(
            "verify an artifact (signature, format, schema, registry items) and that it fits a "
            "model"
        ),
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


@command("check")
def cmd_check(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Verify the artifact, then (with ``--model``) that it applies to that model and that the
    verifier proves its plan for it."""
    path = Path(args.artifact)
    if not path.is_file():
        raise CommandFailed(2, f"{args.artifact!r}: no such file.")
    if args.report and args.model is None:
        raise CommandFailed(
            2,
            "--report needs --model: the report is the verifier's, and hp verifies only against "
            "a model.",
        )
    model = load_model(args.model) if args.model is not None else None
    cannot_read = f"cannot read {args.artifact!r}"
    # The inner block is checked first: an ArtifactError is reported as one even if it were
    # also an OSError.
    with failing(1, OSError, message=lambda e: f"{cannot_read}: {e}"):
        with failing(1, artifacts.ArtifactError, message=typed_message):
            artifact = artifacts.read_artifact(path)
    plan = artifact.plan()
    out.print(
        Text(
            f"hp check: {args.artifact}: signature ok ({artifact.signature}), format "
            f"{artifact.format_version}, {len(plan)} modules, mesh {artifact.inputs['mesh']}, "
            "injected registry items installed"
        ),
        soft_wrap=True,
    )
    for note in artifacts.version_drift(artifact):
        err.print(
            Text(
                f"warning: {note} (the artifact still verifies; re-freeze if the plan should "
                "change)"
            ),
            soft_wrap=True,
        )
    if model is None:
        out.print(
            Text(
                "model: not checked (pass --model NAME_OR_CONFIG to check module names and "
                "coverage)"
            )
        )
        out.print(
            Text(
                "verify: skipped (the artifact records only the model's digest, so hp cannot "
                "build the model; pass --model NAME_OR_CONFIG to verify the plan)"
            ),
            soft_wrap=True,
        )
        return 0
    problems = artifacts.check_against_model(artifact, model)
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
        report = verify_plan(model, artifact.plan(model=model), artifact.inputs["mesh"], err)
    except CommandFailed as e:  # the verifier refusing the plan is a problem the check found
        raise CommandFailed(e.code, e.message, label="problem") from None
    out.print(Text(report.summary()), soft_wrap=True)
    if args.report:
        with failing(
            2, OSError, message=lambda e: f"cannot write the report to {args.report!r}: {e}"
        ):
            Path(args.report).write_text(report.dumps())
        out.print(Text(f"report written to {args.report}"), soft_wrap=True)
    return 0
