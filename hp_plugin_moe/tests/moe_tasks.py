"""Rank-side tasks of the expert-parallel tests (importable by the spawned gloo ranks).

Every comparison is against single-device runs of the unsharded model. With data axes
(``dp``) each dp slice trains its own batch: its loss, logits and non-expert gradients
equal the single-device run of that batch, and an expert's gradient is the sum over
the batches of the slices its expert group spans (reducing over dp is DDP/FSDP's job).

The compared models carry seeded noise on every weight (``build(..., perturbed=True)``:
``build_family`` or ``perturb_``); the parallel gradients are gathered by
``gather_full_grads`` over the expert groups (layouts inferred from the shapes, replicas
checked across the non-data axes, hp's placement tables never read), and the expected
gradients are stacked from the reference's own per-expert names, not from hp's plan.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from moe_toys import VOCAB, toy_lm
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import hp_plugin_moe
from hp_core.apply import apply
from hp_core.context import ParallelContext
from hp_core.injection import Target, local_compute
from hp_core.planner.plan import plan as make_plan
from hp_core.plans.prediction import input_check_axes, step_collectives
from hp_core.presets import build_model
from hp_core.testing.compare import (
    DEFAULT_EXPERT_PARAMS,
    gather_full_grads,
    nan_safe_max,
    run_excess,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.families import family_model, perturb_
from hp_core.testing.probe import by_phase, count_step

RTOL = 1e-5
MOE = "model.layers.*.mlp"
FACTORY = {
    "qwen2moe": "qwen2moe",
    "mixtral": "mixtral",
    "deepseekv3": "deepseekv3",
    "toy": "routed_only",
}
#: The ``hp_core.testing.families`` name of each HF family here (``build_family``).
FAMILY_NAME = {"qwen2moe": "qwen2_moe", "mixtral": "mixtral"}
#: A per-expert ModuleList parameter (``<prefix>.experts.<e>.<rest>``), stacked by hp into
#: ``<prefix>.experts.<rest>`` = ``[E, ...]`` in expert order.
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<rest>.+)$")

#: Computes bound by ``spy`` in this process (cleared by each task that uses it).
SPIES: list[Any] = []


@local_compute
def spy(
    module: nn.Module,
    ctx: ParallelContext,
    archetype: str = "qwen2moe",
    capacity_factor: float | None = None,
) -> Any:
    """A registered archetype whose compute this process keeps, to read its routing statistics."""
    factory = getattr(hp_plugin_moe, archetype)
    compute = factory(module=module, ctx=ctx, capacity_factor=capacity_factor)
    SPIES.append(compute)
    return compute


def deepseek_v3(seed: int = 0, **config: Any) -> nn.Module:
    """A tiny ``DeepseekV3ForCausalLM`` (8 routed experts in 2 groups, 1 shared expert)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    values = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=0, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, dtype="float32", attn_implementation="sdpa",
    )  # fmt: skip
    values.update(config)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**values))
    with torch.no_grad():  # a router with some spread, and a non-zero correction bias
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.3)
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    return model.eval()


def build(family: str, *, perturbed: bool = False, **config: Any) -> nn.Module:
    """The model of ``family``; ``perturbed``: every weight shifted by seeded noise (for the
    equivalence tests: no zero bias or unit norm weight makes a comparison trivially equal)."""
    if family == "deepseekv3":
        model = deepseek_v3(**config)
    elif family == "toy":
        model = toy_lm(**config)
    elif perturbed:
        return family_model(FAMILY_NAME[family], **config)
    else:
        return build_model(family, seed=0, **config)
    return perturb_(model, seed=0) if perturbed else model


def block_experts(model: nn.Module, blocked: Sequence[int]) -> None:
    """Make the routers never choose ``blocked``: hidden dim 0 is positive for every token
    (embedding column 0, five times the other columns' spread: a few times the other dims'
    scale after the norm, whatever the attention adds), and only the blocked experts'
    router rows weigh it, very negatively. The other rows are scaled up so the remaining
    experts are chosen by clear margins."""
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, 0] = 5.0 * float(embedding[:, 1:].std())
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.mul_(10.0)
            gate[:, 0] = 0.0
            for e in blocked:
                gate[e, 0] = -100.0


def _mesh(shape: Sequence[int], names: Sequence[str]) -> Any:
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


def _batch(step: int, part: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 17 * step + part)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _forward(model: nn.Module, ids: torch.Tensor, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    if family == "toy":
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)), logits
    out = model(input_ids=ids, labels=ids, use_cache=False)
    return out.loss, out.logits


def ep_overrides(family: str, factory: Any = None) -> list[dict[str, Any]]:
    return [
        {
            "match": MOE,
            "when": "ep",
            "local_compute_fn": factory or FACTORY[family],
            "region_dispatch": False,
        }
    ]


def _expected(refs: list[nn.Module], mine: int, group_slices: list[int]) -> dict[str, torch.Tensor]:
    """Per-parameter single-device gradients, keyed by the parallel model's names.

    Derived from the references alone (never from hp's plan): an expert parameter (a path
    component ``experts``) gets the sum of its gradients over the slices of its expert
    group; a per-expert ModuleList's parameters are stacked in expert order under the name
    with the expert index dropped (an expert that saw no token has a zero gradient).
    """
    named = [dict(r.named_parameters()) for r in refs]
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, p in named[mine].items():
        if re.search(DEFAULT_EXPERT_PARAMS, name) is None:
            if p.grad is not None:
                out[name] = p.grad
            continue
        grads = [named[s][name].grad for s in group_slices]
        summed = sum(
            (g if g is not None else torch.zeros_like(p) for g in grads), torch.zeros_like(p)
        )
        found = PER_EXPERT.match(name)
        if found is None:
            out[name] = summed
        else:
            stacks.setdefault(f"{found['prefix']}.{found['rest']}", {})[int(found["e"])] = summed
    for name, parts in stacks.items():
        assert sorted(parts) == list(range(len(parts))), (name, sorted(parts))
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def train_compare(
    family: str,
    mesh_shape: Sequence[int],
    mesh_names: Sequence[str],
    *,
    ep: int,
    sp: bool = True,
    steps: int = 2,
    factory: Any = None,
    overrides: Any = None,
    blocked: Sequence[int] = (),
    **config: Any,
) -> dict[str, Any]:
    """Single device vs production vs validate: loss, logits, every gradient, ``steps`` steps.

    Excesses are NaN-safe (inf for NaN/inf); ``not_stepped`` lists, per model, the
    parameters with a gradient that an optimizer step did not move (or made non-finite)
    on this rank.
    """
    base = build(family, perturbed=True, **config)
    if blocked:
        block_experts(base, blocked)
    mesh = _mesh(mesh_shape, mesh_names)
    names = list(mesh_names)
    slices = mesh.size(names.index("dp")) if "dp" in names else 1
    mine = mesh.get_local_rank("dp") if "dp" in names else 0
    refs = [copy.deepcopy(base) for _ in range(slices)]
    prod, val = copy.deepcopy(base), copy.deepcopy(base)
    SPIES.clear()
    for m, mode in ((prod, "production"), (val, "validate")):
        p = make_plan(
            m,
            mesh,
            sequence_parallel=sp,
            ep_size=ep,
            overrides=overrides if overrides is not None else ep_overrides(family, factory),
        )
        apply(m, p, mesh, mode=mode)
    group = prod._hp_applied.expert_meshes[ep]["ep"].mesh.flatten().tolist()
    per_slice = dist.get_world_size() // slices
    group_slices = sorted({r // per_slice for r in group})
    if slices > 1:
        steps = 1  # the slices' optimizer steps would differ without a dp gradient reduction
    models = {"prod": prod, "val": val}
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6, foreach=False)
        for k, m in {**models, **{f"ref{s}": r for s, r in enumerate(refs)}}.items()
    }
    worst = {
        f"{a}-{b}:{w}": 0.0
        for a, b in (("prod", "ref"), ("val", "ref"), ("prod", "val"))
        for w in ("loss", "logits", "grad")
    }
    losses: list[float] = []
    stepped = {**models, **{f"ref{s}": r for s, r in enumerate(refs)}}
    not_stepped: dict[str, set[str]] = {k: set() for k in stepped}
    for step in range(steps):
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        ref_out = []
        for s, r in enumerate(refs):
            loss, logits = _forward(r, _batch(step, s), family)
            loss.backward()
            ref_out.append((loss.detach(), logits.detach()))
        expected = _expected(refs, mine, group_slices)
        res: dict[str, Any] = {"ref": (*ref_out[mine], expected)}
        for k, m in models.items():
            loss, logits = _forward(m, _batch(step, mine), family)
            loss.backward()
            groups = m._hp_applied.expert_meshes  # the expert groups, handed to the gatherer
            res[k] = (
                loss.detach(),
                logits.detach(),
                gather_full_grads(m, expected, mesh, expert_groups=groups),
            )
        losses.append(float(res["ref"][0]))
        for a, b in (("prod", "ref"), ("val", "ref"), ("prod", "val")):
            for what, value in run_excess(res[a], res[b], rtol=RTOL).items():
                worst[f"{a}-{b}:{what}"] = nan_safe_max([worst[f"{a}-{b}:{what}"], value])
        before = {k: snapshot_params(m, only_with_grad=True) for k, m in stepped.items()}
        for opt in opts.values():
            opt.step()
        for k, m in stepped.items():
            not_stepped[k].update(unmoved_params(before[k], m))  # not moved, or to NaN/inf
            if not before[k]:
                not_stepped[k].add("<no parameter had a gradient>")
    n_expert = sum(1 for n in res["ref"][2] if ".experts." in n)
    return {
        **worst,
        "not_stepped": {k: sorted(v) for k, v in not_stepped.items()},
        "losses": losses,
        "n_grads": len(res["ref"][2]),
        "n_expert_grads": n_expert,
        "group": group,
        "received": [list(s.dispatcher.last_received) for s in SPIES],
        "params": sorted(n for n, _ in prod.named_parameters() if ".layers.0.mlp." in n),
        "local_expert_shape": tuple(_first_expert(prod).shape),
        "expert_syncs": sum(
            1
            for g in (
                prod._hp_applied.grad_reducer.groups() if prod._hp_applied.grad_reducer else []
            )
            if g.startswith("experts(")
        ),
    }


def _first_expert(model: nn.Module) -> torch.Tensor:
    return next(p for n, p in model.named_parameters() if ".experts." in n)


def count_collectives(
    family: str,
    mode: str,
    mesh_shape: Sequence[int],
    mesh_names: Sequence[str],
    *,
    ep: int,
    layers: int,
    sp: bool = True,
    **config: Any,
) -> dict[str, Any]:
    """Measured collectives of one forward and one backward, and the dense plan's prediction."""

    from hp_core.runtime.applied import finalize_grads

    model = (
        build(family, num_hidden_layers=layers, **config)
        if family != "toy"
        else build(family, layers=layers, **config)
    )
    mesh = _mesh(mesh_shape, mesh_names)
    p = make_plan(model, mesh, sequence_parallel=sp, ep_size=ep, overrides=ep_overrides(family))
    apply(model, p, mesh, mode=mode)
    finalize_grads(model)  # nothing pending yet: a no-op, without collectives
    assert all(q.grad is None for q in model.parameters())
    ids = _batch(0, 0)
    measured = count_step(lambda: _forward(model, ids, family)[0])
    checks = input_check_axes(mesh.mesh_dim_names, mesh.shape)
    reductions = model._hp_applied.report.reductions
    pred = by_phase(step_collectives(p.modules, reductions=reductions, check_axes=checks))
    state = model._hp_applied
    return {
        "forward": measured["forward"],
        "backward": measured["backward"],
        "pred_forward": pred["forward"],
        "pred_backward": pred["backward"],
        "sp_sync": state.grad_reducer.by_group.get("tp", 0) if state.grad_reducer else 0,
        "expert_sync": sum(
            n
            for g, n in (state.grad_reducer.by_group.items() if state.grad_reducer else [])
            if g.startswith("experts(")
        ),
    }


# ------------------------------------------------------------------ preflight errors


def _snapshot(model: nn.Module) -> list[tuple[str, int, torch.Tensor]]:
    return [(n, id(p), p.detach().clone()) for n, p in model.named_parameters()]


def _same(a: list[Any], b: list[Any]) -> bool:
    return [(n, i) for n, i, _ in a] == [(n, i) for n, i, _ in b] and all(
        torch.equal(x, y) for (_, _, x), (_, _, y) in zip(a, b, strict=True)
    )


@local_compute
def wrong_signature(module: nn.Module, ctx: ParallelContext) -> Any:
    def compute(
        module: nn.Module, x: torch.Tensor
    ) -> torch.Tensor:  # the block's forward takes hidden_states
        return x

    return compute


def not_decorated(module: nn.Module, ctx: ParallelContext) -> Any:
    return None


def fails_in_apply(target_module: nn.Module, ctx: ParallelContext) -> Any:
    raise RuntimeError("boom: an inner wrapper failing after the experts were stacked")


def apply_error(case: str) -> dict[str, Any]:
    """Apply a broken EP setup; return the error and whether the model is exactly as it was."""
    from hp_core.injection import inner_wrapper

    family, mesh_shape, names, ep, sp = "qwen2moe", (2,), ("tp",), 2, True
    config: dict[str, Any] = {}
    factory: Any = None
    plan_model = None
    extra: list[dict[str, Any]] = []
    if case == "no_compute":
        factory = False
    elif case == "no_compute_toy":
        family, names, factory = "toy", ("dp",), False
    elif case == "experts_not_divisible":
        plan_model, config = build("qwen2moe"), {"num_experts": 3}
    elif case == "ep_not_dividing_region":
        ep, config = 4, {"num_experts": 8}
    elif case == "config_typo":
        factory = Target("qwen2moe", {"capacity_factr": 1.0})
    elif case == "bad_config_value":
        factory = Target("qwen2moe", {"capacity_factor": -1})
    elif case == "undecorated":
        factory = not_decorated
    elif case == "wrong_signature":
        factory = wrong_signature
    elif case == "wrong_archetype":
        factory = "mixtral"
    elif case == "replicated_tokens":
        sp = False
    elif case == "rollback":
        family, names = "toy", ("dp",)
        extra = [
            {
                "match": "model.layers.0.post_attention_layernorm",
                "inner_target": "self",
                "inner_wrapper": inner_wrapper(fails_in_apply),
                "region_dispatch": False,
            }
        ]
    else:
        raise ValueError(case)
    model = build(family, **config)
    mesh = _mesh(mesh_shape, names)
    overrides = [] if factory is False else ep_overrides(family, factory)
    # These cases test apply's refusals: plan without the plan-time check of the same names.
    p = make_plan(
        plan_model or model,
        mesh,
        sequence_parallel=sp,
        ep_size=ep,
        overrides=overrides + extra,
        check_items=False,
    )
    if factory is False:  # a plan made where no plugin registered a compute for the model
        for _, spec in p.items():
            if spec._ep_size > 1:
                spec.local_compute_fn = None
    before = _snapshot(model)
    modules_before = [(n, type(m).__name__) for n, m in model.named_modules()]
    try:
        apply(model, p, mesh)
    except Exception as e:
        return {
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "message": str(e),
            "cause": type(e.__cause__).__name__ if e.__cause__ else None,
            "unchanged": _same(before, _snapshot(model))
            and modules_before == [(n, type(m).__name__) for n, m in model.named_modules()],
            "applied": getattr(model, "_hp_applied", None) is not None,
        }
    return {"type": None}


def yaml_compare(
    family: str, text: str, mesh_shape: Sequence[int], mesh_names: Sequence[str], *, ep: int
) -> dict[str, Any]:
    """The overrides of a YAML document (e.g. the one in docs/ep.md) against single device."""
    from hp_core import load_overrides

    return train_compare(
        family, mesh_shape, mesh_names, ep=ep, steps=1, overrides=load_overrides(text)
    )


def capacity_run(capacity_factor: float) -> dict[str, Any]:
    """tp=2, ep=2 with a capacity limit bound from a Target's config: production equals validate."""
    from hp_core import trust_packages

    trust_packages("moe_tasks")
    base = build("qwen2moe", perturbed=True)
    mesh = _mesh((2,), ("tp",))
    outs = []
    SPIES.clear()
    for mode in ("production", "validate"):
        m = copy.deepcopy(base)
        target = Target.from_dict(
            {
                "_target_": "moe_tasks.spy",
                "archetype": "qwen2moe",
                "capacity_factor": capacity_factor,
            }
        )
        apply(
            m,
            make_plan(m, mesh, ep_size=2, overrides=ep_overrides("qwen2moe", target)),
            mesh,
            mode=mode,
        )
        loss, logits = _forward(m, _batch(0, 0), "qwen2moe")
        loss.backward()
        outs.append(
            (
                loss.detach(),
                logits.detach(),
                gather_full_grads(m, base, mesh, expert_groups=m._hp_applied.expert_meshes),
            )
        )
    return {
        **run_excess(outs[0], outs[1], rtol=RTOL),
        "finite": bool(torch.isfinite(outs[0][1]).all()),
        "dropped": [s.dispatcher.last_dropped for s in SPIES],
    }


def meta_apply(mode: str) -> dict[str, Any]:
    """Apply EP to a meta-device model: experts are stacked and sharded, and stay meta."""
    from moe_toys import ToyMoELM

    with torch.device("meta"):
        model = ToyMoELM()
    mesh = _mesh((2,), ("dp",))
    apply(model, make_plan(model, mesh, ep_size=2, overrides=ep_overrides("toy")), mesh, mode=mode)
    w = model.model.layers[0].mlp.experts.gate_proj.weight
    local = w.to_local() if hasattr(w, "to_local") else w
    return {
        "meta": bool(local.is_meta),
        "local_shape": tuple(local.shape),
        "type": type(w).__name__,
    }
