"""A placement's numerics on the Hugging Face model, for the accuracy harness.

The harness scores the quantized reference (``quantize_`` on a copy of the model), which returns every
position's logits, where the engine's chunk graphs return the last token's. Of a placement's pieces
(``partitioner/placement.py``) attention and the norms change what is computed: the engine runs the
others with the CPU's kernels wherever they sit (tested bit for bit), but on the NPU attention and
the block norms run at static 16-bit encodings (``kernels/npu_attention.py``, ``kernels/npu_norm.py``).
So a placement with attention on the NPU is scored by routing every attention module of the reference
through that kernel, with the encodings the engine calibrates (``prepare.attention_ranges_of`` at the
same chunk length): per query, the same rounding of q, the K/V and the scores over the keys its mask
opens, chunked or not. One with norms on the NPU, by swapping each block norm for ``npu_rms_norm`` at
the engine's encodings (``prepare.norm_ranges_of``): a norm reads one token, so chunking changes nothing.
One with the norm readers' products in the NPU graphs (piece ``peak``), by restricting the shadow
product of q/k/v and gate/up to the input channels of their static peak set
(``quantize.shadow_rows.peak_channels`` on the calibration); o_proj's and down_proj's keep every channel.
The sets are the engine's (``LinearPlan.peak``: the same ranking on the same calibration), so the row
is what the cpu-int8 engine and its program with float outputs compute. A QNN program's own
products, on its grids, are the ``qnn`` mode's (``lower/program_numerics.PeakOnGrid``).
"""
from __future__ import annotations

from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .chunk_step import DEFAULT_CHUNK
from .errors import LlmNpuError
from .kernels.attention import causal_mask
from .kernels.npu_attention import KV_BITS, AttentionEncodings, NpuAttention
from .kernels.npu_norm import NormEncodings, NpuNorm
from .models import LoadedModel
from .families import FAMILIES
from .partitioner.placement import PAPER, Placement, parse_placement
from .prepare import attention_ranges_of, default_calibration, norm_encodings_of, norm_modules
from .quantize.linear import QuantLinear
from .quantize.shadow_rows import PEAK_CHANNELS, peak_channels

NPU_ATTN_IMPLEMENTATION = "llmnpu-npu"
_ENCODINGS = "llmnpu_npu_encodings"     # attribute of each attention module: its layer's encodings


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **_):
    enc = getattr(module, _ENCODINGS, None)
    if enc is None:
        raise LlmNpuError(f"{type(module).__name__} has no NPU encodings: apply a placement with apply_placement")
    if query.shape[0] != 1:
        raise LlmNpuError("NPU attention scores one sequence at a time (batch 1)")
    mask = attention_mask if attention_mask is not None else causal_mask(query.shape[2], key.shape[2])
    scaling = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    # the engine's NPU graphs call the same module (its refusal of softcapping included)
    return NpuAttention(enc)(query, key, value, mask[-1:], scaling, float(softcap or 0.0)), None


AttentionInterface.register(NPU_ATTN_IMPLEMENTATION, _attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NPU_ATTN_IMPLEMENTATION, sdpa_mask)


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Layer index -> the attention module of that decoder block."""
    found = {m.layer_idx: m for m in model.modules()
             if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)}
    if not found:
        raise LlmNpuError(f"{type(model).__name__} has no attention modules with a layer index: not a supported LM")
    return found


def apply_placement(lm: LoadedModel, model: nn.Module, placement: "Placement | str", kv_bits: int = 16,
                    chunk_len: int | None = None, calib=None) -> dict:
    """Make ``model`` (a quantized copy of ``lm.model``) compute attention, the block norms and the
    norm readers' shadow products as ``placement`` puts them: on the NPU, at the encodings the engine
    calibrates for ``chunk_len``-row chunks (attention with a ``kv_bits`` window), the products over
    the peak channels of ``calib`` (default: the cached calibration on the shipped text). Returns what
    a result row records of it."""
    placement = parse_placement(placement)
    peaks = peak_products(lm, model, calib) if placement.on_npu("peak") else {}
    if placement.on_npu("norms"):
        _norms_on_the_npu(lm, model, chunk_len or DEFAULT_CHUNK)
    where = {"placement": placement.name, **({"peak_products": len(peaks)} if placement.on_npu("peak") else {})}
    if not placement.on_npu("attention"):
        return where
    ranges = attention_ranges_of(lm, chunk_len or DEFAULT_CHUNK)
    swap_attention(model, {layer: AttentionEncodings.of_ranges(r, kv_bits) for layer, r in ranges.items()})
    return {**where, "npu_kv_bits": kv_bits}


def peak_products(lm: LoadedModel, model: nn.Module, calib=None, count: int = PEAK_CHANNELS) -> dict:
    """Restrict the shadow product of every norm reader of ``model`` (q/k/v, gate/up: a quantized copy
    of ``lm.model``) to its ``count`` peak channels; returns linear -> the channels kept."""
    family = FAMILIES.get(lm.model.config.model_type)
    if family is None:
        raise LlmNpuError(f"no family description for model type {lm.model.config.model_type}: its norm readers "
                          f"are unknown, so piece 'peak' cannot be scored")
    calib = calib if calib is not None else default_calibration(lm, progress=False)
    kept = {}
    for name, lin in model.named_modules():
        if isinstance(lin, QuantLinear) and not lin.pruned and family.reads_a_norm(name):
            weight = lm.model.get_submodule(name).weight
            lin.shadow_channels = kept[name] = peak_channels(calib.layers[name].channel_absmax, lin.clip, weight, count)
    return kept


def swap_attention(model: nn.Module, encodings: dict[int, AttentionEncodings]) -> int:
    """Every attention of ``model`` computed as the NPU computes it, at ``encodings`` (layer -> its
    encodings; all layers or none); returns how many."""
    if not encodings:
        return 0
    modules = attention_modules(model)
    if set(modules) != set(encodings):
        raise LlmNpuError(f"attention encodings are given for layers {sorted(encodings)}, the model has "
                          f"{sorted(modules)}: score the model they came from")
    for layer, module in modules.items():
        setattr(module, _ENCODINGS, encodings[layer])
    model.config._attn_implementation = NPU_ATTN_IMPLEMENTATION
    return len(modules)


class _NpuNorm(nn.Module):
    """A block norm of the reference as the NPU computes it (its weight, eps and encodings)."""

    def __init__(self, norm: nn.Module, enc: NormEncodings):
        super().__init__()
        self.weight, self.npu = norm.weight, NpuNorm(enc)
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    def forward(self, x):
        return self.npu(x, self.weight, self.eps).to(x.dtype)


def _norms_on_the_npu(lm: LoadedModel, model: nn.Module, chunk_len: int) -> None:
    encodings = norm_encodings_of(lm, chunk_len)
    if set(norm_modules(model)) != set(encodings):
        raise LlmNpuError(f"norm ranges were observed for {len(encodings)} norms, the model has "
                          f"{len(norm_modules(model))}: score the model the ranges came from")
    swap_norms(model, encodings)


def swap_norms(model: nn.Module, encodings: dict[tuple[int, str], NormEncodings]) -> int:
    """Each block norm of ``model`` named in ``encodings`` ((layer, name) -> its encodings) computed
    as the NPU computes it; returns how many."""
    if not encodings:
        return 0
    mine = norm_modules(model)
    if unknown := sorted(set(encodings) - set(mine)):
        raise LlmNpuError(f"the model has no block norm {unknown[0]}: score the model the encodings came from")
    paths = {module: path for path, module in model.named_modules()}
    for key, enc in encodings.items():
        parent, _, name = paths[mine[key]].rpartition(".")
        setattr(model.get_submodule(parent), name, _NpuNorm(mine[key], enc))
    return len(encodings)


def row_name(mode: str, placement: "Placement | str") -> str:
    """A result row's name: the mode, and the placement when it is not the paper's."""
    name = parse_placement(placement).name
    return mode if name == PAPER else f"{mode}@{name}"


def check_kv_bits(kv_bits: int) -> int:
    if int(kv_bits) not in KV_BITS:
        raise LlmNpuError(f"the NPU's K/V window is kept at {' or '.join(map(str, KV_BITS))} bits, got {kv_bits}")
    return int(kv_bits)
