"""CPU decode for the Hugging Face wrapper: one token per step, INT8 linears, the prefill's K/V in place.

After the NPU prefill, the paper decodes on the CPU. Hugging Face's eager forward spends most of a
step outside arithmetic (module calls, masks, cache bookkeeping) and reads every weight in fp32:
~45 ms a token on the embedded model. ``Int8Decoder`` runs the same step as a short loop:

- every linear of a block is an INT8 GEMM (per-output-channel weights, packed once) with the token's
  own dynamic activation scale (``kernels.dynamic_linear``); the linears that read one activation
  (q/k/v, gate/up) are one GEMM. The token's few largest inputs to each linear go through float
  weight rows instead (the shadow idea, per token; ``quantize/decode_outliers.py`` holds the policy
  and its measurement); the lm_head is one more such linear;
- the K/V live in a transformers ``StaticCache``, written once by the prefill; a step writes its one
  row in place and attends over a view of the filled rows: nothing is copied per step;
- it runs with torch's threads, but a one-row GEMM does not split across them (fbgemm), so a second
  core gains nothing measurable;
- with the native kernels built (``make kernels``) the whole step is one C++ call
  (``kernels/native/decode_step.cpp``): ~45 ops a layer from Python cost ~40 % of the step.

Supported: the llama-style families (``llama``, ``qwen2``, ``mistral`` without a sliding window). Others
decode with the model's own forward (``decode="fp32"``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import StaticCache

from .. import kernels as K
from ..errors import LlmNpuError
from ..families import FAMILIES
from ..kernels.native_ops import native_available
from ..quantize.decode_outliers import OUTLIERS, outlier_rows, outliers_of
from ..quantize.linear import quantize_weight

MODES = ("int8", "bf16", "fp32")


def unsupported(config) -> str | None:
    """Why ``Int8Decoder`` cannot run this model (None when it can)."""
    family = FAMILIES.get(config.model_type)
    if family is None or not family.int8_decode:
        runs = ", ".join(n for n, f in FAMILIES.items() if f.int8_decode)
        return f"the {config.model_type} family (INT8 decode runs {runs})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding-window attention"
    if getattr(config, "hidden_act", "silu") not in ("silu", "gelu", "gelu_pytorch_tanh"):
        return f"the {config.hidden_act} activation"
    return None


class _Linear:
    """One (possibly stacked) linear of the decode step, from its float weight ``w`` [N, K] and bias.

    ``int8``: INT8 weights (per output channel, packed once) and the token's own dynamic activation
    scale. One token's few largest inputs would set that scale and leave ordinary values a handful of
    codes, so the ``outliers`` largest-magnitude inputs are taken out before quantizing and added back
    through their weight rows (W^T rows kept in bf16): the prefill's shadow path, per token.
    ``bf16``: bf16 weights (the accuracy reference). ``fp32``: the float reference.
    """

    def __init__(self, w: Tensor, b: Tensor | None, kind: str, outliers: int = 0):
        self.kind, self.bias = kind, b
        self.outliers = min(outliers, w.shape[1]) if kind == "int8" else 0
        if kind == "int8":
            w_q, w_scale = quantize_weight(w, "channel")
            self.packed = K.prepack_dynamic(w_q, w_scale, b)
            self.rows = outlier_rows(w) if self.outliers else None
        else:
            self.weight = w.to(torch.bfloat16 if kind == "bf16" else torch.float32).contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        if self.kind == "fp32":
            return F.linear(x, self.weight, self.bias)
        if self.kind == "bf16":
            y = F.linear(x.to(torch.bfloat16), self.weight).float()
            return y if self.bias is None else y.add_(self.bias)
        if not self.outliers:
            return K.dynamic_linear(x, self.packed)
        top = x[0].abs().topk(self.outliers).indices
        y = K.dynamic_linear(x.index_fill(1, top, 0.0), self.packed)
        return y.addmm_(x.index_select(1, top), self.rows.index_select(0, top).float())


def _stack(mods: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    w = torch.cat([m.weight.detach().float() for m in mods])
    if all(m.bias is None for m in mods):
        return w, None
    return w, torch.cat([m.bias.detach().float() if m.bias is not None else torch.zeros(m.out_features) for m in mods])


@dataclass
class _Block:
    norm1: Tensor          # RMSNorm weights
    qkv: _Linear
    o: _Linear
    norm2: Tensor
    gate_up: _Linear
    down: _Linear
    q_norm: Tensor | None = None     # per-head RMSNorm weights of q and k before RoPE (Qwen3)
    k_norm: Tensor | None = None


class Int8Decoder:
    """The decode step of a llama-style ``transformers`` model, INT8 (``mode="int8"``) or float
    (``mode="fp32"``, the same loop with float weights: the parity reference of the loop itself).

    Args:
        model: the float ``*ForCausalLM`` (left unchanged; its embedding and rotary module are used).
        mode: ``"int8"``; ``"bf16"`` (every linear in bf16: the accuracy reference of
            ``benchmarks/decode_accuracy.py``) or ``"fp32"``.
        outliers: per token and linear, how many of the largest inputs go through the float rows
            (``_Linear``); measured on calibration text (``benchmarks/decode_accuracy.py``).
        native: run the INT8 step as one C++ call (``kernels/native/decode_step.cpp``: the same
            INT8 kernels and SDPA, its own loops for the norms, RoPE, the outlier rows and the gated
            activation; no Python round trip per op); default: when the library is built. The
            Python loop is its reference (equal to float rounding on the test models).
    """

    def __init__(self, model: nn.Module, mode: str = "int8", outliers: int = OUTLIERS, native: bool | None = None):
        reason = unsupported(model.config)
        if reason:
            raise LlmNpuError(f"INT8 decode does not support {reason}: use decode='fp32'")
        if mode not in MODES:
            raise LlmNpuError(f"unknown decode mode '{mode}': use one of {', '.join(MODES)}")
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.act = F.silu if cfg.hidden_act == "silu" else (
            lambda x: F.gelu(x, approximate="tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"))
        base = model.model
        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.eps = base.norm.variance_epsilon
        kind = mode

        def linear(*mods: nn.Linear, outliers: int = outliers) -> _Linear:
            return _Linear(*_stack(list(mods)), kind, outliers)

        family = FAMILIES[cfg.model_type]

        def block(blk: nn.Module) -> _Block:
            mods = lambda names: [blk.get_submodule(n) for n in names]          # noqa: E731
            weight = lambda name: blk.get_submodule(name).weight.detach().float()  # noqa: E731
            return _Block(weight(family.norms[0]), linear(*mods(family.qkv)),
                          linear(*mods([family.o]), outliers=outliers if outliers_of(family, family.o) else 0),
                          weight(family.norms[1]), linear(*mods(family.gate_up)), linear(*mods([family.down])),
                          *(map(weight, family.qk_norm) if family.qk_norm else ()))

        self.blocks = [block(blk) for blk in base.layers]
        self.final_norm = base.norm.weight.detach().float()
        # the lm_head in INT8 with the outlier rows agrees with float decode as often as in bf16 on the
        # gate's prompts (0.964 both) and costs ~1 ms a token less (mkldnn's one-row bf16 GEMM is
        # compute-bound: 2.3 ms for the 49152 x 576 table)
        self.lm_head = _Linear(*_stack([model.lm_head]), mode, outliers)
        if native is None:
            native = mode == "int8" and native_available()
        if native and mode != "int8":
            raise LlmNpuError(f"the native decode step runs INT8 linears only, not mode '{mode}'")
        if native and not native_available():
            raise LlmNpuError("the native decode step needs the native kernels: build them with `make kernels`")
        self.native = self._native_step(cfg.hidden_act) if native else None

    def _native_step(self, hidden_act: str):
        act = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}[hidden_act]
        step = torch.classes.llmnpu_native.DecodeStep(self.heads, self.kv_heads, self.head_dim, self.eps, act)

        def parts(lin: _Linear) -> tuple:
            return lin.packed, lin.rows if lin.rows is not None else torch.empty(0), lin.outliers

        none = torch.empty(0)
        for b in self.blocks:
            step.add_block(b.norm1, b.norm2, *parts(b.qkv), *parts(b.o), *parts(b.gate_up), *parts(b.down),
                           none if b.q_norm is None else b.q_norm, none if b.k_norm is None else b.k_norm)
        step.set_head(self.final_norm, *parts(self.lm_head))
        return step

    @torch.inference_mode()
    def step(self, token: Tensor, cache) -> Tensor:
        """Logits [1, V] of the token after ``token`` ([1, 1] ids) at position ``cache.get_seq_length()``;
        the token's K/V are written into ``cache`` (a ``DecodeCache``) in place."""
        pos = int(cache.get_seq_length())
        size = cache.layers[0].max_cache_len
        if pos >= size:
            raise LlmNpuError(f"the decode cache holds {size} tokens and is full: "
                              "generate fewer tokens (max_new_tokens)")
        h = self.embed(token.reshape(1, 1))                                  # [1, 1, H]
        cos, sin = self.rotary(h, torch.tensor([[pos]]))                     # [1, 1, d]
        cos, sin = cos[0], sin[0]
        if self.native is not None:
            return self.native.step(h.reshape(1, self.hidden), cos, sin, pos, *cache.buffers)
        nq, nkv, d = self.heads, self.kv_heads, self.head_dim
        h = h.reshape(1, self.hidden)
        for i, b in enumerate(self.blocks):
            q, k, v = b.qkv(F.rms_norm(h, b.norm1.shape, b.norm1, self.eps)).split([nq * d, nkv * d, nkv * d], dim=-1)
            if b.q_norm is not None:
                q = F.rms_norm(q.view(nq, d), (d,), b.q_norm, self.eps)
                k = F.rms_norm(k.view(nkv, d), (d,), b.k_norm, self.eps)
            qk = _rope(torch.cat([q.reshape(nq, d), k.reshape(nkv, d)]), cos, sin)
            q, k = qk[:nq].view(1, nq, 1, d), qk[nq:].view(1, nkv, 1, d)
            keys, values = cache.layers[i].keys[:, :, :pos + 1], cache.layers[i].values[:, :, :pos + 1]
            keys[:, :, pos].copy_(k[:, :, 0])       # the token's row, in place (StaticLayer.update's
            values[:, :, pos].copy_(v.view(nkv, d))  # arange and index_copy_ cost twice as much)
            a = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
            h = h + b.o(a.view(1, nq * d))
            gate, up = b.gate_up(F.rms_norm(h, b.norm2.shape, b.norm2, self.eps)).chunk(2, dim=-1)
            h = h + b.down(self.act(gate).mul_(up))
        for layer in cache.layers:
            layer.cumulative_length.add_(1)
        return self.lm_head(F.rms_norm(h, self.final_norm.shape, self.final_norm, self.eps))


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x`` [n, d] with HF's half-split layout (``rotate_half``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[:, half:], x[:, :half]], dim=-1)
    return x * cos + rotated * sin


class DecodeCache(StaticCache):
    """The decoder's K/V: a transformers ``StaticCache`` (one [1, KVH, size, d] buffer per layer, written
    in place), typed so the wrapper knows a decode step on it is the decoder's."""

    def __init__(self, config, size: int):
        super().__init__(config=config, max_cache_len=size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # allocated now, so a step can write its row straight into the buffers
        self.early_initialization(1, config.num_key_value_heads, head_dim, torch.float32, torch.device("cpu"))
        self.buffers = ([layer.keys for layer in self.layers], [layer.values for layer in self.layers],
                        [layer.cumulative_length for layer in self.layers])
