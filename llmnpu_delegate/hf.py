"""Hugging Face door: ``LlmNpuForCausalLM`` — load, prepare, ``generate()``.

The prompt runs through the NPU path (chunk graphs, shadow outliers, out-of-order executor) and the
tokens after it are decoded on the CPU from the KV cache the prefill produced: the paper's split.
Decode is ``runtime/hf_decoder.Int8Decoder`` (INT8 linears with per-token dynamic scales, the K/V in a
static cache written in place) for the llama-style families, or the model's own float ``transformers``
forward (``decode="fp32"``, and the families the INT8 decoder does not cover).

``generate`` is ``transformers``' own, with every argument it takes (sampling, streamers, stopping
criteria, logits processors). Only its prefill step (and, with INT8 decode, its decode forward) is
replaced, for the duration of the call. Several wrappers may share one model and generate from
several threads at once: the model's prefill and forward are routed, per thread, to the wrapper whose
``generate`` is running (a plain ``model.generate`` keeps Hugging Face's own), and the model is left
as it was when the last call ends.
"""
from __future__ import annotations

import threading
import time
import warnings
from contextlib import contextmanager

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import backends
from .chunk_step import DEFAULT_CHUNK
from .errors import LlmNpuError
from .models import DEFAULT_MODEL, LoadedModel, check_family, fingerprint, load_model
from .quantize import Calibration, QuantConfig, quant_config
from .runtime.hf_decoder import DecodeCache, Int8Decoder, unsupported
from .partitioner.placement import PAPER
from .runtime.engine import Prefiller
from .runtime.prefix_cache import PrefixCache

DECODE_MODES = ("auto", "int8", "fp32")


_routes = threading.local()       # this thread's running wrapper, per model id
_patch_lock = threading.Lock()
_patched: dict[int, int] = {}     # id(model) -> generate calls running on it


def _route_prefill(model: nn.Module):
    """The ``_prefill`` installed on a model while some wrapper generates with it."""
    original = type(model)._prefill.__get__(model)

    def prefill(*args, **kwargs):
        wrapper = getattr(_routes, "by_model", {}).get(id(model))
        return wrapper._prefill(*args, **kwargs) if wrapper is not None else original(*args, **kwargs)

    return prefill


def _route_forward(model: nn.Module):
    """The ``forward`` installed on a model while some wrapper generates with it: a decode step on an
    INT8 wrapper's own cache goes to its decoder, everything else to the model's forward."""
    original = type(model).forward.__get__(model)

    def forward(*args, **kwargs):
        wrapper = getattr(_routes, "by_model", {}).get(id(model))
        cache = kwargs.get("past_key_values")
        if wrapper is not None and wrapper.decoder is not None and isinstance(cache, DecodeCache):
            return wrapper._decode(*args, **kwargs)
        return original(*args, **kwargs)

    return forward


def extend_hf_cache(cache, result, start: int = 0) -> None:
    """Put a prefill's K/V from token ``start`` on into a transformers cache that holds the tokens
    before it (its layers crop sliding windows as HF does)."""
    for layer, (k, v) in enumerate(zip(result.past_k, result.past_v)):
        cache.update(k[:, :, start:], v[:, :, start:], layer)


def cache_past(cache, length: int) -> tuple[list, list]:
    """The first ``length`` tokens' K/V of a transformers cache (dynamic or static), per layer
    [1, KVH, length, d], for a prefill that continues it."""
    keys, values = [], []
    for layer in cache.layers:
        if layer.keys is None or layer.keys.shape[2] < length:
            raise LlmNpuError("past_key_values holds fewer tokens than its length in some layer (a sliding "
                              "window): pass the whole conversation without past_key_values, and the "
                              "wrapper's prefix cache reuses what it can")
        keys.append(layer.keys[:, :, :length])
        values.append(layer.values[:, :, :length])
    return keys, values


class LlmNpuForCausalLM:
    """A causal LM whose prompts are prefilled on the (stand-in) NPU and decoded on the CPU.

    Args:
        model: a ``LoadedModel`` (``load_model(...)``) or a ``transformers`` causal LM.
        tokenizer: the model's tokenizer (taken from a ``LoadedModel`` when not given).
        chunk_len, backend, quant, calibration, policy, placement, npu_kv_bits: as for ``Prefiller`` (placement
            ``"auto"``: the fastest on this machine, chosen once and cached; ``llmnpu run`` and ``chat``
            default to it).
        pruning_rate, clip_percentile: the shadow outlier knobs (default "auto": quantize/auto.py, and the
            99.5th percentile).
        decode: ``"int8"`` (``runtime/hf_decoder.Int8Decoder``), ``"fp32"`` (the model's own float forward,
            token for token Hugging Face's decode) or ``"auto"`` (default: INT8 where the family allows
            it and the prefill is quantized, else fp32).
        prefix_cache: ``True`` (default: an in-memory ``PrefixCache`` of the default budget), ``False``
            (none), or a ``PrefixCache`` (e.g. one with a folder on disk): a prompt that starts like an
            earlier one, e.g. a chat's whole history again, prefills only what follows the cached part.

    Calibration artefacts and compiled graphs are cached on disk, so a second start is fast. A
    conversation continues either way transformers users know: ``generate(whole_ids,
    past_key_values=previous.past_key_values)`` (the previous call's cache, with
    ``return_dict_in_generate=True``), or the whole history again, served by the prefix cache.
    """

    def __init__(self, model: LoadedModel | nn.Module, tokenizer=None, *, chunk_len: int = DEFAULT_CHUNK,
                 backend: str = backends.DEFAULT, quant: QuantConfig | str | None = "w8a8-shadow",
                 pruning_rate: float | None = None, clip_percentile: float | None = None,
                 calibration: Calibration | None = None, policy: str = "ooo", decode: str = "auto",
                 prefix_cache: PrefixCache | bool = True, progress: bool = True, placement: str = PAPER,
                 npu_kv_bits: int = 16):
        if decode not in DECODE_MODES:
            raise LlmNpuError(f"unknown decode mode '{decode}': use one of {', '.join(DECODE_MODES)}")
        if not isinstance(model, LoadedModel):
            if not (isinstance(model, nn.Module) and hasattr(model, "config") and hasattr(model, "generate")):
                raise LlmNpuError(f"expected a transformers causal LM or load_model(...), got {type(model).__name__}")
            check_family(model.config)
            model = LoadedModel(getattr(model.config, "name_or_path", "") or "<model>", model.eval(), tokenizer,
                                fingerprint(model))
        self.loaded = model
        self.model = model.model
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        if prefix_cache is True:
            prefix_cache = PrefixCache()
        elif prefix_cache is False:
            prefix_cache = None
        elif not isinstance(prefix_cache, PrefixCache):
            raise LlmNpuError(f"prefix_cache must be True, False or a PrefixCache, got {type(prefix_cache).__name__}")
        self.engine = Prefiller(model, chunk_len, backend, quant_config(quant, pruning_rate, clip_percentile),
                                calibration, placement=placement, progress=progress, policy=policy,
                                prefix_cache=prefix_cache, npu_kv_bits=npu_kv_bits)
        self.decoder = self._make_decoder(decode)
        self.last_prefill: dict = {}
        self._lock = threading.Lock()

    def _make_decoder(self, decode: str) -> Int8Decoder | None:
        reason = unsupported(self.model.config)
        if decode == "fp32" or (decode == "auto" and (reason or self.engine.quant is None)):
            return None
        if reason:
            raise LlmNpuError(f"INT8 decode does not support {reason}: use decode='fp32'")
        return Int8Decoder(self.model, "int8")

    @property
    def decode_mode(self) -> str:
        """``"int8"`` or ``"fp32"``: how tokens after the prompt are computed."""
        return "fp32" if self.decoder is None else "int8"

    @classmethod
    def from_pretrained(cls, name_or_path: str = DEFAULT_MODEL, **kwargs) -> "LlmNpuForCausalLM":
        """Load a model (``smollm2-135m``, a Hugging Face folder, a ``.gguf`` file or ``random:<shape>``)
        and prepare it; keyword arguments as for the constructor."""
        return cls(load_model(name_or_path), **kwargs)

    # transformers-like surface
    @property
    def config(self):
        return self.model.config

    @property
    def generation_config(self):
        return self.model.generation_config

    @property
    def device(self) -> torch.device:
        return self.model.device

    def __call__(self, *args, **kwargs):
        """The float model's forward (e.g. for perplexity); ``generate`` is where the NPU path runs."""
        return self.model(*args, **kwargs)

    @torch.inference_mode()
    def generate(self, *args, **kwargs):
        """``transformers``' ``generate`` with the prompt prefilled by the NPU path (batch 1, no padding).
        With ``past_key_values`` (a cache that holds the first tokens of ``input_ids``), only the
        tokens after them are prefilled."""
        with self._lock, self._npu_prefill():
            return self.model.generate(*args, **kwargs)

    @contextmanager
    def _npu_prefill(self):
        model, key = self.model, id(self.model)
        with _patch_lock:
            if _patched.get(key, 0) == 0:
                model._prefill = _route_prefill(model)   # an instance attribute shadows GenerationMixin._prefill
                model.forward = _route_forward(model)    # ... and the class's forward (nn.Module calls self.forward)
            _patched[key] = _patched.get(key, 0) + 1
        routes = _routes.__dict__.setdefault("by_model", {})
        outer = routes.get(key)
        routes[key] = self
        try:
            yield
        finally:
            if outer is None:
                routes.pop(key, None)
            else:
                routes[key] = outer
            with _patch_lock:
                _patched[key] -= 1
                if _patched[key] == 0:
                    del _patched[key]
                    del model._prefill
                    del model.forward

    def _prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration: bool = True):
        cache = model_kwargs.get("past_key_values")
        if model_kwargs.get("inputs_embeds") is not None:
            raise LlmNpuError("the NPU prefill takes token ids, not inputs_embeds")
        if cache is None:
            raise LlmNpuError("the NPU prefill hands its KV cache to the decoder: keep use_cache=True")
        if input_ids.shape[0] != 1:
            raise LlmNpuError(f"the NPU prefill runs one prompt at a time (batch 1), got {input_ids.shape[0]}")
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise LlmNpuError("the prompt has padding (zeros in attention_mask): pass the unpadded prompt")
        if generation_config.prefill_chunk_size is not None:
            warnings.warn("prefill_chunk_size is ignored: the NPU path prefills in chunks of "
                          f"{self.engine.chunk_len} (chunk_len)", stacklevel=2)
        past_len = int(cache.get_seq_length())
        # As transformers reads it: input_ids hold the cached tokens too, unless an attention mask
        # longer than them says they are the new tokens only.
        new_ids = input_ids if mask is not None and mask.shape[1] > input_ids.shape[1] else input_ids[:, past_len:]
        if new_ids.shape[1] == 0:
            raise LlmNpuError(f"past_key_values holds {past_len} tokens and input_ids {input_ids.shape[1]}: pass "
                              "the whole conversation (the cached tokens, then the new ones)")
        if past_len and self.decoder is None and not isinstance(cache, DynamicCache):
            raise LlmNpuError(f"float decode continues a DynamicCache, not a {type(cache).__name__}: pass the "
                              "previous generate's past_key_values, or none")
        t = time.perf_counter()
        if past_len:
            result = self.engine(new_ids, past=cache_past(cache, past_len))
        else:
            result = self.engine(input_ids)
        if self.decoder is not None:      # the decoder's static cache, sized for the whole generation
            cache = DecodeCache(self.model.config, max(generation_config.max_length, result.tokens + 1))
            model_kwargs["past_key_values"] = cache
            extend_hf_cache(cache, result)
        else:
            extend_hf_cache(cache, result, past_len)
        self.last_prefill = {"tokens": result.tokens, "chunks": result.chunks, "rows": result.rows,
                             "cached_tokens": result.reused,
                             "prefill_s": time.perf_counter() - t, "outlier_share": result.outlier_share}
        return CausalLMOutputWithPast(logits=result.logits[None, None], past_key_values=cache)

    def _decode(self, input_ids=None, past_key_values=None, **_):
        """One INT8 decode step in place of the model's forward (generate's other arguments — attention
        mask, positions — follow from the cache's own length)."""
        if input_ids is None or input_ids.shape != (1, 1):
            raise LlmNpuError("INT8 decode takes one new token id per step (batch 1)")
        logits = self.decoder.step(input_ids, past_key_values)
        return CausalLMOutputWithPast(logits=logits[None], past_key_values=past_key_values)


@torch.inference_mode()
def greedy_agreement(wrapper: LlmNpuForCausalLM, prompts: list[torch.Tensor], max_new_tokens: int = 24) -> dict:
    """How often the wrapper's greedy tokens match the float model's own ``generate``.

    ``free_running``: share of positions where the two greedy continuations agree (one early miss
    changes everything after it). ``teacher_forced``: share of the float continuation's tokens the
    wrapper's prefill predicts when fed the float continuation itself (its prefill, then float decode
    from that KV cache): the per-token agreement, free of that cascade. ``first_token``: prompts whose
    first generated token agrees. With INT8 decode, ``decode_teacher_forced``: from the same prefill
    and fed the same continuation, the share of steps where INT8 decode's greedy token is float
    decode's: the decoder's own agreement.
    """
    from transformers import DynamicCache

    model = wrapper.model
    forced = free = total = first = ref_tokens = decode_same = decode_steps = 0
    for ids in prompts:
        ref = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:]
        got = wrapper.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:]
        n = min(len(ref), len(got))
        free += int((ref[:n] == got[:n]).sum())
        total += max(len(ref), len(got))
        ref_tokens += len(ref)
        first += int(got[0] == ref[0])
        result = wrapper.engine(ids)
        cache = DynamicCache(config=model.config)
        extend_hf_cache(cache, result)
        pred = [result.logits.argmax().reshape(1)]
        if len(ref) > 1:
            float_steps = model(ref[None, :-1], past_key_values=cache).logits[0].argmax(-1)
            pred.append(float_steps)
            if wrapper.decoder is not None:
                static = DecodeCache(model.config, result.tokens + len(ref))
                extend_hf_cache(static, result)
                int8_steps = torch.stack([wrapper.decoder.step(t.reshape(1, 1), static)[0].argmax() for t in ref[:-1]])
                decode_same += int((int8_steps == float_steps).sum())
                decode_steps += len(ref) - 1
        forced += int((torch.cat(pred) == ref).sum())
    out = {"prompts": len(prompts), "teacher_forced": forced / ref_tokens, "free_running": free / total,
           "first_token": first / len(prompts)}
    if decode_steps:
        out["decode_teacher_forced"] = decode_same / decode_steps
    return out
