"""Rank-side tasks for the CP tests (run on every rank of a shared gloo world).

Each task bundles several cases so that a world runs few tasks. Every equivalence case
compares a reference (the unsharded model on the whole batch, one process) with a
production-mode and a validate-mode CP copy of the same weights: loss, logits (gathered
back into natural order) and every gradient (summed over cp, unsharded over tp). The
weights are perturbed by seeded noise (``build_family`` / ``perturb_``), so zero biases
and unit norm weights make nothing trivially equal; the gradients are gathered by
``gather_full_grads`` (layouts inferred from the shapes, replicas checked to agree over
cp and tp, hp's placement tables never read); every fold is NaN-safe.
The plan's CP override is the YAML block of ``docs/cp.md``, verbatim.
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hp_core import applied, apply, plan
from hp_core.context import ParallelContext
from hp_core.plans.prediction import input_check_axes, step_collectives
from hp_core.presets import build_model
from hp_core.testing.compare import (
    allclose_excess,
    gather_full_grads,
    nan_safe_max,
    run_excess,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.families import family_model, perturb_
from hp_core.testing.probe import by_phase, count_step
from hp_plugin_cp import (
    enable_cp_loss,
    gather_sequence,
    reduce_loss_over_cp,
    shard_batch_for_cp,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DOC = Path(__file__).resolve().parents[2] / "docs" / "cp.md"
VOCAB = 128
RTOL = 1e-5


def doc_python(marker: str) -> str:
    """The python block of docs/cp.md that contains ``marker``."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    (block,) = [b for b in blocks if marker in b]
    return block


class _Stepped:
    """An optimizer that records which weights each ``step`` moved (on this rank)."""

    def __init__(self, opt: torch.optim.Optimizer, model: nn.Module) -> None:
        self.opt, self.model = opt, model
        self.not_stepped: set[str] = set()
        self.steps = 0

    def step(self) -> None:
        before = snapshot_params(self.model, only_with_grad=True)  # after backward, before step
        self.opt.step()
        self.not_stepped.update(unmoved_params(before, self.model))  # not moved, or to NaN/inf
        if not before:
            self.not_stepped.add("<no parameter had a gradient>")
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)


def doc_training(
    mesh_shape: tuple[int, ...], mesh_names: tuple[str, ...], steps: int = 3
) -> dict[str, Any]:
    """The training loop of docs/cp.md, run as written, against a single-device AdamW run.

    ``not_stepped``: per model, the parameters with a gradient that an optimizer step did
    not move (or made non-finite) on this rank.
    """
    namespace: dict[str, Any] = {"__name__": "docs_cp_training"}
    exec(compile(doc_python("def train_step"), "docs/cp.md[training]", "exec"), namespace)
    mesh = _mesh(mesh_shape, mesh_names)
    base = family_model("llama")
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    namespace["parallelize"](model, mesh, doc_yaml())
    opt = _Stepped(torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, foreach=False), model)
    ref_opt = _Stepped(torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6, foreach=False), ref)
    losses = []
    for step in range(steps):
        batch = full_batch(40 + step, pad=step % 2 == 1)
        loss = namespace["train_step"](model, opt, batch, mesh, load_balanced=step == 2)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        losses.append((float(loss), float(ref_loss)))
    return {
        "losses": losses,
        "worst": nan_safe_max(allclose_excess(torch.tensor(a), torch.tensor(b)) for a, b in losses),
        "steps": {"cp": opt.steps, "ref": ref_opt.steps},
        "not_stepped": {"cp": sorted(opt.not_stepped), "ref": sorted(ref_opt.not_stepped)},
    }


def doc_yaml(wrapper: str = "sdpa_hf") -> str:
    """The CP override block of docs/cp.md, with the wrapper name swapped if asked."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    (block,) = [b for b in blocks if "inner_wrapper: sdpa_hf" in b]
    return block.replace("inner_wrapper: sdpa_hf", f"inner_wrapper: {wrapper}")


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def full_batch(seed: int, *, pad: bool, batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    """Token ids and labels; with ``pad``: row 0 left-padded by 3, row 1 right-padded by 5."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if pad:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, :3] = 0
        mask[1, seq - 5 :] = 0
        out["labels"] = ids.masked_fill(mask == 0, -100)
        out["attention_mask"] = mask
    return out


def _ref_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _compare(ref: tuple, got: tuple, key: str, worst: dict[str, float]) -> None:
    for what, value in run_excess(got, ref, rtol=RTOL).items():
        worst[f"{key}:{what}"] = value


def hf_equivalence(
    family: str,
    mesh_shape: tuple[int, ...],
    mesh_names: tuple[str, ...],
    cases: list[tuple[bool, bool]],
) -> dict[str, Any]:
    """``cases``: (pad, load_balanced) pairs. Returns the worst excess per case and quantity."""
    mesh = _mesh(mesh_shape, mesh_names)
    cp_mesh = mesh["cp"]
    base = family_model(family)
    models = {}
    for mode in ("production", "validate"):
        m = copy.deepcopy(base)
        apply(m, plan(m, mesh, overrides=doc_yaml()), mesh, mode=mode)
        models[mode] = enable_cp_loss(m, cp_mesh)
    worst: dict[str, Any] = {}
    for i, (pad, lb) in enumerate(cases):
        full = full_batch(10 + i, pad=pad)
        ref = copy.deepcopy(base)
        out = ref(**full, use_cache=False)
        out.loss.backward()
        expected = (out.loss.detach(), out.logits.detach(), _ref_grads(ref))
        sharded = shard_batch_for_cp(full, cp_mesh, load_balanced=lb)
        tag = f"{'pad' if pad else 'nopad'}-{'lb' if lb else 'contig'}"
        results = {}
        for mode, m in models.items():
            m.zero_grad(set_to_none=True)
            o = m(**sharded, use_cache=False)
            o.loss.backward()
            logits = gather_sequence(o.logits, cp_mesh, load_balanced=lb)
            results[mode] = (o.loss.detach(), logits, gather_full_grads(m, ref, mesh))
            _compare(expected, results[mode], f"{tag}:{mode}-ref", worst)
        _compare(results["validate"], results["production"], f"{tag}:prod-val", worst)
        worst[f"{tag}:n_grads"] = len(expected[2])
    wraps = applied(models["production"]).inner_wraps
    worst["applied"] = sorted(
        {
            wraps[f].wrapper if f in wraps else "-"
            for f, s in applied(models["production"]).plan.items()
            if s._needs_cp_attn
        }
    )
    return worst


# ----------------------------------------------------------- toy qkv model


class SDPACore(nn.Module):
    """The attention core: ``(q, k, v)`` in the SDPA layout, GQA by ``enable_gqa``."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = True,
    ) -> torch.Tensor:
        if attn_mask is not None:
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            attn_mask, is_causal = attn_mask & causal, False
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True
        )


class FlexCore(nn.Module):
    """A flex-attention core: causal by a block mask built for its whole input."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        score_mod: Any = None,
        block_mask: Any = None,
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if block_mask is None:
            block_mask = create_block_mask(
                lambda b, h, qi, ki: ki <= qi, None, None, q.shape[-2], k.shape[-2]
            )
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)


class CoreAttention(nn.Module):
    """Projections around a child ``core`` called as ``core(q, k, v[, attn_mask])``."""

    def __init__(
        self, core: nn.Module, hidden: int = 32, heads: int = 4, kv_heads: int = 2
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.core = core

    def forward(
        self, hidden_states: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        out = self.core(q, k, v) if key_mask is None else self.core(q, k, v, key_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, core: nn.Module, hidden: int) -> None:
        super().__init__()
        self.self_attn = CoreAttention(core, hidden)

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        return h + self.self_attn(h, key_mask)


class ToyLM(nn.Module):
    """``embed_tokens → layers[i].self_attn (+ residual) → lm_head``; no positions needed."""

    def __init__(self, core: type[nn.Module], layers: int = 2, hidden: int = 32) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList([Block(core(), hidden) for _ in range(layers)])
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(
        self, input_ids: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, key_mask)
        return self.lm_head(h)


def _toy_loss(
    logits: torch.Tensor, shift_labels: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    return (
        F.cross_entropy(logits.reshape(-1, VOCAB), shift_labels.reshape(-1), reduction="sum")
        / count
    )


def qkv_override(wrapper: str, **config: Any) -> list[dict[str, Any]]:
    target = {"_target_": wrapper, **config} if config else wrapper
    return [
        {
            "match": "layers.*.self_attn",
            "when": "cp",
            "inner_target": "core",
            "inner_wrapper": target,
            "inner_out_src": "first_input",
            "region_dispatch": False,
        }
    ]


def qkv_equivalence(cases: list[tuple[bool, bool]]) -> dict[str, Any]:
    """``sdpa_qkv`` on the toy model at cp=2: (with a global key mask, load_balanced) cases."""
    mesh = _mesh((2,), ("cp",))
    cp_mesh = mesh["cp"]
    torch.manual_seed(0)
    base = perturb_(ToyLM(SDPACore), seed=0)
    worst: dict[str, Any] = {}
    for i, (masked, lb) in enumerate(cases):
        full = full_batch(20 + i, pad=masked)
        key_mask = full["attention_mask"].bool()[:, None, None, :] if masked else None
        ref = copy.deepcopy(base)
        sharded = shard_batch_for_cp(full, cp_mesh, load_balanced=lb)
        logits = ref(full["input_ids"], key_mask)
        loss = _toy_loss(logits, _shift_full(full["labels"]), sharded["num_items_in_batch"])
        loss.backward()
        expected = (loss.detach(), logits.detach(), _ref_grads(ref))
        tag = f"{'mask' if masked else 'nomask'}-{'lb' if lb else 'contig'}"
        results = {}
        for mode in ("production", "validate"):
            m = copy.deepcopy(base)
            apply(
                m,
                plan(m, mesh, overrides=qkv_override("sdpa_qkv", load_balanced=lb)),
                mesh,
                mode=mode,
            )
            out = m(sharded["input_ids"], key_mask)  # the mask is global: the wrapper narrows it
            share = _toy_loss(out, sharded["shift_labels"], sharded["num_items_in_batch"])
            total = reduce_loss_over_cp(share, cp_mesh)
            total.backward()
            results[mode] = (
                total.detach(),
                gather_sequence(out, cp_mesh, load_balanced=lb),
                gather_full_grads(m, ref, mesh),
            )
            _compare(expected, results[mode], f"{tag}:{mode}-ref", worst)
            worst[f"{tag}:{mode}:resolved"] = applied(m).inner_wraps["layers.0.self_attn"].target
        _compare(results["validate"], results["production"], f"{tag}:prod-val", worst)
    return worst


def _shift_full(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


# ------------------------------------------------------------------- flex


def flex_checks() -> dict[str, Any]:
    """flex_hf (HF Llama) and flex_qkv (toy) at cp=2: forward vs single device; backward's error."""
    mesh = _mesh((2,), ("cp",))
    cp_mesh = mesh["cp"]
    res: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex attention's "called without torch.compile" notice
        ref = family_model("llama")  # the single-device reference runs SDPA: same math
        models = {}
        for mode in ("production", "validate"):
            models[mode] = family_model("llama", attn_implementation="flex_attention")
            apply(
                models[mode],
                plan(models[mode], mesh, overrides=doc_yaml("flex_hf")),
                mesh,
                mode=mode,
            )
        # One case, the hardest (padding + load balancing): each new shape or mask costs a
        # dynamo compile of HF's own model-level flex mask (~5 s on CPU).
        full = full_batch(30, pad=True)
        with torch.no_grad():
            expected = ref(**full, use_cache=False).logits
        sharded = shard_batch_for_cp(full, cp_mesh, load_balanced=True)
        for mode, m in models.items():
            with torch.no_grad():
                out = m(**sharded, use_cache=False)
            res[f"hf-pad-lb:{mode}"] = allclose_excess(
                gather_sequence(out.logits, cp_mesh, load_balanced=True), expected
            )
        res["hf-backward"] = _try(
            lambda: models["production"](**sharded, use_cache=False).loss.backward()
        )
        torch.manual_seed(0)
        toy = perturb_(ToyLM(FlexCore), seed=0)
        full = full_batch(31, pad=False)
        with torch.no_grad():
            expected = toy(full["input_ids"])
        sharded = shard_batch_for_cp(full, cp_mesh)
        apply(toy, plan(toy, mesh, overrides=qkv_override("flex_qkv")), mesh, mode="production")
        with torch.no_grad():
            res["qkv:production"] = allclose_excess(
                gather_sequence(toy(sharded["input_ids"]), cp_mesh), expected
            )
        res["qkv-backward"] = _try(lambda: toy(sharded["input_ids"]).sum().backward())
    return res


# ------------------------------------------------------------ collectives


def count_collectives(
    mesh_shape: tuple[int, ...], mesh_names: tuple[str, ...], mode: str, layers: int
) -> dict[str, Any]:
    """Collectives of one forward and one backward of a Llama with ``layers`` layers."""

    mesh = _mesh(mesh_shape, mesh_names)
    model = build_model("llama", seed=0, num_hidden_layers=layers)
    p = plan(model, mesh, overrides=doc_yaml())
    apply(model, p, mesh, mode=mode)
    batch = shard_batch_for_cp(full_batch(0, pad=True), mesh["cp"])
    measured = count_step(lambda: model(**batch, use_cache=False).loss)
    checks = input_check_axes(mesh.mesh_dim_names, mesh.shape)
    reductions = model._hp_applied.report.reductions
    pred = by_phase(step_collectives(p.modules, reductions=reductions, check_axes=checks))
    return {
        "forward": measured["forward"],
        "backward": measured["backward"],
        "pred_forward": pred["forward"],
        "pred_backward": pred["backward"],
    }


# ------------------------------------------------------------- preflight


def _try(fn: Any) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def preflight_errors() -> dict[str, str]:
    """Every refusal of a CP plan, with the real plugin; values are 'Type: message'."""
    from hp_core.plugins import reset_plugins
    from hp_plugin_cp import sdpa_hf

    cp = _mesh((2,), ("cp",))
    tp = _mesh((2,), ("tp",))
    attn = {
        "match": "*.self_attn",
        "inner_target": "self",
        "inner_wrapper": "sdpa_hf",
        "region_dispatch": False,
    }

    def llama_apply(mesh: DeviceMesh, overrides: Any) -> Any:
        m = build_model("llama", seed=0)
        return lambda: apply(m, plan(m, mesh, overrides=overrides), mesh)

    out = {
        "no_wrapper": _try(llama_apply(cp, None)),
        "no_cp_axis": _try(llama_apply(tp, [attn])),
        "no_cp_axis_direct_callable": _try(llama_apply(tp, [{**attn, "inner_wrapper": sdpa_hf}])),
        "region_dispatch_true": _try(llama_apply(cp, [{**attn, "region_dispatch": True}])),
        "target_without_wrapper": _try(
            llama_apply(cp, [{k: v for k, v in attn.items() if k != "inner_wrapper"}])
        ),
        "wrapper_without_target": _try(
            llama_apply(cp, [{k: v for k, v in attn.items() if k != "inner_target"}])
        ),
        "unknown_name": _try(llama_apply(cp, [{**attn, "inner_wrapper": "sdpa_hff"}])),
        "when_cp_skipped_on_tp": _try(llama_apply(tp, doc_yaml())),
    }
    toy = ToyLM(SDPACore)
    child = [{k: v for k, v in qkv_override("sdpa_qkv")[0].items() if k != "inner_out_src"}]
    out["child_without_inner_out_src"] = _try(
        lambda: apply(toy, plan(toy, cp, overrides=child), cp)
    )
    eager = build_model("llama", seed=0, attn_implementation="eager")
    apply(eager, plan(eager, cp, overrides=doc_yaml()), cp)
    out["misfire_eager"] = _try(
        lambda: eager(**shard_batch_for_cp(full_batch(0, pad=False), cp["cp"]), use_cache=False)
    )
    fresh = build_model("llama", seed=0)
    before = {n: p.clone() for n, p in fresh.state_dict().items()}
    old = os.environ.get("HP_PLUGINS")
    os.environ["HP_PLUGINS"] = "moe"  # as if hp-plugin-cp were not installed
    reset_plugins()
    try:
        out["plugin_absent"] = _try(lambda: apply(fresh, plan(fresh, cp, overrides=doc_yaml()), cp))
    finally:
        if old is None:
            os.environ.pop("HP_PLUGINS", None)
        else:
            os.environ["HP_PLUGINS"] = old
        reset_plugins()
    out["plugin_absent_model_untouched"] = str(
        getattr(fresh, "_hp_applied", None) is None
        and all(torch.equal(before[n], p) for n, p in fresh.state_dict().items())
    )
    return out


def wrapper_errors() -> dict[str, str]:
    """Errors raised by the wrappers and the loss at run time (cp=2, production)."""
    from hp_plugin_cp import CPCausalLMLoss, CPLayout

    mesh = _mesh((2,), ("cp",))
    cp_mesh = mesh["cp"]
    m = family_model("llama")
    apply(m, plan(m, mesh, overrides=doc_yaml()), mesh)
    full = full_batch(0, pad=True)
    good = shard_batch_for_cp(full, cp_mesh)
    rank = cp_mesh.get_local_rank()
    out = {
        "local_mask_without_layout": _try(
            lambda: m(
                input_ids=good["input_ids"],
                attention_mask=torch.ones(2, 8, dtype=torch.long).tril(),
                use_cache=False,
            )
        ),
        "wrong_rank_layout": _try(
            lambda: m(**{**good, "hp_cp": CPLayout(2, 1 - rank, 16)}, use_cache=False)
        ),
        "not_a_layout": _try(lambda: m(**{**good, "hp_cp": "lb"}, use_cache=False)),
        "length_mismatch": _try(
            lambda: m(**{**good, "hp_cp": CPLayout(2, rank, 32)}, use_cache=False)
        ),
    }

    def with_filled_cache() -> None:
        first = m(**good, use_cache=True)
        m(**good, use_cache=True, cache=first.cache)

    out["kv_cache"] = _try(with_filled_cache)
    lb = build_model("llama", seed=0)
    lb_override = [
        {
            "match": "*.self_attn",
            "inner_target": "self",
            "region_dispatch": False,
            "inner_wrapper": {"_target_": "sdpa_hf", "load_balanced": True},
        }
    ]
    apply(lb, plan(lb, mesh, overrides=lb_override), mesh)
    out["config_layout_mismatch"] = _try(lambda: lb(**good, use_cache=False))
    odd = shard_batch_for_cp(
        full_batch(0, pad=False, seq=10), cp_mesh
    )  # 10 tokens: not 4 load-balanced chunks
    out["lb_odd_local_without_layout"] = _try(
        lambda: lb(input_ids=odd["input_ids"], position_ids=odd["position_ids"], use_cache=False)
    )
    no_shift = {k: v for k, v in good.items() if k not in ("shift_labels", "num_items_in_batch")}
    enable_cp_loss(m, cp_mesh)
    enable_cp_loss(m, cp_mesh)  # idempotent
    out["loss_wrapped_once"] = str(not isinstance(m.loss_function.base, CPCausalLMLoss))
    out["loss_without_shift_labels"] = _try(lambda: m(**no_shift, use_cache=False))
    counted = {k: v for k, v in good.items() if k != "num_items_in_batch"}
    ref = family_model("llama")
    with torch.no_grad():
        gap = allclose_excess(
            m(**counted, use_cache=False).loss, ref(**full, use_cache=False).loss, rtol=0.0
        )
    out["loss_counts_itself"] = str(gap < 1e-5)  # NaN-safe: a NaN loss is an infinite gap
    return out


# ------------------------------------------------ wrappers called directly


class NoFlagAttention(nn.Module):
    """HF-style but without an ``is_causal`` attribute: the SDPA call's flag decides."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)


class MaskingAttention(nn.Module):
    """Builds its own mask from the local chunk (which CP cannot honour)."""

    is_causal = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool)
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


class SlidingAttention(NoFlagAttention):
    sliding_window = 4


class FlexMaskAttention(nn.Module):
    """Calls transformers' flex entry point with a block mask of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import transformers.integrations.flex_attention as hf_flex

        return hf_flex.compile_friendly_flex_attention(x, x, x, block_mask=torch.ones(1, 1, 8, 8))


class Incomparable:
    def __eq__(self, other: object) -> bool:
        raise TypeError("no comparison")

    __hash__ = object.__hash__


class TwoArgCore(nn.Module):
    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return q


class ExtraArgCore(nn.Module):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        temperature: float = 1.0,
        tag: Any = None,
    ) -> torch.Tensor:
        return q


def direct_wrapper_checks() -> dict[str, Any]:
    """The wrappers bound by hand (as apply would) on modules no plan covers: edge paths."""
    from hp_plugin_cp import CPLayout, flex_hf, flex_qkv, sdpa_hf, sdpa_qkv

    mesh = _mesh((2,), ("cp",))
    cp_mesh = mesh["cp"]
    rank = cp_mesh.get_local_rank()
    ctx = {"ctx": ParallelContext.from_mesh(mesh)}
    here = slice(rank * 8, (rank + 1) * 8)
    res: dict[str, Any] = {}

    # an HF attention, is_causal=False passed by the caller, attention_mask passed positionally
    model = family_model("llama")
    attn = model.model.layers[0].self_attn
    torch.manual_seed(5)
    x = torch.randn(2, 16, 64)
    cos, sin = model.model.rotary_emb(x, torch.arange(16)[None])
    with torch.no_grad():
        expected, _ = attn(x, (cos, sin), None, is_causal=False)
        fwd = sdpa_hf(target_module=attn, **ctx)
        got, _ = fwd(
            x[:, here],
            (cos[:, here], sin[:, here]),
            None,
            hp_cp=CPLayout(2, rank, 16),
            is_causal=False,
        )
    res["hf_noncausal"] = allclose_excess(gather_sequence(got, cp_mesh), expected)
    res["hf_unbound_name"] = _try(
        lambda: fwd(
            x[:, here], (cos[:, here], sin[:, here]), torch.ones(2, 1, 8, 8, dtype=torch.bool)
        )
    )

    # no is_causal attribute: the call's is_causal decides
    heads = torch.randn(2, 4, 16, 8)
    with torch.no_grad():
        got = sdpa_hf(target_module=NoFlagAttention(), **ctx)(heads[:, :, here])
    res["hf_call_flag"] = allclose_excess(
        gather_sequence(got, cp_mesh, seq_dim=2),
        F.scaled_dot_product_attention(heads, heads, heads, is_causal=True),
    )
    res["hf_inner_mask"] = _try(
        lambda: sdpa_hf(target_module=MaskingAttention(), **ctx)(heads[:, :, here])
    )
    res["hf_sliding_window"] = _try(lambda: sdpa_hf(target_module=SlidingAttention(), **ctx))
    res["hf_flex_block_mask"] = _try(
        lambda: flex_hf(target_module=FlexMaskAttention(), **ctx)(heads[:, :, here])
    )

    # qkv: config causal=False overrides the core's default; bad cores and arguments
    core = SDPACore()
    with torch.no_grad():
        got = sdpa_qkv(target_module=core, causal=False, **ctx)(
            heads[:, :, here], heads[:, :2, here], heads[:, :2, here]
        )
    res["qkv_noncausal"] = allclose_excess(
        gather_sequence(got, cp_mesh, seq_dim=2),
        F.scaled_dot_product_attention(heads, heads[:, :2], heads[:, :2], enable_gqa=True),
    )
    additive = torch.zeros(1, 1, 16, 16, dtype=torch.float64).masked_fill(
        ~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf")
    )
    with torch.no_grad():  # a float64 additive global mask for float32 queries: narrowed and cast
        got = sdpa_qkv(target_module=core, causal=False, **ctx)(
            heads[:, :, here], heads[:, :, here], heads[:, :, here], attn_mask=additive
        )
    res["qkv_additive_mask"] = allclose_excess(
        gather_sequence(got, cp_mesh, seq_dim=2),
        F.scaled_dot_product_attention(heads, heads, heads, is_causal=True),
    )
    res["qkv_two_args"] = _try(lambda: sdpa_qkv(target_module=TwoArgCore(), **ctx))
    extra = sdpa_qkv(target_module=ExtraArgCore(), **ctx)
    local = heads[:, :, here]
    res["qkv_default_extra_ok"] = _try(
        lambda: extra(local, local, local, temperature=1.0, tag=None)
    )
    res["qkv_extra_arg"] = _try(lambda: extra(local, local, local, temperature=2.0))
    res["qkv_extra_tensor_arg"] = _try(lambda: extra(local, local, local, tag=torch.ones(1)))
    res["qkv_extra_incomparable_arg"] = _try(lambda: extra(local, local, local, tag=Incomparable()))
    res["flex_qkv_block_mask"] = _try(
        lambda: flex_qkv(target_module=FlexCore(), **ctx)(
            local, local, local, block_mask=torch.ones(1)
        )
    )
    return res


def loss_parallel_check() -> dict[str, float]:
    """cp=2 x tp=2 with a vocab-parallel loss: enable_cp_loss wraps it; loss and grads match."""
    from torch.distributed.tensor import Shard

    from hp_core.testing.compare import full_tensor

    mesh = _mesh((2, 2), ("cp", "tp"))
    base = family_model("llama")
    ref, m = copy.deepcopy(base), copy.deepcopy(base)
    apply(m, plan(m, mesh, overrides=doc_yaml(), loss_parallel=True), mesh)
    enable_cp_loss(m, mesh["cp"])
    full = full_batch(50, pad=True)
    expected = ref(**full, use_cache=False)
    expected.loss.backward()
    out = m(**shard_batch_for_cp(full, mesh["cp"], load_balanced=True), use_cache=False)
    out.loss.backward()
    logits = gather_sequence(
        full_tensor(out.logits, {"tp": Shard(2)}, mesh), mesh["cp"], load_balanced=True
    )
    got = (out.loss.detach(), logits, gather_full_grads(m, ref, mesh))
    return {
        **run_excess(
            got, (expected.loss.detach(), expected.logits.detach(), _ref_grads(ref)), rtol=RTOL
        ),
        "vocab_parallel": float(type(m.loss_function.base).__name__ == "VocabParallelCausalLMLoss"),
    }
