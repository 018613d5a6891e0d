"""``plan()`` and ``verify()`` as users call them: a refusal prints only a fix hp has checked.

A refusal found while planning or verifying carries the fixes it would suggest
(:mod:`hp_core.plans.proposal`). Before the error reaches the user, each is tried the way
the user would try it: the model is planned again with the fix added to the overrides and
flags the user gave, and the new plan is verified (on meta tensors; no collective). The
message then ends with the first fix that held, or says that none did and why. A fix that
leads to a second refusal is tried together with that refusal's own fix (a few rounds at
most), so what is printed is the whole set that verifies. With sequence parallel on, turning
it off is the last fix tried.

Checking costs a plan and a verification per fix tried, only on the way to an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from hp_core.errors import HpError
from hp_core.mesh import is_device_mesh
from hp_core.planner.plan import plan as plan_model
from hp_core.plans.model import ShardingPlan
from hp_core.plans.overrides import OverridesLike, load_overrides
from hp_core.plans.planning_call import PlanningCall
from hp_core.plans.proposal import Proposal, proposals_of
from hp_core.runtime.preflight import PreflightResult
from hp_core.verifier.errors import UnverifiableError, VerificationError
from hp_core.verifier.probes import NOT_RUN
from hp_core.verifier.report import VerifyReport
from hp_core.verifier.runner import prove

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hp_core.mesh import MeshLike

__all__ = ["plan", "verify"]

#: At most this many fixes are planned and verified for one refusal.
MAX_TRIES = 8
#: What heads the fix a message prints (tests find it by this line).
VERIFIED = "Verified fix (hp planned the model with it and verified the plan):"
#: What begins the part of a message that says no fix held.
NO_FIX = "hp found no override it could verify for this"
#: The fix that turns sequence parallel off (a line of its own: not part of the YAML above it).
SP_OFF = "plan with sequence_parallel=False (activations between blocks then stay whole)"
#: A fix may lead to this many further refusals whose fixes are added to it.
MAX_ROUNDS = 3


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:240] if text else ''}"


def _finish(error: HpError, addition: str) -> None:
    """Append ``addition`` to ``error``'s message (also where the class rebuilds it)."""
    if isinstance(getattr(error, "fix", None), str):
        error.fix = addition  # type: ignore[attr-defined]  # what its __reduce__ carries
    error.args = (f"{error.args[0] if error.args else ''}{addition}", *error.args[1:])
    error.proposals = ()  # type: ignore[attr-defined]  # settled: not checked twice


def _settle(
    error: HpError,
    attempt: Callable[[Proposal], None] | str,
    sequence_parallel: bool,
    example_given: bool,
) -> None:
    """End ``error``'s message with the first proposal ``attempt`` accepts, or with why none
    (``attempt`` a string: why hp cannot check a fix here)."""
    if isinstance(attempt, str):
        _finish(error, f"\n{attempt}")
        return
    queue: list[tuple[Proposal, int]] = [(p, 1) for p in proposals_of(error)]
    flags = {"sequence_parallel": False}
    also = Proposal(f"and {SP_OFF}", "without sequence parallel", flags=flags)
    if sequence_parallel:  # each fix again without sequence parallel, then that alone
        off = Proposal(SP_OFF, "planning with sequence_parallel=False", flags=flags)
        queue = [q for p, r in queue for q in ((p, r), (p.plus(also), r))[: 1 + p.fits(also)]]
        queue.append((off, 0))  # a flag, not a refusal: the rounds it leads to are counted
    failed: list[str] = []
    seen: set[str] = set()
    tries = 0
    while tries < MAX_TRIES:
        while queue and queue[0][0].text in seen:
            queue.pop(0)
        if not queue:
            break
        fix, rounds = queue.pop(0)
        seen.add(fix.text)
        loose = [e.match for e in fix.overrides if e.spec.is_boundary is False]
        if sequence_parallel and fix.flags.get("sequence_parallel") is not False and loose:
            # Parameters kept whole outside every boundary meet activations hp does not lay
            # out; under sequence parallelism those may be sequence shards, and code that mixes
            # along the sequence (a causal conv) would compute per shard in both modes, which
            # no meta-device check can see. So such a fix is only ever tried without it.
            failed.append(f"{fix.what} (under sequence parallelism hp cannot prove {loose[0]!r})")
            if fix.fits(also):
                queue.insert(0, (fix.plus(also), MAX_ROUNDS))
            continue
        tries += 1  # only a fix planned and verified counts against MAX_TRIES
        try:
            attempt(fix)
        except HpError as e:
            more = proposals_of(e)
            if more and rounds < MAX_ROUNDS:  # the fix's own refusal, and its fix, first
                queue[:0] = [(fix.plus(m), rounds + 1) for m in more if fix.fits(m)]
            else:
                failed.append(f"{fix.what} ({_first_line(e)})")
                if sequence_parallel and fix.flags.get("sequence_parallel") is None:
                    queue.insert(0, (fix.plus(also), rounds))  # the same, SP off, next
            continue
        except Exception as e:  # the fix makes the model's own code fail: not a fix
            failed.append(f"{fix.what} ({_first_line(e)})")
            continue
        _finish(error, f"\n{VERIFIED}\n{fix.text}")
        return
    tried = "".join(f"\n  - {f}" for f in failed) or "\n  - (none: hp has no fix to propose)"
    call = "" if example_given else ", or give plan() the training call (example_inputs=...)"
    _finish(
        error,
        f"\n{NO_FIX}; it tried:" + tried + "\nFix: "
        "override the named module's contract by hand (docs/plans.md), then verify it with "
        f"hp_core.verify(model, plan){call}.",
    )


def _checker(
    model: nn.Module,
    mesh: DeviceMesh | MeshLike | None,
    call: PlanningCall,
    example: Any,
    inputs: Any,
) -> Callable[[Proposal], None] | str:
    """What tries a fix: plan ``model`` as ``call`` did with the fix added, and verify that
    (or why hp cannot do that here)."""
    if mesh is None:
        return (
            "hp checks a fix before it prints one, and does not know this plan's mesh sizes. "
            "Fix: pass the mesh to verify(model, plan, mesh)."
        )
    if not is_device_mesh(mesh) and dist.is_available() and dist.is_initialized():
        return (
            "hp checks a fix before it prints one, but a process group is initialized and the "
            "mesh is a description, not a DeviceMesh, so hp cannot verify on it. Fix: pass the "
            "DeviceMesh the model will run on to plan() / verify()."
        )

    def attempt(fix: Proposal) -> None:
        p = plan_model(
            model,
            mesh,
            overrides=[*call.overrides, *fix.overrides],
            example_inputs=example,
            check_items=False,
            **{**call.flags, **fix.flags},
        )
        unrun = [
            f for f, why in prove(model, p, mesh, inputs=inputs).opaque.items() if NOT_RUN in why
        ]
        if unrun:  # a pass-through is not a proof: what the fix changes may never have run
            raise UnverifiableError(
                f"{unrun[0]}: {NOT_RUN}, so hp cannot verify a fix for this model "
                f"({len(unrun)} region(s) not run)"
            )

    return attempt


def plan(
    model: nn.Module,
    mesh: DeviceMesh | MeshLike,
    *,
    overrides: OverridesLike | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    ep_size: int = 1,
    check_items: bool = True,
    example_inputs: Any = None,
) -> ShardingPlan:
    """Derive every boundary's contract for ``model`` on ``mesh`` and merge ``overrides``.

    The arguments are :func:`hp_core.planner.plan.plan`'s. A refusal ends with a fix hp
    planned and verified (or says that it found none); the plan remembers this call
    (``planned_with``), so a refusal ``verify()`` finds later is checked the same way.
    """
    flags: dict[str, Any] = {
        "sequence_parallel": sequence_parallel,
        "loss_parallel": loss_parallel,
        "ep_size": ep_size,
    }
    try:
        result = plan_model(
            model,
            mesh,
            overrides=overrides,
            check_items=check_items,
            example_inputs=example_inputs,
            **flags,
        )
    except HpError as e:
        if proposals_of(e):
            call = PlanningCall(tuple(load_overrides(overrides)), flags)
            _settle(
                e,
                _checker(model, mesh, call, example_inputs, None),
                sequence_parallel is True,
                example_inputs is not None,
            )
        raise
    result.planned_with = PlanningCall(
        tuple(load_overrides(overrides)),
        flags,
        mesh=None if is_device_mesh(mesh) else mesh,
        fingerprint=result.fingerprint(),
    )
    return result


def verify(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh | MeshLike | None = None,
    *,
    inputs: Any = None,
    exhaustive: bool = False,
    preflight: PreflightResult | None = None,
) -> VerifyReport:
    """Prove ``plan`` right for ``model`` on meta-device copies; raise what cannot be proven.

    The arguments are :func:`hp_core.verifier.runner.prove`'s. A refusal ends with a fix hp
    planned and verified, where the plan is one ``hp_core.plan()`` made (it records its call);
    a plan written, loaded or edited by hand cannot be planned again, and the message says so.
    """
    try:
        return prove(model, plan, mesh, inputs=inputs, exhaustive=exhaustive, preflight=preflight)
    except HpError as e:
        if not proposals_of(e) and not _layout_refusal(e, plan):
            raise
        call = plan.planned_with
        if call is None or call.fingerprint != plan.fingerprint():
            _finish(
                e,
                "\nhp prints only fixes it has checked, and this plan is not one hp_core.plan() "
                "made (or it was edited since), so hp cannot plan the model again to check a "
                "fix. Fix: plan the model with hp_core.plan(model, mesh, overrides=...) and "
                "verify that plan.",
            )
            raise
        on = mesh if mesh is not None else (call.mesh or _described(plan))
        _settle(
            e,
            _checker(model, on, call, plan.example, inputs),
            plan.sequence_parallel,
            plan.example is not None or inputs is not None,
        )
        raise


def _layout_refusal(error: HpError, plan: ShardingPlan) -> bool:
    """A finding about the plan's layouts that proposes no fix of its own, under sequence
    parallelism — the one fix left to check is turning it off."""
    # A model whose own code fails on meta under SP (UnverifiableError) included: that code
    # may be what meets a sequence shard, and a fix is printed only once it verifies.
    return isinstance(error, VerificationError) and plan.sequence_parallel


def _described(plan: ShardingPlan) -> str | None:
    """``"tp=2,cp=1"`` for a plan that knows its mesh sizes, else None."""
    if plan.mesh_shape is None:
        return None
    sizes = zip(plan.mesh_axis_names, plan.mesh_shape, strict=True)
    return ",".join(f"{n}={s}" for n, s in sizes)
