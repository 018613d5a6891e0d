"""``--model NAME_OR_CONFIG``: a preset, a local HF config or ``pkg.mod:factory``, turned into a
meta-device model.

Offline: a preset (:mod:`hp_core.presets`) or a ``config.json`` (a file or its folder),
read under hp's input limits. Every bad config (unreadable, over the limits, an unknown
model type, a size that is not a positive integer, heads that do not divide) and a
missing ``transformers`` is a usage error (exit 2) naming the file.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hp_core.bounded.json_reader import loads_json
from hp_core.bounded.limits import InputLimitError, read_bounded
from hp_core.cli.failure import CommandFailed, one_line
from hp_core.cli.model_factory import is_factory_path, load_factory_model
from hp_core.presets import PRESETS, UnknownModelPresetError, model_from_config, preset_config
from hp_core.spec.keywords import close_matches

__all__ = ["HF_EXTRA_INSTALL", "load_config", "load_model"]

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
#: Sizes a config may give per layer, as a list.
_PER_LAYER_SIZES = ("intermediate_size",)


def _usage(message: str) -> CommandFailed:
    return CommandFailed(2, message)


def _require_transformers() -> None:
    """``--model`` builds a transformers model: refuse (exit 2) with the install line if it
    cannot be imported."""
    try:
        importlib.import_module("transformers")
    except ImportError as e:
        raise _usage(
            f"--model needs transformers, which cannot be imported ({' '.join(str(e).split())}). "
            f"Install hp's Hugging Face extra: {HF_EXTRA_INSTALL}"
        ) from None


def _config_problem(get: Callable[[str], Any], *, has_head_dim: bool) -> str | None:
    """What is wrong with a config's sizes (``get(key)``: the value or None), or None."""
    for key in _CONFIG_SIZES:
        value = get(key)
        if value is None:
            continue
        # a per-layer list (Gemma-3n's intermediate_size): each entry is a size
        per_layer = key in _PER_LAYER_SIZES and isinstance(value, list) and bool(value)
        for i, size in enumerate(value if per_layer else [value]):
            name = f"{key}[{i}]" if per_layer else key
            if isinstance(size, bool) or not isinstance(size, int):
                return f"{name} must be a positive integer, got {type(size).__name__} {size!r}"
            if size < 1:
                return f"{name} must be a positive integer, got {size}"
    hidden, heads, kv = get("hidden_size"), get("num_attention_heads"), get("num_key_value_heads")
    if not has_head_dim and hidden and heads and hidden % heads:
        return (
            f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}); fix the "
            "sizes or set head_dim"
        )
    if heads and kv and heads % kv:
        return f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})"
    return None


def _read_config_file(file: Path) -> dict[str, Any]:
    """The JSON object of an HF ``config.json``, checked to name its model type."""
    try:
        data = loads_json(read_bounded(file), source=str(file))
    except InputLimitError as e:
        raise _usage(f"--model: {e}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _usage(f"--model: {str(file)!r} is not a readable JSON config: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise _usage(
            f"--model: {str(file)!r} has no 'model_type'; an HF config.json names its model type "
            '(e.g. "model_type": "llama").'
        )
    return dict(data)


def load_config(model: str) -> Any:
    """A preset name or a local HF config (file or folder) → a transformers config. Offline.

    Raises :class:`CommandFailed` (exit 2) for every bad config and a missing transformers.
    """
    path = Path(model)
    looks_like_path = path.exists() or model.endswith(".json") or "/" in model or "\\" in model
    if not looks_like_path:
        if model in PRESETS:
            _require_transformers()
        try:
            return preset_config(model)
        except UnknownModelPresetError as e:
            raise _usage(f"--model: {e} Or pass a path to an HF config.json.") from None
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise _usage(
            f"--model: {str(file)!r}: no such file. Pass an HF config.json (or its folder) "
            f"or a preset: {', '.join(PRESETS)}."
        )
    data = _read_config_file(file)
    problem = _config_problem(data.get, has_head_dim=data.get("head_dim") is not None)
    if problem is not None:
        raise _usage(f"--model: {str(file)!r}: {problem}.")
    _require_transformers()
    # transformers is an optional dependency (the hf extra): imported only for --model, after
    # _require_transformers has turned its absence into a usage error.
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.pop("model_type")
    cannot = f"--model: {str(file)!r}: transformers cannot build this config"
    if model_type not in CONFIG_MAPPING:
        best = close_matches(model_type, CONFIG_MAPPING.keys(), n=1)
        hint = f" Did you mean {best[0]!r}?" if best else ""
        raise _usage(
            f"{cannot}: unknown model_type {model_type!r}.{hint} (transformers "
            f"{transformers.__version__} does not know it; a newer one may.)"
        )
    try:
        config = AutoConfig.for_model(model_type, **data)
    except Exception as e:  # transformers validates with many types (ValueError, ...)
        raise _usage(f"{cannot}: {one_line(e)}") from None
    problem = _config_problem(lambda key: getattr(config, key, None), has_head_dim=True)
    if problem is not None:
        raise _usage(f"--model: {str(file)!r}: {problem}.")
    return config


def load_model(name: str) -> Any:
    """``--model``: a preset, an HF config or a ``pkg.mod:factory``
    (:mod:`~hp_core.cli.model_factory`), built on the meta device (usage errors exit 2)."""
    if is_factory_path(name) and not Path(name).exists():
        return load_factory_model(name)
    config = load_config(name)
    try:
        return model_from_config(config, device="meta")
    except Exception as e:  # any failure to build from the user's config is a bad config (exit 2)
        raise _usage(f"--model: cannot build a causal LM from {name!r}: {one_line(e)}") from None
