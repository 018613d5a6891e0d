"""``verify(model, plan, mesh)``: prove a plan on meta-device copies before anything runs.

Two copies of the model, with meta tensors for weights, run one forward (and backward):

1. **validate copy** — the plan installed in validate mode: parameters are DTensors and
   every dispatching region runs the module's own forward on DTensors. The region may not
   redistribute anything on its own (that is communication the contract does not declare,
   or a parameter that does not fit its activation), its outputs must have the declared
   ``out_src``, random ops may not touch partial sums, and its backward — run per region,
   in isolation — may not redistribute either. That backward also says, per parameter and
   axis, whether this rank's gradient is whole or partial.
2. **production copy** — the plan installed in production mode: local shards and hp's
   own collectives (shape-only on meta). Production's code must run, and every boundary
   must produce the same local shapes as in validate mode.

Where DTensor cannot look (code that runs on local tensors: ``region_dispatch=False``,
injected compute, a deferred bias) the gradient rule is the contract's
(``hp_core.runtime.partial``). Injected compute is replaced by the module's own forward
(an injection promises the same math); compute that cannot run on meta (data-dependent
routing) is reported as not looked into.

No collective runs: on a real mesh, DTensor and hp's collectives only compute shapes for
meta tensors; without one, a fake process group of the plan's size is used, so a plan for
1,024 ranks is verified on a laptop. Repeated layers are checked once.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hp_core.errors import HpError
from hp_core.mesh import mesh_axes
from hp_core.plans.model import ShardingPlan
from hp_core.runtime.preflight import PreflightResult, check_locally
from hp_core.verifier.attribution import failure_site
from hp_core.verifier.consistency import (
    arrival_check,
    check_escaped_outputs,
    check_input_gradients,
    check_layouts,
    check_modes_agree,
    check_undeclared_inputs,
)
from hp_core.verifier.errors import UnverifiableError
from hp_core.verifier.gradients import derive
from hp_core.verifier.inputs import (
    default_inputs,
    example_inputs,
    to_meta_inputs,
    verification_mesh,
    whole_inputs,
)
from hp_core.verifier.meta import MetaValues
from hp_core.verifier.passes import plain_pass, production_pass, validate_pass, verifier_pre
from hp_core.verifier.passes import reduced_plan as _reduced
from hp_core.verifier.probes import BoundaryRecord
from hp_core.verifier.repeats import find_repeats
from hp_core.verifier.report import VerifyReport

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hp_core.mesh import MeshLike

__all__ = ["VerifyReport", "prove"]


def _unattributed(model: nn.Module, error: Exception) -> str:
    """The message of a meta run that failed in code no probe of hp's was running."""
    site = failure_site(error)
    at = ""
    if site is not None:
        name, where = site
        at = f" in {name!r} ({where})" if name else f" in {where}"
    first = str(error).splitlines()[0] if str(error) else ""
    return (
        f"verify(): running {type(model).__name__} on meta tensors failed{at}, outside what hp "
        f"can attribute: {type(error).__name__}: {first}. "
        "Fix: if the model runs on one device, that code gets an activation in a layout it does "
        "not expect (with sequence parallel, activations between blocks are sequence-sharded): "
        "plan with sequence_parallel=False, or override the boundary that feeds it to hand over "
        "a whole (replicated) output."
    )


def prove(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh | MeshLike | None = None,
    *,
    inputs: Any = None,
    exhaustive: bool = False,
    preflight: PreflightResult | None = None,
) -> VerifyReport:
    """Prove ``plan`` right for ``model`` on meta-device copies; raise what cannot be proven.

    ``mesh``: the DeviceMesh the plan will run on (nothing is communicated), or a mesh
    description (``"tp=8"``) or None to verify on a fake process group of the plan's size.
    ``inputs``: one rank's model inputs (tensors are only read for shapes and dtypes);
    default: the training call the plan records (``plan(example_inputs=...)``, this rank's
    share of it), else token ids for a causal LM. ``exhaustive`` checks repeated layers too. The
    model is not touched. Raises a :class:`~hp_core.VerificationError` (or the
    preflight error) naming the module, the parameter and the fix.

    This is the proof alone; :func:`hp_core.verify` (:mod:`hp_core.verifier.advice`) also
    checks the fix a refusal proposes before printing it.
    """
    t0 = time.perf_counter()
    with verification_mesh(plan, mesh) as dmesh:
        pre = preflight if preflight is not None else check_locally(model, plan, dmesh, "validate")
        vpre = verifier_pre(pre, plan)
        repeats = {} if exhaustive else find_repeats(model, plan.modules)
        if inputs is not None:
            args, kwargs = to_meta_inputs(inputs)
        else:
            args, kwargs = example_inputs(plan, dmesh) or default_inputs(model, dmesh)
        names = list(mesh_axes(dmesh))
        try:
            with MetaValues(), torch.enable_grad():
                plain: dict[str, BoundaryRecord] | None
                try:
                    plain = plain_pass(
                        model, plan, repeats, *whole_inputs(args, kwargs, plan, dmesh)
                    )
                except (
                    Exception
                ):  # the unsharded model's own code does not run on meta: no layout check
                    plain = None
                sizes = dict(zip(names, (int(n) for n in dmesh.shape), strict=True))
                arrival = (
                    arrival_check(plain, _reduced(plan, repeats), sizes)
                    if plain is not None
                    else None
                )
                val, reduced = validate_pass(
                    model, plan, dmesh, vpre, repeats, args, kwargs, arrival, plain
                )
                prod = production_pass(model, plan, dmesh, vpre, repeats, args, kwargs, val, plain)
        except HpError:
            # A finding (VerificationError, AmbiguousGradientError, PlacementMismatchError, ...).
            raise
        except Exception as e:
            raise UnverifiableError(_unattributed(model, e)) from e
        check_modes_agree(val, prod)
        if plain is not None:
            check_layouts(plain, prod, reduced, sizes)
        check_input_gradients(val, reduced, names)
        check_undeclared_inputs(val, reduced, names)
        check_escaped_outputs(prod, reduced, sizes)
        reductions, opaque = derive(model, plan, names, val, repeats)
    return VerifyReport(
        fingerprint=plan.fingerprint(),
        mesh=tuple(zip(names, (int(s) for s in dmesh.shape), strict=True)),
        reductions=reductions,
        checked=tuple(f for f, r in val.items() if r.dispatching),
        opaque=opaque,
        repeated=dict(repeats),
        seconds=time.perf_counter() - t0,
    )
