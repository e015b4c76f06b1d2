"""A Hugging Face ``config.json`` as a model on the ``meta`` device, for ``fxtp inspect``.

``fxtp inspect path/to/config.json -n 8`` (or ``fxtp inspect path/to/checkpoint -n 8``, a directory
holding a ``config.json``) plans a checkpoint's architecture before anything is downloaded: the config is parsed by ``transformers.AutoConfig.for_model`` (its ``model_type``),
the class its ``architectures`` names (else the ``AutoModelForCausalLM`` / ``AutoModel`` one for
that ``model_type``) is built under ``torch.device("meta")`` in the config's ``dtype``, so no
weight is allocated, nothing is read from disk beyond the config and nothing from the network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxtp.core.errors import FxtpConfigError, FxtpError, FxtpInputError

__all__ = ["DEFAULT_BATCH", "DEFAULT_SEQ", "example_inputs", "is_config_path", "load_config_model"]

# The example input of a text model: token ids (DEFAULT_BATCH, DEFAULT_SEQ), or the model's
# max_position_embeddings when that is shorter. They size the collectives' bytes in the report;
# --input replaces them.
DEFAULT_BATCH, DEFAULT_SEQ = 1, 128


def is_config_path(text: str) -> bool:
    """Whether MODEL ``text`` names a ``config.json`` file (by its ``.json`` suffix) or a
    directory (a checkpoint's, as ``from_pretrained`` takes it) that holds one."""
    return text.lower().endswith(".json") or (Path(text).is_dir() and (Path(text) / "config.json").is_file())


def _config_file(text: str) -> Path:
    """The ``config.json`` MODEL ``text`` names: the file itself, or the one in the directory."""
    path = Path(text)
    return path / "config.json" if path.is_dir() else path


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FxtpConfigError(f"no such file: {path} (MODEL is a Hugging Face config.json)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FxtpConfigError(f"{path} is not a readable JSON file: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise FxtpConfigError(
            f"{path} has no 'model_type': not a Hugging Face config.json "
            "(the one next to a checkpoint's weights, e.g. meta-llama/Llama-2-7b-hf/config.json)"
        )
    return data


def _build(config: Any, path: Path) -> nn.Module:
    """The model, on ``meta``: the first class of ``config.architectures`` transformers has, else
    the causal-LM (then the base) auto class of ``config.model_type``."""
    import transformers

    names = list(config.architectures or [])
    cls = next((c for c in (getattr(transformers, n, None) for n in names) if _is_model_class(c)), None)
    if names and cls is None:
        raise FxtpConfigError(
            f"{path}: transformers {transformers.__version__} has no architecture {', '.join(map(repr, names))} "
            f"(model_type {config.model_type!r}). fix: upgrade transformers, or set 'architectures' to a class "
            "transformers has (e.g. LlamaForCausalLM); models that need trust_remote_code are not supported"
        )
    with torch.device("meta"):
        if cls is not None:
            # NOTE: `_from_config` is what AutoModel*.from_config calls once it has chosen the class:
            # it applies config.dtype (and the class's fp32 modules), which `cls(config)` does not.
            return cls._from_config(config)
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):  # a causal LM, else the base model
            try:
                return auto.from_config(config)
            except ValueError:
                continue
    raise FxtpConfigError(f"{path}: transformers has no model class for model_type {config.model_type!r}; set 'architectures'")


def _is_model_class(obj: Any) -> bool:
    from transformers import PreTrainedModel

    return isinstance(obj, type) and issubclass(obj, PreTrainedModel)


def load_config_model(text: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Build the model a ``config.json`` describes, on ``meta``, with example inputs.

    Returns:
        ``(model, args, kwargs)``: the model in eval mode with ``use_cache=False`` (a KV cache
        is not a tensor output, as in :mod:`fxtp.cli.examples`), weights on ``meta`` in the config's
        ``dtype``; the inputs of :func:`example_inputs`.

    Raises:
        FxtpConfigError: a missing or malformed file, a ``model_type`` or an architecture
            transformers does not know (the message names it).
        ModuleNotFoundError: transformers is not installed (the caller names the extra).
    """
    from transformers import AutoConfig

    path = _config_file(text)
    data = _read(path)
    model_type = data.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError):
        import transformers

        raise FxtpConfigError(
            f"{path}: transformers {transformers.__version__} does not know model_type {model_type!r}. "
            "fix: upgrade transformers, or check the file; models that need trust_remote_code are not supported"
        ) from None
    if hasattr(config, "use_cache"):
        config.use_cache = False
    try:
        model = _build(config, path).eval()
    except (FxtpError, ModuleNotFoundError):
        raise
    except Exception as exc:  # noqa: BLE001 - a config its own class refuses (e.g. a negative size)
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise FxtpConfigError(f"{path}: transformers cannot build it: {type(exc).__name__}: {first[:300]}. fix: check the file") from exc
    args, kwargs = example_inputs(model)
    return model, args, kwargs


def example_inputs(model: nn.Module) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Inputs on ``meta`` for a Hugging Face ``model``, from its config.

    Text models get int64 ``input_ids`` of shape ``(DEFAULT_BATCH, min(DEFAULT_SEQ,
    max_position_embeddings))`` (and as many ``decoder_input_ids`` for an encoder-decoder);
    image models ``pixel_values`` ``(DEFAULT_BATCH, num_channels, image_size, image_size)`` in the
    model's dtype.

    Raises:
        FxtpInputError: a model whose main input is neither (the message says to pass --input).
    """
    config = model.config
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        limits = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions")]
        seq = min([DEFAULT_SEQ] + [n for n in limits if isinstance(n, int) and n > 0])
        ids = torch.zeros(DEFAULT_BATCH, seq, dtype=torch.long, device="meta")
        kwargs = {"decoder_input_ids": ids} if getattr(config, "is_encoder_decoder", False) else {}
        return (ids,), kwargs
    if name == "pixel_values":
        size, channels = getattr(config, "image_size", 224), getattr(config, "num_channels", 3)
        size = size if isinstance(size, int) else size[0]
        dtype = next(model.parameters()).dtype
        return (torch.zeros(DEFAULT_BATCH, channels, size, size, dtype=dtype, device="meta"),), {}
    raise FxtpInputError(
        f"{type(model).__name__} takes {name!r}, for which fxtp makes no example input: "
        "pass --input SPEC per positional input, e.g. --input 1x16000"
    )
