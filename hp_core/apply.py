"""``apply(model, plan, mesh, mode=...)``: check everything on every rank, then install.

Order: preflight's local checks and the verifier (meta-device copies, no collective) on
every rank → one exchange of verdicts and fingerprints (a failure anywhere is an error
everywhere) → the install, journaled → a final exchange of verdicts: if any rank failed,
every rank rolls back and raises. The exchanges go through the store, with a timeout
(``hp_core.runtime.verdict``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as importlib_metadata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from hp_core.context import ParallelContext
from hp_core.errors import HpError
from hp_core.plans.model import ShardingPlan
from hp_core.plugins import plugin_report
from hp_core.runtime.errors import PreflightError
from hp_core.runtime.install import install
from hp_core.runtime.journal import Journal
from hp_core.runtime.preflight import PreflightResult, preflight
from hp_core.runtime.sequence import SequenceFallback
from hp_core.runtime.verdict import (
    ApplyFailedError,
    Verdict,
    VerdictExchange,
    failures,
    resolve_timeout,
)
from hp_core.verifier.advice import verify as run_verifier
from hp_core.verifier.meta import meta_clone
from hp_core.verifier.repeats import find_repeats
from hp_core.verifier.report import VerifyReport
from hp_core.verifier.runner import prove

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["VerificationRequiredError", "apply"]

#: What ``apply(verify=...)`` accepts: True, or a report of this plan (False is refused).
VerifyArg = bool | VerifyReport


class VerificationRequiredError(PreflightError, HpError):
    """``apply(verify=False)`` without a report: hp cannot know which gradients to sum."""


def _report(pre: PreflightResult) -> VerifyReport:
    """The report the checks of preflight produced (refuse() raises instead of returning)."""
    if pre.report is None:  # refuse() raises before this; a None here is hp's own bug
        raise RuntimeError("apply: preflight finished without a verifier report (a bug in hp).")
    return pre.report


def _verifier(
    model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh, verify: VerifyArg
) -> Callable[[PreflightResult], VerifyReport | None]:
    if verify is True:
        return lambda pre: run_verifier(model, plan, mesh, preflight=pre)
    if isinstance(verify, VerifyReport):

        def check(_pre: PreflightResult) -> VerifyReport:
            if verify.fingerprint != plan.fingerprint():
                raise PreflightError(
                    "apply(verify=report): the report was made for another plan (fingerprints "
                    "differ); verify this "
                    "plan, or pass verify=True."
                )
            return verify

        return check
    if verify is False:

        def refuse(_pre: PreflightResult) -> NoReturn:
            raise VerificationRequiredError(
                "apply(verify=False): the verifier is what derives which gradients are partial "
                "sums, so hp "
                "cannot skip it without its result. Verify once and pass the report: "
                "report = hp_core.verify(model, plan, mesh); apply(model, plan, mesh, "
                "verify=report)."
            )

        return refuse

    def wrong(_pre: PreflightResult) -> None:
        raise PreflightError(f"apply(verify={verify!r}): expected True, or a hp_core.VerifyReport.")

    return wrong


def apply(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    *,
    mode: str = "production",
    verify: VerifyArg = True,
    check_inputs: bool = True,
    timeout: float | None = None,
) -> nn.Module:
    """Parallelize ``model`` in place by ``plan`` on ``mesh``; returns the model.

    ``mode="production"``: parameters become local shards for good and single-axis
    transitions run as explicit collectives. ``mode="validate"``: parameters stay
    DTensors and every boundary checks that DTensor propagation produces the declared
    layouts. Both give the same outputs and gradients.

    ``verify=True`` (default) proves the plan on meta-device copies first (see
    :func:`hp_core.verify`); pass a ``VerifyReport`` from an earlier
    ``hp_core.verify(model, plan, mesh)`` of this plan to skip the work.

    ``check_inputs=True`` (default) compares every forward's input shapes across the ranks
    of each tp/cp group before the first collective (one small all-reduce per axis), so a
    batch that differs between them is an error on every rank rather than an abort.

    All or nothing, on every rank: the ranks agree on the plan, the mode, these flags and
    the installed plugins before any collective, and on the outcome after the last
    mutation; if any rank failed, every rank restores its model exactly (parameter objects
    and values, buffers, forwards, hooks, attributes) and raises. ``timeout`` (seconds,
    default ``$HP_APPLY_TIMEOUT`` or 30) bounds each wait for the other ranks: a rank that
    died or never calls ``apply`` is an error, not a hang.
    """
    exchange = VerdictExchange(resolve_timeout(timeout))
    extra = _settings(check_inputs, verify)
    verifier = _verifier(model, plan, mesh, verify)
    fallback: list[SequenceFallback | None] = []

    def checks(pre: PreflightResult) -> Any:  # inside preflight: a refusal here reaches every rank
        if not isinstance(check_inputs, bool):
            raise PreflightError(f"apply(check_inputs={check_inputs!r}): expected True or False.")
        report = verifier(pre)
        # local work: before the exchange
        fallback.append(_sequence_fallback(model, plan, mesh, pre.context))
        return report

    pre = preflight(model, plan, mesh, mode, verify=checks, exchange=exchange, extra=extra)
    journal = Journal()
    error: BaseException | None = None
    try:
        state = install(
            model,
            plan,
            mesh,
            mode,
            pre,
            journal,
            reductions=_report(pre).reductions,
            check_inputs=check_inputs,
            fallback=fallback[0],
        )
        state.report = pre.report
    except BaseException as e:  # even an interrupt: the other ranks must hear of it
        error = e
    try:
        verdicts = exchange.exchange("commit", Verdict.of(error, journal.where))
    except BaseException:
        journal.rollback()
        raise
    failed = failures(verdicts)
    if not failed:
        return model
    journal.rollback()
    if isinstance(error, KeyboardInterrupt):
        raise error
    rank, first = next(iter(failed.items()))
    raise ApplyFailedError(
        f"apply() failed on rank {rank} in phase {first.where!r} ({first.error})"
        + (f"; also on rank(s) {sorted(failed)[1:]}" if len(failed) > 1 else "")
        + ". Every rank restored its model as it was (parameters, values, hooks, forwards); fix "
        "the cause "
        "and call apply() again."
    ) from error


def _settings(check_inputs: bool, verify: VerifyArg) -> dict[str, str]:
    """apply()'s other behaviour-changing inputs, as fingerprint entries the ranks compare."""
    plugins = ",".join(
        f"{p.name}={p.distribution or '-'}@{p.version or '-'}:{p.status}"
        for p in sorted(plugin_report(), key=lambda p: p.name)
    )
    return {
        "check_inputs": str(bool(check_inputs)),
        "verify": "report" if isinstance(verify, VerifyReport) else repr(verify),
        "plugins": hashlib.sha256(plugins.encode()).hexdigest()[:16] + f" ({plugins})",
        "versions": f"hp {_version('hp-core')}, torch {torch.__version__}",
    }


def _version(dist_name: str) -> str:
    try:
        return importlib_metadata.version(dist_name)
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def _sequence_fallback(
    model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh, ctx: ParallelContext | None
) -> SequenceFallback | None:
    """Under sequence parallelism: the whole-sequence variant for inference, verified when first
    needed on a weightless copy of the model taken now (before the parameters are sharded)."""
    if ctx is None or not ctx.sequence_parallel:
        return None
    copy = meta_clone(model, find_repeats(model, plan.modules))
    return SequenceFallback(plan, lambda variant: prove(copy, variant, mesh))
