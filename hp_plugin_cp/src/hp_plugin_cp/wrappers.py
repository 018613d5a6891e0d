"""The four CP inner wrappers: ``sdpa_qkv``, ``sdpa_hf``, ``flex_qkv``, ``flex_hf``.

* ``*_qkv`` replace the forward of a module called as ``(q, k, v, ...)`` (an attention
  core taking SDPA-layout tensors) with CP attention.
* ``*_hf`` wrap a Hugging Face-style attention module: its own forward runs (projections,
  rotary, reshapes), and the one SDPA / flex-attention call it makes is intercepted, for
  the duration of that forward only, and replaced by CP attention. A forward that makes no
  such call is an error (:class:`~hp_plugin_cp.errors.CPMisfireError`).

SDPA calls are caught with a ``TorchFunctionMode`` (thread-local, popped on exit even
when the forward raises). Flex attention is not a torch function, so ``flex_hf`` catches
the function through which transformers calls it
(``transformers.integrations.flex_attention.compile_friendly_flex_attention``) with a
shim that is installed only while some ``flex_hf`` forward runs and dispatches only the
calls made on that forward's thread.

Every wrapper requires an active cp axis and ``region_dispatch: false`` (it communicates).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hp_core.injection import inner_wrapper
from hp_plugin_cp.attention import cp_flex_attention, cp_sdpa, user_mask_error
from hp_plugin_cp.binding import Binding, module_name
from hp_plugin_cp.errors import CPConfigError, CPMisfireError, CPUnsupportedError
from hp_plugin_cp.layout import CP_LAYOUT_KEY

if TYPE_CHECKING:
    from hp_core.context import ParallelContext

__all__ = ["flex_hf", "flex_qkv", "sdpa_hf", "sdpa_qkv"]

_HF_FLEX = ("transformers.integrations.flex_attention", "compile_friendly_flex_attention")


# --------------------------------------------------------------------- _qkv

_SDPA_ARGS = {
    "attn_mask": "mask",
    "attention_mask": "mask",
    "mask": "mask",
    "is_causal": "is_causal",
    "scale": "scale",
    "scaling": "scale",
    "dropout_p": "dropout",
    "dropout": "dropout",
    "enable_gqa": "gqa",
}
_FLEX_ARGS = {
    "score_mod": "score_mod",
    "block_mask": "block_mask",
    "scale": "scale",
    "enable_gqa": "gqa",
    "kernel_options": "kernel_options",
    "return_lse": "return_lse",
    "return_aux": "return_aux",
    "is_causal": "is_causal",
}


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return False
    try:
        return bool(value == default)
    except Exception:
        return False


def _qkv_forward(b: Binding, kernel: str, causal: bool | None) -> Callable[..., Any]:
    original = b.module.forward
    sig = inspect.signature(original)
    params = list(sig.parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3:
        raise CPConfigError(
            f"{b.where}: its forward{sig} has {len(positional)} positional parameter(s).\n"
            f"A {b.wrapper} target must be called as (q, k, v, ...).\n"
            "Fix: point inner_target at the attention core that takes q, k, v, or use "
            "sdpa_hf / flex_hf for an HF-style attention module."
        )
    q_name, k_name, v_name = positional[:3]
    known = _SDPA_ARGS if kernel == "sdpa" else _FLEX_ARGS
    defaults = {p.name: p.default for p in params}

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        opts: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if name in (q_name, k_name, v_name):
                continue
            role = known.get(name)
            if role is None:
                if not _is_default(value, defaults.get(name)):
                    raise CPUnsupportedError(
                        f"{b.where}: argument {name!r} of the wrapped forward is not understood "
                        f"by the CP wrapper (it knows {sorted(known)}).\n"
                        "An argument the wrapper does not know would be silently dropped.\n"
                        f"Fix: leave {name!r} at its default."
                    )
                continue
            opts[role] = value
        q, k, v = bound.arguments[q_name], bound.arguments[k_name], bound.arguments[v_name]
        is_causal = (
            causal if causal is not None else opts.get("is_causal", defaults.get("is_causal", True))
        )
        layout = b.layout(None, q.shape[-2])
        if kernel == "sdpa":
            return cp_sdpa(
                q,
                k,
                v,
                group=b.group,
                layout=layout,
                causal=bool(is_causal),
                attn_mask=opts.get("mask"),
                dropout_p=float(opts.get("dropout") or 0.0),
                scale=opts.get("scale"),
                where=b.where,
            )
        if opts.get("block_mask") is not None:
            raise CPUnsupportedError(
                f"{b.where}: the call carried a BlockMask built for the local chunk.\n"
                "A mask of the local chunk cannot hide the other ranks' keys.\n"
                "Fix: pass block_mask=None and let the wrapper build the causal mask "
                "(config key 'causal')."
            )
        returns = {k_: opts[k_] for k_ in ("return_lse", "return_aux") if opts.get(k_)}
        return cp_flex_attention(
            q,
            k,
            v,
            group=b.group,
            layout=layout,
            causal=bool(is_causal),
            score_mod=opts.get("score_mod"),
            scale=opts.get("scale"),
            kernel_options=opts.get("kernel_options"),
            returns=returns,
            where=b.where,
        )

    return forward


@inner_wrapper
def sdpa_qkv(
    target_module: nn.Module,
    ctx: ParallelContext,
    load_balanced: bool = False,
    causal: bool | None = None,
) -> Callable[..., Any]:
    """CP SDPA for a module called as ``(q, k, v, ...)`` with SDPA-layout tensors.

    Understood extra arguments (by name): ``attn_mask``/``attention_mask``/``mask`` (a
    *global* mask, narrowed here), ``is_causal``, ``scale``/``scaling``,
    ``dropout_p``/``dropout``, ``enable_gqa``. Config: ``load_balanced`` (must match how
    the batch was sharded), ``causal`` (overrides the call's ``is_causal``; default: the
    call's, else True).
    """
    return _qkv_forward(
        Binding("sdpa_qkv", target_module, ctx.cp_mesh, load_balanced), "sdpa", causal
    )


@inner_wrapper
def flex_qkv(
    target_module: nn.Module,
    ctx: ParallelContext,
    load_balanced: bool = False,
    causal: bool | None = None,
) -> Callable[..., Any]:
    """CP flex attention for a module called as ``(q, k, v, ...)`` with SDPA-layout tensors.

    Understood extra arguments: ``score_mod`` (called with global positions), ``scale``,
    ``enable_gqa``, ``kernel_options``, ``return_lse``/``return_aux``; a ``block_mask``
    must be None (the wrapper builds it). Config as for :func:`sdpa_qkv`.
    """
    return _qkv_forward(
        Binding("flex_qkv", target_module, ctx.cp_mesh, load_balanced), "flex", causal
    )


# ---------------------------------------------------------------------- _hf


class _SDPAIntercept(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` calls to ``handler`` while active."""

    def __init__(self, handler: Callable[..., Any]) -> None:
        super().__init__()
        self.handler = handler

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.handler(*args, **kwargs)
        return func(*args, **kwargs)


class _FunctionShim:
    """Replace ``module.attr`` only while at least one ``intercept()`` is open.

    The replacement sends a call to the innermost handler opened on the *calling thread*;
    calls from other threads go to the original. The original is restored when the last
    ``intercept()`` closes, including on exceptions.
    """

    def __init__(self, module: str, attr: str) -> None:
        self.module, self.attr = module, attr
        self._lock = threading.Lock()
        self._local = threading.local()
        self._open = 0
        self._original: Any = None
        self._dispatch: Any = None

    def _handlers(self) -> list[Callable[..., Any]]:
        if not hasattr(self._local, "handlers"):
            self._local.handlers = []
        return self._local.handlers

    @contextlib.contextmanager
    def intercept(self, handler: Callable[..., Any]) -> Iterator[None]:
        target = importlib.import_module(self.module)
        with self._lock:
            if self._open == 0:
                original = getattr(target, self.attr)
                handlers = self._handlers

                def dispatch(*args: Any, **kwargs: Any) -> Any:
                    active = handlers()
                    return active[-1](*args, **kwargs) if active else original(*args, **kwargs)

                self._original, self._dispatch = original, dispatch
                setattr(target, self.attr, dispatch)
            self._open += 1
        self._handlers().append(handler)
        try:
            yield
        finally:
            self._handlers().pop()
            with self._lock:
                self._open -= 1
                if self._open == 0:
                    if getattr(target, self.attr) is self._dispatch:  # nobody replaced it meanwhile
                        setattr(target, self.attr, self._original)
                    self._original = self._dispatch = None


_FLEX_SHIM = _FunctionShim(*_HF_FLEX)


def _check_no_kv_cache(b: Binding, kwargs: dict[str, Any]) -> None:
    """A filled KV cache holds local keys only, and HF then crops or extends keys silently."""
    cache = next(
        (
            kwargs[k]
            for k in ("cache", "past_key_values", "past_key_value")
            if kwargs.get(k) is not None
        ),
        None,
    )
    length = getattr(cache, "get_seq_length", None)
    if length is None:
        return
    layer = getattr(b.module, "layer_idx", None)
    if (length(layer) if layer is not None else length()) > 0:
        raise CPUnsupportedError(
            f"{b.where}: a KV cache with earlier tokens was passed.\n"
            "CP attention is for training and prefill over whole sequences (each rank's cache "
            "would hold only its own chunk).\n"
            "Fix: call the model with use_cache=False, or decode without CP."
        )


def _hf_forward(b: Binding, kernel: str) -> Callable[..., Any]:
    module = b.module
    if getattr(module, "sliding_window", None) is not None:
        raise CPUnsupportedError(
            f"{b.where}: sliding-window attention (sliding_window={module.sliding_window}).\n"
            "The CP wrappers do not support sliding-window attention.\n"
            "Fix: disable sliding_window in the model config, or leave this layer out of the "
            "override."
        )
    original = module.forward
    sig = inspect.signature(original)
    names = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    mask_pos = names.index("attention_mask") if "attention_mask" in names else None
    called = (
        "torch.nn.functional.scaled_dot_product_attention"
        if kernel == "sdpa"
        else "flex attention (transformers' compile_friendly_flex_attention)"
    )

    def forward(*args: Any, **kwargs: Any) -> Any:
        given = kwargs.pop(CP_LAYOUT_KEY, None)
        # The model-level mask was made from the local chunk only: drop it, the layout has the
        # global one.
        model_mask = kwargs.pop("attention_mask", None)
        if mask_pos is not None and mask_pos < len(args):
            model_mask, args = args[mask_pos], (*args[:mask_pos], None, *args[mask_pos + 1 :])
        elif mask_pos is not None or "attention_mask" in sig.parameters:
            kwargs["attention_mask"] = None
        if kernel == "sdpa" and given is None and isinstance(model_mask, torch.Tensor):
            raise user_mask_error(
                f"{b.where} (model-level attention_mask)", tuple(model_mask.shape)
            )
        _check_no_kv_cache(b, kwargs)
        override = kwargs.get("is_causal")
        default_causal = getattr(module, "is_causal", None)
        calls = 0

        def causal_for(call_flag: bool | None) -> bool:
            if override is not None:
                return bool(override)
            if default_causal is not None:
                return bool(default_causal)
            return True if call_flag is None else bool(call_flag)

        def sdpa(
            query: Any,
            key: Any,
            value: Any,
            attn_mask: Any = None,
            dropout_p: float = 0.0,
            is_causal: bool = False,
            scale: float | None = None,
            enable_gqa: bool = False,
        ) -> Any:
            nonlocal calls
            calls += 1
            if attn_mask is not None:
                raise user_mask_error(b.where, tuple(attn_mask.shape))
            layout = b.layout(given, query.shape[-2])
            return cp_sdpa(
                query,
                key,
                value,
                group=b.group,
                layout=layout,
                causal=causal_for(is_causal),
                dropout_p=dropout_p,
                scale=scale,
                where=b.where,
            )

        def flex(query: Any, key: Any, value: Any, training: bool = False, **kw: Any) -> Any:
            nonlocal calls
            calls += 1
            if kw.get("block_mask") is not None:
                raise user_mask_error(b.where, tuple(kw["block_mask"].shape))
            layout = b.layout(given, query.shape[-2])
            returns = {k: kw[k] for k in ("return_lse", "return_aux") if kw.get(k)}
            return cp_flex_attention(
                query,
                key,
                value,
                group=b.group,
                layout=layout,
                causal=causal_for(None),
                score_mod=kw.get("score_mod"),
                scale=kw.get("scale"),
                kernel_options=kw.get("kernel_options"),
                returns=returns,
                where=b.where,
            )

        scope = _SDPAIntercept(sdpa) if kernel == "sdpa" else _FLEX_SHIM.intercept(flex)
        with scope:
            out = original(*args, **kwargs)
        if calls == 0:
            impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
            hint = f" The model's attn_implementation is {impl!r}." if impl is not None else ""
            want = "sdpa" if kernel == "sdpa" else "flex_attention"
            raise CPMisfireError(
                f"{b.where}: the forward of {type(module).__name__} finished without calling "
                f"{called}.\n"
                "Nothing was gathered over cp, so its output would be silently wrong."
                f"{hint}\n"
                f"Fix: build the model with attn_implementation={want!r}, or use the wrapper that "
                f"matches its kernel ({'flex_hf' if kernel == 'sdpa' else 'sdpa_hf'}), or sdpa_qkv "
                "on its attention core."
            )
        return out

    return forward


@inner_wrapper
def sdpa_hf(
    target_module: nn.Module,
    ctx: ParallelContext,
    load_balanced: bool | None = None,
) -> Callable[..., Any]:
    """CP for an HF-style attention module that calls ``F.scaled_dot_product_attention``.

    ``load_balanced``: None (default) follows the batch's layout (contiguous without one);
    True/False must match it.
    """
    return _hf_forward(Binding("sdpa_hf", target_module, ctx.cp_mesh, load_balanced), "sdpa")


@inner_wrapper
def flex_hf(
    target_module: nn.Module,
    ctx: ParallelContext,
    load_balanced: bool | None = None,
) -> Callable[..., Any]:
    """CP for an HF-style attention module that calls flex attention through transformers.

    Needs ``transformers``; on CPU torch 2.13 runs flex attention forward only.
    """
    try:
        importlib.import_module(_HF_FLEX[0])
    except ImportError as e:
        raise CPConfigError(
            f"flex_hf on {module_name(target_module)}: {_HF_FLEX[0]} cannot be imported ({e}).\n"
            "flex_hf intercepts transformers' flex-attention call.\n"
            "Fix: install transformers, or use flex_qkv."
        ) from None
    return _hf_forward(Binding("flex_hf", target_module, ctx.cp_mesh, load_balanced), "flex")
