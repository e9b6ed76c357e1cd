"""Capture one prefill chunk step of a Hugging Face decoder-only LM with ``torch.export``.

The step takes C token ids at positions P..P+C-1 and, per layer, the K/V of the P tokens before
them; it returns the logits of one chosen row of the chunk and, per layer, the K/V of all P+C
tokens.

How the KV is carried: **per-position shapes**, not a static max-length cache. The past length P
is a symbolic dimension of the exported graph, so one capture serves every chunk position; the
graph's static part (linears, norms, RoPE: shapes depend on C only) is shared by all chunks, and
only the attention (its K/V length is P+C) depends on the position, which is exactly the paper's
static/dynamic split. A static max-length cache (ExecuTorch's static llama) would make every chunk
attend over the whole context: for a 1,024-token prompt at C=256 that is 2.5x the attention work
on average, and it grows with the context the model supports, not with the prompt.

The families' own ``transformers`` modules run unchanged (embedding scaling, RoPE variants, q/k
norms, softcapping, sliding-window masks). Two small pieces are ours: a ``DynamicCache`` filled
from the step's inputs (full layers: sliding windows are applied by the mask, never by cropping),
and the attention function, registered as ``llmnpu`` in ``transformers``' attention interface,
which calls one custom op per layer so the partitioner can see attention as one node.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .errors import LlmNpuError
from .kernels.attention import causal_mask, chunk_attention

DEFAULT_CHUNK = 256   # rows of a chunk step: the paper's default chunk length
ATTN_IMPLEMENTATION = "llmnpu"
PAST = "past"          # name of the symbolic past-length dimension


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **_):
    if attention_mask is None:  # transformers skips the mask when it is plainly causal
        attention_mask = causal_mask(query.shape[2], key.shape[2])
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return chunk_attention(query, key, value, attention_mask, float(scaling), float(softcap or 0.0)), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int


def kv_shape(config) -> KVShape:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVShape(config.num_hidden_layers, config.num_key_value_heads, head_dim)


def max_context(config) -> int:
    return int(config.max_position_embeddings)


class ChunkStep(nn.Module):
    """forward(input_ids [1, C], cache_position [C], logits_index [1], past_k, past_v) ->
    (logits [1, 1, V], k, v): past_k/past_v and k/v are lists with one [1, KVH, len, d] per layer."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.layers = model.config.num_hidden_layers

    def forward(self, input_ids: Tensor, cache_position: Tensor, logits_index: Tensor,
                past_k: list[Tensor], past_v: list[Tensor]):
        cache = DynamicCache()
        for i in range(self.layers):
            cache.update(past_k[i], past_v[i], i)
        out = self.model(input_ids=input_ids, cache_position=cache_position, position_ids=cache_position[None],
                         past_key_values=cache, use_cache=True, logits_to_keep=logits_index)
        return out.logits, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


class attention_implementation:
    """Context manager: run ``model`` with one of our attention functions (default: the chunk step's),
    then restore its own."""

    def __init__(self, model: nn.Module, name: str = ATTN_IMPLEMENTATION):
        self.config, self.name = model.config, name

    def __enter__(self):
        self.saved = self.config._attn_implementation
        self.config._attn_implementation = self.name

    def __exit__(self, *exc):
        self.config._attn_implementation = self.saved


def example_inputs(config, chunk_len: int, past_len: int, device: torch.device | str = "cpu") -> tuple:
    s = kv_shape(config)
    with torch.device(device):
        past_k = [torch.zeros(1, s.kv_heads, past_len, s.head_dim) for _ in range(s.layers)]
        past_v = [torch.zeros(1, s.kv_heads, past_len, s.head_dim) for _ in range(s.layers)]  # distinct tensors
        return (torch.zeros(1, chunk_len, dtype=torch.long), torch.arange(past_len, past_len + chunk_len),
                torch.tensor([chunk_len - 1]), past_k, past_v)


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def weights_state(model: nn.Module) -> tuple:
    """Changes when a weight is replaced or edited in place (tensor version counters), at no cost."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _capture_state(model: nn.Module) -> tuple:
    """What a capture of ``model`` follows: its modules (one swapped for another changes the graph),
    its weights and its attention implementation."""
    attention = getattr(model.config, "_attn_implementation", None)
    return tuple(map(id, model.modules())), weights_state(model), attention


# Captures kept per model: an engine's trial builds (automatic pruning and placement), its tail
# program and later engines of the same model in one process capture the same step, at ~10 s each
# for the embedded model. Kept while the model lives; a changed model is captured again.
_captured: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
_captured_lock = threading.Lock()
_CAPTURES_PER_MODEL = 4


def export_chunk_step(model: nn.Module, chunk_len: int) -> ExportedProgram:
    """``torch.export`` of one chunk step; the past length is symbolic (any multiple of C works).
    A model on the ``meta`` device (no weights: ``llmnpu simulate`` of a 7B shape) exports too.
    The program is shared by later calls for the same model, state and length: take ``.module()``
    of it (a new graph each time), never edit it."""
    ctx = max_context(model.config)
    if not 0 < chunk_len <= ctx:
        raise LlmNpuError(f"chunk length must be in 1..{ctx} (the model's context), got {chunk_len}")
    key = (chunk_len, _capture_state(model))
    with _captured_lock:
        kept = _captured.setdefault(model, {})
        if key not in kept:
            for changed in [k for k in kept if k[1] != key[1]]:     # never valid again
                del kept[changed]
            while len(kept) >= _CAPTURES_PER_MODEL:
                del kept[next(iter(kept))]
            kept[key] = _export(model, chunk_len, ctx)
        return kept[key]


@torch.no_grad()
def _export(model: nn.Module, chunk_len: int, ctx: int) -> ExportedProgram:
    layers = model.config.num_hidden_layers
    past = Dim(PAST, min=0, max=max(ctx - chunk_len, 2 * chunk_len))
    dynamic = {"input_ids": None, "cache_position": None, "logits_index": None,
               "past_k": [{2: past}] * layers, "past_v": [{2: past}] * layers}
    # Traced with a past of 2 chunks (not 0 or 1, which export would specialise on).
    with attention_implementation(model):
        return torch.export.export(ChunkStep(model).eval(),
                                   example_inputs(model.config, chunk_len, 2 * chunk_len, _device_of(model)),
                                   dynamic_shapes=dynamic, strict=False)
