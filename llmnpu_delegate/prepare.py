"""Preparation, between the partitioner and the runtime: the calibration a model's quantization
reads, its quantization plan, and the ``torch.export`` of one chunk step cut into NPU and CPU
subgraphs. The engine (``runtime/engine.py``), ``llmnpu partition``, the simulator and the doors
all prepare through here."""
from __future__ import annotations

import time

from torch import nn

from .chunk_step import export_chunk_step
from .errors import LlmNpuError
from .models import LoadedModel
from .partitioner.placement import PAPER, Placement
from .partitioner.regions import Partition, partition_graph
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
