"""Preparation, between the partitioner and the runtime: the calibration a model's quantization
reads, its quantization plan, and the ``torch.export`` of one chunk step cut into NPU and CPU
subgraphs. The engine (``runtime/engine.py``), ``llmnpu partition``, the simulator and the doors
all prepare through here."""
from __future__ import annotations

import time

import torch
from torch import nn

from .chunk_step import export_chunk_step, kv_shape
from .errors import LlmNpuError
from .models import LoadedModel
from .kernels.npu_attention import attention_ranges, widen
from .kernels.npu_norm import NormEncodings, norm_key, norm_ranges
from .partitioner.placement import PAPER, Placement, layer_of, parse_placement
from .partitioner.regions import ATTENTION_TARGETS, Partition, partition_graph
from .quantize import CalibConfig, Calibration, QuantConfig, load_or_calibrate, plan_linears, quantizable_linears
from .text import calibration_ids


def default_calibration(lm: LoadedModel | None, progress: bool = True, config: CalibConfig = CalibConfig(),
                        text_file=None) -> Calibration:
    """The cached calibration of ``lm`` on the shipped calibration text (or ``text_file``)."""
    if lm is None:
        raise LlmNpuError("a quantized prefill needs a calibration: pass calibration=..., or a LoadedModel "
                          "(load_model(...)) so the shipped calibration text can be tokenized")
    ids = calibration_ids(lm, text_file)
    return load_or_calibrate(lm.model, ids, lm.fingerprint, config, progress=progress)


def plan_and_partition(model: nn.Module, lm: LoadedModel | None, fingerprint: str, chunk_len: int,
                       quant: QuantConfig | None, calibration: Calibration | None = None,
                       placement: "Placement | str" = PAPER,
                       progress: bool = True, timings: dict | None = None):
    """Quantization plan (None in float mode), then ``torch.export`` of a chunk step and its partition."""
    timings = {} if timings is None else timings
    t = time.perf_counter()
    plans = None
    if quant is not None:
        calibration = calibration if calibration is not None else default_calibration(lm, progress)
        plans = plan_linears(model, calibration, quant, fingerprint, progress)
    timings["plan_s"] = time.perf_counter() - t
    return plans, partition_step(model, chunk_len, plans, placement, timings)


def partition_step(model: nn.Module, chunk_len: int, plans: dict | None, placement: "Placement | str" = PAPER,
                   timings: dict | None = None) -> Partition:
    """``torch.export`` of a chunk step of ``chunk_len`` rows and its partition with ``placement`` (a
    ``Placement``, a preset or piece list, or the engine's norms policy ``"cpu"``/``"npu"``)."""
    timings = {} if timings is None else timings
    t = time.perf_counter()
    ep = export_chunk_step(model, chunk_len)
    timings["export_s"] = time.perf_counter() - t
    t = time.perf_counter()
    shadowed = [n for n, p in (plans or {}).items() if p.shadow]
    partition = partition_graph(ep.module(), quantizable_linears(model), shadowed=shadowed, placement=placement,
                                prefix="model.")
    timings["partition_s"] = time.perf_counter() - t
    return partition


ATTENTION_CALIB_CHUNKS = 4     # chunks of calibration text whose attention ranges set the encodings


def attention_ranges_of(lm: LoadedModel, chunk_len: int, chunks: int = ATTENTION_CALIB_CHUNKS) -> dict:
    """Per decoder layer, the ranges of its attention's tensors (``kernels.npu_attention``
    ``attention_ranges``, for its static encodings on an NPU): what the float chunk step shows over the
    first ``chunks`` chunks of the calibration text, each chunk attending over the ones before it."""
    step = export_chunk_step(lm.model, chunk_len).module()
    ids = calibration_ids(lm)[: chunks * chunk_len]
    if ids.numel() < chunk_len:
        raise LlmNpuError(f"the calibration text holds {ids.numel()} tokens, fewer than a chunk of {chunk_len}")
    ranges: dict[int, dict] = {}

    class Observe(torch.fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node.op == "call_function" and node.target in ATTENTION_TARGETS:
                q, k, v, mask, scaling, _ = self.fetch_args_kwargs_from_env(node)[0]
                layer = layer_of(node)
                ranges[layer] = widen(ranges.get(layer), attention_ranges(q, k, v, mask, scaling, out))
            return out

    shape = kv_shape(lm.model.config)
    past_k = [torch.zeros(1, shape.kv_heads, 0, shape.head_dim) for _ in range(shape.layers)]
    past_v = [torch.zeros(1, shape.kv_heads, 0, shape.head_dim) for _ in range(shape.layers)]
    with torch.inference_mode():
        for start in range(0, ids.numel() - chunk_len + 1, chunk_len):
            feed = (ids[None, start:start + chunk_len], torch.arange(start, start + chunk_len),
                    torch.tensor([chunk_len - 1]), past_k, past_v)
            out = Observe(step).run(*torch.utils._pytree.tree_leaves(feed))
            flat = torch.utils._pytree.tree_leaves(out)
            past_k, past_v = flat[1:1 + shape.layers], flat[1 + shape.layers:1 + 2 * shape.layers]
    return ranges


def has_npu_norms(model: nn.Module) -> bool:
    """Whether ``model``'s block norms have an NPU form (``w * x / rms(x)``; Gemma's scale by 1 + w)."""
    from .families import family_of

    return not family_of(model.config).model_type.startswith("gemma")


def qnn_holds(model: nn.Module, placement: "Placement | str") -> bool:
    """Whether a QNN program's regions hold ``model``'s NPU work under ``placement``: a block norm
    feeding linears (``lower/norm_region.py``), and attention with RoPE and any per-head q/k norms
    before it (``lower/attention_region.py``). Norms need the NPU's form (``has_npu_norms``); a q/k
    norm sits between its linear and RoPE, so only an attention region holds it; attention may not
    be softcapped."""
    from .families import family_of

    placement = parse_placement(placement)
    qk_norms = family_of(model.config).qk_norm is not None
    if placement.on_npu("norms") and not (has_npu_norms(model) and (not qk_norms or placement.on_npu("attention"))):
        return False
    return not (placement.on_npu("attention") and getattr(model.config, "attn_logit_softcapping", None))


def norm_modules(model: nn.Module) -> dict[tuple[int, str], nn.Module]:
    """(layer, name) -> each decoder block's RMSNorm of the form ``w * x / rms(x)`` (its block norms
    and q/k norms, ``families.py``), the norms an NPU graph runs at its encodings."""
    from .families import family_of

    family = family_of(model.config)
    if not has_npu_norms(model):
        raise LlmNpuError(f"{family.model_type}'s norms scale by (1 + w): they have no NPU form here; keep them on "
                          f"the CPU (a placement without 'norms')")
    names = {n.split(".")[-1] for n in family.norms + (family.qk_norm or ())}
    found = {}
    for path, module in model.named_modules():
        key = norm_key(path)
        if key is not None and key[1] in names:
            found[key] = module
    return found


def norm_ranges_of(lm: LoadedModel, chunk_len: int, chunks: int = ATTENTION_CALIB_CHUNKS) -> dict:
    """Per block norm ((layer, name), ``norm_modules``), the ranges of its input and output
    (``kernels.npu_norm.norm_ranges``) over the calibration text attention's ranges come from: a norm
    reads one token at a time, so one float pass over those tokens shows what chunked ones would."""
    ids = calibration_ids(lm)[: chunks * chunk_len]
    ranges: dict[tuple[int, str], dict] = {}

    def observe(key):
        def hook(module, args, out):
            ranges[key] = widen(ranges.get(key), norm_ranges(args[0], out))
        return hook

    hooks = [m.register_forward_hook(observe(key)) for key, m in norm_modules(lm.model).items()]
    try:
        with torch.inference_mode():
            lm.model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    return ranges


def norm_encodings_of(lm: LoadedModel, chunk_len: int) -> dict:
    """(layer, name) -> each block norm's ``NormEncodings``, from ``norm_ranges_of`` and its weight:
    what the engine's NPU graphs and the harness's reference both run."""
    modules = norm_modules(lm.model)
    return {key: NormEncodings.of_ranges(r, modules[key].weight) for key, r in norm_ranges_of(lm, chunk_len).items()}
