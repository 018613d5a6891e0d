"""The rank side of the equivalence check: plan once, apply each mode, train next to one device.

Every rank builds the model from the factory, keeps a single-device reference copy, plans
and verifies once, applies each mode to its own deep copy, and trains ``steps`` AdamW steps
on all of them side by side. Per step it compares loss, logits (gathered by the plan's
declared output layout when they come out sharded) and every gradient (gathered by the
independent :func:`~hp_core.testing.gather.gather_full_grads`, fused parts put back by
:func:`~hp_core.testing.fused.restore_fused`); after the last step every parameter,
gathered the same way; and that every parameter with a gradient moved.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from hp_core import HpError, MeshSpec, ShardingPlan, apply, plan, verify
from hp_core.checkpoint.names import stacked_names
from hp_core.spec.module_spec import layout_map
from hp_core.testing.compare import (
    GradientCheckError,
    allclose_excess,
    full_tensor,
    gather_full_grads,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.equivalence_report import (
    EquivalenceArgumentError,
    EquivalenceBatchError,
    EquivalenceError,
    EquivalenceFactoryError,
    EquivalenceMeshError,
    EquivalenceOutputError,
    EquivalenceReport,
    EquivalenceRunError,
)
from hp_core.testing.fused import restore_fused

__all__ = ["MODES", "equivalence_on_rank", "mesh_spec", "resolve_factory"]

#: The modes a check can run; ``production-validate`` compares the two with each other.
MODES = ("production", "validate")

Factory = Callable[..., Any] | str


def resolve_factory(factory: Factory, what: str) -> Callable[..., Any]:
    """``factory`` itself, or the callable a ``"pkg.mod:fn"`` string names."""
    if callable(factory):
        return factory
    if not isinstance(factory, str) or factory.count(":") != 1:
        raise EquivalenceFactoryError(
            f"{what} {factory!r}: expected a callable or a 'pkg.module:function' string. "
            "Fix: pass a module-level function (so the ranks can unpickle it) or its import path."
        )
    module_name, _, attr = factory.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise EquivalenceFactoryError(
            f"{what} {factory!r} does not import: {type(e).__name__}: {e}. "
            f"Fix: check the spelling, and that {module_name!r} is importable on every rank "
            "(on sys.path of the test process, which the ranks copy)."
        ) from None
    if not callable(obj):
        raise EquivalenceFactoryError(
            f"{what} {factory!r} is a {type(obj).__name__}, not a callable. "
            "Fix: name a function that builds the model (or the batch of a step)."
        )
    return obj


def mesh_spec(mesh: MeshSpec | Mapping[str, int] | str, world_size: int | None) -> MeshSpec:
    """The mesh as a ``MeshSpec``, checked against the world's size when one is given."""
    spec = MeshSpec.from_any(mesh)
    if world_size is not None and spec.world_size != world_size:
        raise EquivalenceMeshError(
            f"mesh {str(spec)!r} has {spec.world_size} ranks but the world has {world_size}. "
            f"Fix: run on a world of {spec.world_size} ranks (get_world({spec.world_size})), "
            "or give a mesh whose sizes multiply to the world's size."
        )
    return spec


def check_run_args(steps: object, modes: Sequence[str]) -> tuple[str, ...]:
    """``modes`` as a tuple, refusing an unknown mode or ``steps`` below 1."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise EquivalenceArgumentError(
            f"steps={steps!r}: the check trains at least one optimizer step. "
            "Fix: pass steps=1 or more (the default 2 also checks a step on moved weights)."
        )
    out = tuple(modes)
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise EquivalenceArgumentError(
            f"modes={list(modes)!r}: unknown or none ({bad}). "
            f"Fix: pass a non-empty subset of {list(MODES)}."
        )
    return out


def _placement_text(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return repr(p)


def _layout_text(named: Mapping[str, Placement]) -> str:
    return ", ".join(f"{axis}: {_placement_text(p)}" for axis, p in named.items()) or "whole"


def param_layouts(p: ShardingPlan) -> dict[str, str]:
    """``parameter FQN -> "tp: Shard(0)"`` as the plan declares each one (its spec layouts)."""
    out: dict[str, str] = {}
    for fqn, spec in p.items():
        for rel, named in layout_map(spec.params).items():
            name = f"{fqn}.{rel}" if fqn else rel
            fused = spec._fused_layouts.get(rel)
            extra = f", fused {fused['names']}" if fused and len(fused["parts"]) > 1 else ""
            out[name] = _layout_text(named) + extra
    return out


def output_layout(p: ShardingPlan) -> dict[str, Placement]:
    """The layout the plan declares for the logits: the terminal boundary's ``output``."""
    for _fqn, spec in p.items():
        if spec._is_terminal:
            for field in (spec.out_dst, spec.out_src):
                named = layout_map(field).get("output")
                if named:
                    return dict(named)
    return {}


def _device_type() -> str:
    backend = dist.get_backend()
    if backend == "gloo":
        return "cpu"
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else "cpu"


def _to(batch: Mapping[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _batch(factory: Callable[[int], Any], step: int, device: str) -> dict[str, Any]:
    batch = factory(step)
    if not isinstance(batch, Mapping) or not any(
        isinstance(v, torch.Tensor) for v in batch.values()
    ):
        raise EquivalenceBatchError(
            f"batch factory {getattr(factory, '__qualname__', factory)!r} returned "
            f"{type(batch).__name__} for step {step}, not a mapping of model keyword arguments "
            "holding at least one tensor. Fix: return e.g. {'input_ids': ids, 'labels': ids}."
        )
    return _to(batch, device)


def _whole(t: torch.Tensor, layout: Mapping[str, Placement], mesh: DeviceMesh) -> torch.Tensor:
    if isinstance(t, DTensor):
        return t.full_tensor()
    if any(not isinstance(q, Replicate) for q in layout.values()):
        return full_tensor(t, dict(layout), mesh)
    return t


def _loss_and_logits(
    out: Any, batch: Mapping[str, Any], loss_fn: Callable[..., Any] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    loss = loss_fn(out, batch) if loss_fn is not None else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise EquivalenceOutputError(
            f"model output {type(out).__name__}: no scalar loss "
            f"({'loss_fn returned' if loss_fn else '.loss is'} {type(loss).__name__}). "
            "Fix: return an output with .loss (pass labels in the batch), or pass "
            "loss_fn=callable(output, batch) -> scalar tensor."
        )
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    return loss, logits if isinstance(logits, torch.Tensor) else None


@contextlib.contextmanager
def _naming_failures(copy_name: str, step: int, phase: str) -> Iterator[None]:
    """Re-raise a model's own exception as one that says which copy, step and phase; hp's
    errors (they name their culprit) pass through as they are."""
    try:
        yield
    except HpError:
        raise
    except Exception as e:
        which = "the single-device reference" if copy_name == "ref" else f"{copy_name} mode"
        raise EquivalenceRunError(
            f"{which} raised {type(e).__name__} in the {phase} of step {step}: {e}\n"
            + (
                "Fix: the model itself fails on this batch; run it unsharded first."
                if copy_name == "ref"
                else "Fix: only the parallel copy fails: the rank traceback (the cause) "
                "shows the failing op; a shape error points at a forward that hard-codes "
                "a size tensor parallelism divides (docs/shardable-forwards.md)."
            )
        ) from e


def _problem_name(line: str, names: Sequence[str]) -> str:
    head = line.strip().partition(":")[0]
    return head if head in names else (names[0] if names else "?")


class _Run:
    """One check's mesh, plan facts (placements, output layout) and the report it fills."""

    def __init__(
        self,
        report: EquivalenceReport,
        mesh: DeviceMesh,
        p: ShardingPlan,
        stacks: Mapping[str, tuple[str, ...]],
    ) -> None:
        self.report, self.mesh, self.plan = report, mesh, p
        #: stacked expert parameter → the reference's per-expert names, in expert order.
        self.stacks = dict(stacks)
        self.layouts = param_layouts(p)
        dims = tuple(mesh.mesh_dim_names or ())
        self.tp = mesh.size(dims.index("tp")) if "tp" in dims else 1
        self.logit_layout = output_layout(p)
        self.logit_text = _layout_text(self.logit_layout) if self.logit_layout else "whole"

    def reference(self, ref: nn.Module, what: Literal["param", "grad"]) -> dict[str, torch.Tensor]:
        """The reference's parameters (``what="param"``) or gradients under the parallel
        model's names: per-expert tensors stacked as ``apply`` stacked them (an expert no
        token reached has no gradient in the reference, and zero rows in the stack)."""
        named = dict(ref.named_parameters())
        if what == "param":
            out = {n: q.detach() for n, q in named.items()}
        else:
            out = {n: q.grad for n, q in named.items() if q.grad is not None}
        for stacked, sources in self.stacks.items():
            if what == "grad" and not any(s in out for s in sources):
                continue
            rows = [out.pop(s) if s in out else torch.zeros_like(named[s]) for s in sources]
            out[stacked] = torch.stack(rows)
        return out

    def gather(self, m: nn.Module, ref: nn.Module, key: str, step: int) -> dict[str, torch.Tensor]:
        state: Any = getattr(m, "_hp_applied", None)
        meshes = getattr(state, "expert_meshes", None) or None
        whole = self.reference(ref, "param")
        try:
            full = gather_full_grads(m, whole, self.mesh, expert_groups=meshes)
        except GradientCheckError as e:
            lines = str(e).splitlines()[1:]
            names = list(whole)
            self.report.problem(
                key, step, lines, _problem_name(lines[0] if lines else "", names), self.layouts
            )
            return {}
        return restore_fused(full, self.plan, self.tp)

    def compare(self, key: str, got: Mapping[str, Any], ref: Mapping[str, Any], step: int) -> None:
        rtol = self.report.rtol
        per = {
            n: allclose_excess(got[n], r, rtol=rtol) if got.get(n) is not None else float("inf")
            for n, r in ref.items()
        }
        per.update({n: float("inf") for n in got if n not in ref})
        layouts = {**self.layouts, "loss": "scalar", "logits": self.logit_text}
        self.report.record(key, per, step, layouts)


def _gather_params(run: _Run, m: nn.Module, ref: nn.Module, key: str) -> dict[str, torch.Tensor]:
    """Every parameter, whole: gathered like a gradient (each parameter posing as its own)."""
    saved = {n: p.grad for n, p in m.named_parameters()}
    for p in m.parameters():
        p.grad = p.detach().clone()
    try:
        return run.gather(m, ref, key, run.report.steps - 1)
    finally:
        for n, p in m.named_parameters():
            p.grad = saved[n]


def _same_everywhere(model: nn.Module, factory: object) -> None:
    """Refuse a factory that builds other weights on other ranks (an unseeded model)."""
    with torch.no_grad():
        mine = [float(p.detach().double().sum()) for p in model.parameters()]
    every: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    odd = [r for r, sums in enumerate(every) if sums != every[0]]
    if odd:
        raise EquivalenceFactoryError(
            f"model factory {factory!r} built other weights on rank(s) {odd} than on rank 0: "
            "the check needs the same model on every rank (each keeps its own reference). "
            "Fix: seed the factory (torch.manual_seed, or build_family(name, seed=0)) so "
            "every call builds the same weights."
        )


def _another(build: Callable[[], Any], base: nn.Module, device: str, factory: object) -> nn.Module:
    """One more copy of the model, built by the factory (not ``copy.deepcopy``: a model whose
    code closes over its own modules, as minGPT's ``mlpf`` lambda does, is not deep-copyable),
    refused unless it holds exactly the first one's parameters and buffers."""
    model = build().to(device)
    mine, first = model.state_dict(), base.state_dict()
    same = mine.keys() == first.keys() and all(
        mine[k].dtype == first[k].dtype and torch.equal(mine[k], first[k]) for k in first
    )
    if not same:
        raise EquivalenceFactoryError(
            f"model factory {factory!r} built another model on its second call than on its "
            "first: the check builds the reference and each mode's copy with it. Fix: seed the "
            "factory inside it (torch.manual_seed(0) first), so every call builds the same "
            "weights."
        )
    return model


def _unmoved_everywhere(names: list[str]) -> list[str]:
    every: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, names)
    return sorted({n for part in every for n in part or []})


def equivalence_on_rank(
    model_factory: Factory,
    batch_factory: Factory,
    mesh: MeshSpec | Mapping[str, int] | str = "tp=2",
    *,
    overrides: Any = None,
    plan_kwargs: Mapping[str, Any] | None = None,
    modes: Sequence[str] = MODES,
    steps: int = 2,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    shard_batch: Callable[[dict[str, Any], DeviceMesh], dict[str, Any]] | None = None,
    plan_hook: Callable[[ShardingPlan], ShardingPlan | None] | None = None,
    after_apply: Callable[[nn.Module, str], None] | None = None,
    raise_on_failure: bool = True,
) -> EquivalenceReport:
    """The equivalence check on this rank of an initialized process group (call it on all).

    Arguments as :func:`hp_core.testing.check_equivalence`. ``shard_batch(batch, mesh)``
    gives the batch the parallel models see (e.g. a context-parallel training adapter's
    split); the reference sees the whole one. ``plan_hook(plan)`` changes the plan (return
    the new one, or None to keep it) and ``after_apply(model, mode)`` an applied model:
    negative controls use them to prove the check catches a change, and ``after_apply``
    also does what a training loop does after ``apply`` (e.g. ``hp_plugin_cp``'s
    ``cp_global_loss``). Raises :class:`EquivalenceError` on every rank when a quantity is
    off (unless ``raise_on_failure`` is false); plan/apply refusals raise as themselves.
    """
    run_modes = check_run_args(steps, modes)
    spec = mesh_spec(mesh, dist.get_world_size())
    build = resolve_factory(model_factory, "model factory")
    make_batch = resolve_factory(batch_factory, "batch factory")
    device = _device_type()
    dmesh = init_device_mesh(device, spec.sizes, mesh_dim_names=spec.axis_names)
    base = build()
    if not isinstance(base, nn.Module):
        raise EquivalenceFactoryError(
            f"model factory {model_factory!r} returned {type(base).__name__}, not an nn.Module. "
            "Fix: return the model (the same seeded one on every call)."
        )
    base = base.to(device)
    _same_everywhere(base, model_factory)
    p = plan(base, dmesh, overrides=overrides, **dict(plan_kwargs or {}))
    if plan_hook is not None:
        p = plan_hook(p) or p
    checked = verify(base, p, dmesh)
    models: dict[str, nn.Module] = {"ref": _another(build, base, device, model_factory)}
    for mode in run_modes:
        model = _another(build, base, device, model_factory)
        models[mode] = apply(model, p, dmesh, mode=mode, verify=checked)
        if after_apply is not None:
            after_apply(models[mode], mode)
    report = EquivalenceReport(str(spec), run_modes, steps, rtol, atol)
    run = _Run(report, dmesh, p, stacked_names(models[run_modes[0]]))
    report.n_params = len(run.reference(base, "param"))
    _train(run, models, make_batch, device, loss_fn, shard_batch)
    if raise_on_failure and not report.passed:
        raise EquivalenceError(report)
    return report


def _train(
    run: _Run,
    models: dict[str, nn.Module],
    make_batch: Callable[[int], Any],
    device: str,
    loss_fn: Callable[..., torch.Tensor] | None,
    shard_batch: Callable[..., dict[str, Any]] | None,
) -> None:
    # Adam divides each update by that element's own gradient size: an element whose gradient
    # is rounding noise in both runs gets a noise-driven update of up to lr * |noise| / eps;
    # eps 1e-5 keeps that far below the tolerance (docs/testing.md).
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5, foreach=False)
        for k, m in models.items()
    }
    ref = models["ref"]
    modes = [k for k in models if k != "ref"]
    pairs = [(m, "ref", m) for m in modes]
    if len(modes) == 2:
        pairs.append(("production", "validate", "production-validate"))
    report = run.report
    for step in range(report.steps):
        batch = _batch(make_batch, step, device)
        seen = {
            k: shard_batch(dict(batch), run.mesh) if shard_batch and k != "ref" else batch
            for k in models
        }
        res: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        for k, m in models.items():
            opts[k].zero_grad(set_to_none=True)
            with _naming_failures(k, step, "forward and loss"):
                loss, logits = _loss_and_logits(m(**seen[k]), seen[k], loss_fn)
            # Read before backward: a loss may reuse the logits' storage for its gradient.
            outs = {"loss": _whole(loss.detach().clone(), {}, run.mesh).reshape(())}
            if logits is not None:
                layout = run.logit_layout if k != "ref" else {}
                outs["logits"] = _whole(logits.detach().clone(), layout, run.mesh)
            with _naming_failures(k, step, "backward"):
                loss.backward()
            grads = (
                run.reference(m, "grad") if k == "ref" else run.gather(m, ref, f"{k}:grad", step)
            )
            res[k] = {"out": outs, "grad": grads}
        for a, b, name in pairs:
            for what in ("loss", "logits"):
                if what in res[b]["out"]:
                    got: dict[str, Any] = {what: res[a]["out"].get(what)}
                    run.compare(f"{name}:{what}", got, {what: res[b]["out"][what]}, step)
            if res[a]["grad"] and (b == "ref" or res[b]["grad"]):
                run.compare(f"{name}:grad", res[a]["grad"], res[b]["grad"], step)
        for k, m in models.items():
            before = snapshot_params(m, only_with_grad=True)
            opts[k].step()
            if k == "ref":
                continue
            still = _unmoved_everywhere(unmoved_params(before, m))
            if still:
                report.problem(
                    f"{k}:moved", step, [f"{n}: did not move" for n in still], still[0], run.layouts
                )
            else:
                report.record(f"{k}:moved", dict.fromkeys(before, 0.0), step, run.layouts)
    whole = run.reference(ref, "param")
    params = {k: _gather_params(run, models[k], ref, f"{k}:param") for k in modes}
    for a, b, name in pairs:
        other = whole if b == "ref" else params[b]
        if params[a] and other:
            run.compare(f"{name}:param", params[a], other, report.steps - 1)
