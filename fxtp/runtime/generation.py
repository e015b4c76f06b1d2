"""Generation on a compiled Hugging Face causal LM, with a KV cache sharded by kv heads.

NOTE: [generation]
``pm.generate(input_ids, max_new_tokens=N)`` decodes like Hugging Face's ``model.generate``
(greedy, or sampling with temperature / top-k / top-p) on the tensor-parallel model:

* The cache is transformers' ``StaticCache`` inside its own export recipe,
  ``transformers.integrations.executorch.TorchExportableModuleWithStaticCache``: per layer a key
  and a value tensor of shape (batch, kv_heads, max_cache_len, head_dim), written in place by
  ``index_copy_`` at ``cache_position``, its kv heads those the attentions write, not the
  config's (NOTE: [cache shapes from the writes] in fxtp/runtime/static_cache.py). fxtp
  compiles that wrapper once per (batch, max_cache_len) with a dynamic sequence length in [1,
  max_cache_len], so the prompt (prefill) and every new token (decode) run one graph: no
  capture per token or per prompt length.
* The planner stores each cache tensor in the layout its k/v projection writes (NOTE: [sharded
  state] in passes/rules/variants.py): a rank keeps its kv heads' part of the cache (1/ws of it
  when the kv heads divide world_size). Where the kv projections stay whole (2 kv heads on 4
  ranks, MQA), a rank keeps the kv heads its query heads attend with (NOTE: [kv heads kept by
  the ranks that need them] in passes/kv_heads.py, a pass only the decoder's compile runs): 2
  kv heads on 4 ranks, half the cache each. ``cache_bytes`` is what the rank holds.
* The decoder is built from the model's config with its parameters on the ``meta`` device, so
  it allocates no weights, and is traced on ``meta`` (its cache too; the graph's device literals
  are normalized, ``passes/normalize.py``). It then takes the compiled module's own parameter
  shards and buffers (one copy in memory; an optimizer step on ``pm`` is what ``generate``
  sees). Only its cache is allocated, zeroed at the start of every ``generate``.
* Every rank computes the same logits (the head's all_gather); the next token is chosen on the
  group's rank 0 and broadcast, so every rank appends the same token, sampling included.

* Padded prompts (NOTE: [padded prompts]): a batch of prompts of different lengths comes
  left-padded with an ``attention_mask`` (0 on padding), as Hugging Face's tokenizers make it
  for decoder-only models. Such a batch runs a second decoder per (batch, max_cache_len) that
  takes the mask and the positions too: ``position_ids`` as ``model.generate`` derives them
  (``attention_mask.cumsum(-1) - 1``, 1 on padding, then one more per new token), and the mask
  over the whole cache (the prompt's, then ones: the causal mask hides what is not written
  yet), one static tensor for every step. Right padding is refused (``model.generate`` warns
  that it gives wrong results for decoder-only models); beam search (``num_beams > 1``) too.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.export import Dim

from fxtp.core.errors import FxtpInputError, FxtpPlanError
from fxtp.runtime import static_cache
from fxtp.runtime.layout import tp_group

__all__ = ["Generation", "generation_for", "CACHE_ROUNDING"]

CACHE_ROUNDING = 256  # a default max_cache_len is the needed length rounded up to this (then capped)


@dataclass
class Generation:
    """What ``pm.generate`` needs from the original model: its class and configs (no weights),
    and the decoders compiled so far, keyed by (batch, max_cache_len)."""

    model_class: type
    config: Any
    generation_config: Any
    compile: Callable[..., nn.Module]  # fxtp.compile, passed in by fxtp.api (no import cycle)
    decoders: dict[tuple[int, int], nn.Module] = field(default_factory=dict)
    padded: dict[tuple[int, int], nn.Module] = field(default_factory=dict)  # NOTE: [padded prompts]

    def __deepcopy__(self, memo):  # a deepcopy of pm recompiles its decoders on first use
        return Generation(self.model_class, copy.deepcopy(self.config, memo), copy.deepcopy(self.generation_config, memo),
                          self.compile)


def generation_for(model: nn.Module, compile_fn: Callable[..., nn.Module]) -> Optional[Generation]:
    """A :class:`Generation` for a Hugging Face ``GenerationMixin`` causal LM, else ``None``."""
    if not callable(getattr(model, "generate", None)) or getattr(model, "generation_config", None) is None:
        return None
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None  # encoder-decoder models (T5, BART) need an encoder pass: not supported
    return Generation(type(model), copy.deepcopy(config), copy.deepcopy(model.generation_config), compile_fn)


def generate(
    pm: nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_token_id: Union[int, Sequence[int], None] = None,
    pad_token_id: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
    max_cache_len: Optional[int] = None,
    num_beams: Optional[int] = None,
) -> torch.Tensor:
    """See :meth:`fxtp.runtime.module.ParallelModule.generate` and NOTE: [generation]."""
    gen: Optional[Generation] = pm._generation
    if gen is None:
        raise FxtpInputError(
            "generate needs a Hugging Face causal LM (a GenerationMixin such as LlamaForCausalLM) compiled with "
            "fxtp.compile; this module is not one. fix: for another model, compile its decode step with a static "
            "cache buffer written in place (README 'Inference') and loop over it yourself"
        )
    batch, length = _check_prompt(input_ids, attention_mask, max_new_tokens)
    beams = num_beams if num_beams is not None else getattr(gen.generation_config, "num_beams", 1) or 1
    if beams != 1:
        raise FxtpInputError(
            f"generate: num_beams={beams} (beam search{'' if num_beams is not None else ', from the generation_config'}) "
            "is not supported: fxtp decodes greedily or by sampling. fix: pass num_beams=1 (with do_sample=True to "
            "sample), or run beam search with model.generate"
        )
    padded = attention_mask is not None and not bool((attention_mask == 1).all())
    needed = length + max_new_tokens
    field_name = next((f for f in ("max_position_embeddings", "n_positions") if getattr(gen.config, f, None)), None)
    limit = getattr(gen.config, field_name) if field_name else None
    if limit is not None and needed > limit:
        raise FxtpInputError(
            f"generate: prompt length {length} + max_new_tokens {max_new_tokens} = {needed} exceeds the model's "
            f"{limit} positions (config.{field_name}). fix: a shorter prompt or fewer new tokens"
        )
    if max_cache_len is not None and max_cache_len < needed:
        raise FxtpInputError(f"generate: max_cache_len {max_cache_len} < prompt length + max_new_tokens = {needed}")
    cfg = gen.generation_config
    eos = _as_list(eos_token_id if eos_token_id is not None else cfg.eos_token_id)
    pad = pad_token_id if pad_token_id is not None else cfg.pad_token_id
    if pad is None and eos:
        pad = eos[0]  # as Hugging Face's generate does
    if attention_mask is None and pad is not None and pad not in eos and bool((input_ids == pad).any()):
        # Hugging Face's generate would infer a mask hiding these tokens (pad != eos): not this decoder.
        raise FxtpInputError(
            f"generate: the prompt holds the pad token {pad}, which model.generate would mask out as padding; "
            "fxtp's static cache has no padding. fix: pass attention_mask=torch.ones_like(input_ids) if those "
            "tokens are real, or generate unpadded prompts"
        )
    pick = _picker(cfg, do_sample, temperature, top_k, top_p)
    decoder, cache_len = _decoder(pm, gen, batch, needed, max_cache_len, limit, padded)  # compiled on first use, then kept
    group = tp_group(pm)
    for key in decoder.written_state:  # a fresh cache (and its length counters)
        decoder.get_buffer(key).zero_()
    ids = input_ids
    unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    eos_t = torch.tensor(eos, device=input_ids.device) if eos else None
    extra: dict[str, torch.Tensor] = {}
    if padded:  # NOTE: [padded prompts]
        mask = attention_mask.to(torch.long)
        whole = torch.ones(batch, cache_len, dtype=torch.long, device=input_ids.device)
        whole[:, :length] = mask
        extra = {"attention_mask": whole, "position_ids": (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)}
        next_position = mask.sum(-1, keepdim=True)
    with torch.no_grad():
        logits = decoder(input_ids=input_ids, cache_position=torch.arange(length, device=input_ids.device), **extra)
        for step in range(max_new_tokens):
            token = pick(ids, logits[:, -1, :].float())
            if group is not None:
                dist.broadcast(token, group=group, group_src=0)
            if eos_t is not None:
                token = torch.where(unfinished, token, torch.full_like(token, pad))
                unfinished &= ~torch.isin(token, eos_t)
            ids = torch.cat([ids, token[:, None]], dim=1)
            if not bool(unfinished.any()) or step == max_new_tokens - 1:
                break
            position = torch.tensor([length + step], device=input_ids.device)
            if padded:
                extra["position_ids"] = next_position + step
            logits = decoder(input_ids=token[:, None], cache_position=position, **extra)
    return ids


def cache_bytes(pm: nn.Module) -> int:
    """Bytes of the KV caches of ``pm``'s decoders on this rank (0 before the first ``generate``)."""
    gen: Optional[Generation] = pm._generation
    if gen is None:
        return 0
    decoders = [*gen.decoders.values(), *gen.padded.values()]
    return sum(d.get_buffer(key).nbytes for d in decoders for key in d.written_state)


def _check_prompt(input_ids: Any, attention_mask: Any, max_new_tokens: Any) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        got = f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise FxtpInputError(f"generate: input_ids must be a (batch, length) int64 tensor, got {got}")
    if input_ids.shape[1] < 1:
        raise FxtpInputError("generate: an empty prompt; give at least one token")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise FxtpInputError(f"generate: attention_mask must be shaped like input_ids {tuple(input_ids.shape)}, got {got}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise FxtpInputError("generate: attention_mask must hold 0 (padding) and 1 (a token) only")
        if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()) or not bool(attention_mask[:, -1].all()):
            raise FxtpInputError(
                "generate: the attention_mask pads some prompt on the right (or a prompt is all padding): a "
                "decoder-only model continues the last token, so prompts must be padded on the left. fix: "
                "tokenizer.padding_side = 'left' (NOTE: [padded prompts])"
            )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise FxtpInputError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    return int(input_ids.shape[0]), int(input_ids.shape[1])


def _as_list(value: Union[int, Sequence[int], None]) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _picker(cfg: Any, do_sample: bool, temperature, top_k, top_p) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The next-token choice: argmax, or Hugging Face's temperature / top-k / top-p warpers (in
    ``generate``'s order, defaults from the model's ``generation_config``) and a multinomial draw."""
    if not do_sample:
        return lambda ids, scores: scores.argmax(dim=-1)
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    temperature = _setting(temperature, cfg, "temperature")
    top_k = _setting(top_k, cfg, "top_k")
    top_p = _setting(top_p, cfg, "top_p")
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))

    def sample(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(warpers(ids, scores), dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)

    return sample


# What Hugging Face's generate uses when neither the call nor the model's generation_config sets a
# value (transformers 5: GenerationConfig._get_default_generation_params).
_HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def _setting(given: Any, cfg: Any, name: str) -> Any:
    if given is not None:
        return given
    value = getattr(cfg, name, None)
    return _HF_DEFAULTS[name] if value is None else value


def _decoder(pm: nn.Module, gen: Generation, batch: int, needed: int, max_cache_len: Optional[int], limit: Optional[int],
             padded: bool) -> tuple[nn.Module, int]:
    """A compiled static-cache decoder for ``batch`` prompts of up to ``needed`` positions (one
    that takes a mask with ``padded``) and its cache length: one already compiled for this batch
    if its cache is long enough, else a new one."""
    decoders = gen.padded if padded else gen.decoders
    if max_cache_len is None:
        for (b, length), decoder in decoders.items():
            if b == batch and length >= needed:
                return decoder, length
        max_cache_len = CACHE_ROUNDING * math.ceil(needed / CACHE_ROUNDING)
        if limit is not None:
            max_cache_len = min(max_cache_len, limit)
    key = (batch, max_cache_len)
    if key not in decoders:
        decoders[key] = _compile_decoder(pm, gen, batch, max_cache_len, padded)
    return decoders[key], max_cache_len


def _with_mask(base: type) -> type:
    """transformers' static-cache export wrapper, taking an attention mask and positions too
    (NOTE: [padded prompts]); its ``forward`` is the wrapper's own but for passing those on."""

    class MaskedStaticCacheDecoder(base):  # type: ignore[misc, valid-type]
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    cache_position: torch.Tensor) -> torch.Tensor:
            for layer in self.static_cache.layers:
                layer.cumulative_length.copy_(cache_position[0])
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=self.static_cache, use_cache=True).logits

    return MaskedStaticCacheDecoder


def _compile_decoder(pm: nn.Module, gen: Generation, batch: int, max_cache_len: int, padded: bool = False) -> nn.Module:
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    param = next(pm.parameters())
    config = copy.deepcopy(gen.config)
    config.use_cache = True
    with _parameters_on_meta():  # buffers real (rotary tables), then pm's own
        model = gen.model_class(config)
    model.to(param.dtype).eval()
    model.generation_config = copy.deepcopy(gen.generation_config)
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    cls = _with_mask(TorchExportableModuleWithStaticCache) if padded else TorchExportableModuleWithStaticCache
    wrapper = cls(model, batch_size=batch, max_cache_len=max_cache_len, device="meta")
    static_cache.fit_cache_to_writes(wrapper.static_cache, model, batch)  # NOTE: [cache shapes from the writes]
    # The graph reads and writes the cache through the StaticCache object, which export lifts as
    # constants (those fxtp stores sharded); the wrapper's registrations of the same tensors would
    # be extra graph inputs no op uses, each a whole cache to allocate.
    wrapper._buffers.clear()
    seq = Dim("seq", min=1, max=max_cache_len)
    # The mask meets the meta model's values in elementwise ops, which want one device: a padded
    # decoder is traced on meta inputs (its graph runs on any device, passes/normalize.py).
    device = "meta" if padded else param.device
    example = {
        "input_ids": torch.zeros(batch, 2, dtype=torch.long, device=device),
        "cache_position": torch.arange(2, device=device),
    }
    shapes: dict[str, Any] = {"input_ids": {1: seq}, "cache_position": {0: seq}}
    if padded:
        example["attention_mask"] = torch.ones(batch, max_cache_len, dtype=torch.long, device=device)
        example["position_ids"] = torch.zeros(batch, 2, dtype=torch.long, device=device)
        shapes |= {"attention_mask": None, "position_ids": {1: seq}}
    decoder = gen.compile(
        wrapper, pm._world_size, (), example_kwargs=example, rank=pm._rank, group=tp_group(pm), dynamic_shapes=shapes,
        # What pm keeps whole the decoder keeps whole (its graph may shard more: another GQA path);
        # the rest its planner lays out as pm's did, which _share_weights checks. Expert-parallel
        # blocks stay so (NOTE: [expert parallelism]).
        plan={f"model.{layer}": style for layer, style in pm.report.plan.items() if style in ("replicate", "expert")},
    )
    _share_weights(pm, decoder)
    _allocate_cache(decoder, param.device)
    return decoder


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on ``meta`` and their buffers real (the convention of
    accelerate's ``init_empty_weights(include_buffers=False)``, which fxtp does not depend on)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _share_weights(pm: nn.Module, decoder: nn.Module) -> None:
    """Point the decoder's parameters and buffers (``model.<fqn>``) at ``pm``'s own tensors."""
    for fqn, placement in decoder.placements.items():
        source = fqn.removeprefix("model.")
        if pm.placements.get(source) != placement:
            layer = source.rpartition(".")[0]
            style = decoder.report.plan.get(f"model.{layer}")
            force = f"plan={{{layer!r}: {style!r}}}" if style else "the plan= entry that forces the layer's style"
            raise FxtpPlanError(
                f"generate: the decoder's plan shards {source} as {placement}, the compiled module as "
                f"{pm.placements.get(source)}; they must share one set of shards. fix: pass {force} to "
                "fxtp.compile (the decoder's layout for the compiled module too), or please report this model"
            )
        decoder._register(fqn, pm.get_parameter(source))
    for fqn, buffer in list(decoder.named_buffers()):
        if not fqn.startswith("model."):
            continue  # constants lifted from the model: the cache (allocated below) and the others
        source = fqn.removeprefix("model.")
        try:
            decoder._register(fqn, pm.get_buffer(source), persistent=False)
        except AttributeError:
            if buffer.is_meta:
                raise FxtpInputError(
                    f"generate: the decoder's buffer {fqn} has no counterpart {source} in the compiled module"
                ) from None


def _allocate_cache(decoder: nn.Module, device: torch.device) -> None:
    """Real (zero) tensors for the cache the meta decoder holds; any other meta constant is an error."""
    for key, value in list(decoder.named_buffers()):
        if not value.is_meta:
            continue
        if key not in decoder.written_state:
            target = decoder._constant_targets.get(key, key)
            raise FxtpInputError(f"generate: the decoder's tensor {target} was built on meta and is not a cache")
        owner, leaf = decoder.get_submodule(key.rpartition(".")[0]), key.rpartition(".")[2]
        owner._buffers[leaf] = torch.zeros(value.shape, dtype=value.dtype, device=device)
