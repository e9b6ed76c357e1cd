"""Published phone measurements (written by ``benchmarks/published/aihub_rows.py``): prefill rates
(``data/aihub.csv``) with the program each one ran, and single-graph executes
(``data/aihub_graph_execute.csv``: small models whose whole QNN graph runs on the NPU).

The split between fitting and checking is a rule, not a choice per row: the fit reads only the
training rows (Snapdragon 8 Elite, models of at most 2B parameters, Qualcomm's QNN runtimes);
every other row (the next SoC, larger models, llama.cpp's Hexagon backend) is validation.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .device import Device
from .programs import get_program
from .whole_npu import predict

DATA = Path(__file__).parent / "data" / "aihub.csv"
EXECUTES = Path(__file__).parent / "data" / "aihub_graph_execute.csv"
TRAIN_SOC, TRAIN_MAX_B, QNN_RUNTIMES = "SM8750", 2.0, ("genie", "geniex_qairt")
# (runtime, AI Hub precision) -> our program
PROGRAM_OF = {("genie", "w4a16"): "genie", ("geniex_qairt", "w4a16"): "genie",
              ("genie", "w4"): "genie-fp16", ("geniex_qairt", "w4"): "genie-fp16",
              ("geniex_llamacpp", "q4_0"): "llamacpp-hexagon"}


@dataclass(frozen=True)
class Measurement:
    source: str
    device: str
    soc: str
    model_id: str
    shape: str
    size_b: float
    precision: str
    runtime: str
    context: int
    prompt_tokens: int | None   # the measured prompt (None: one that fills the context)
    graphs: int | None          # graph executes per chunk (the export's splits); None: the program's
    prefill_tok_s: float

    @property
    def program(self) -> str | None:
        return PROGRAM_OF.get((self.runtime, self.precision))

    @property
    def training(self) -> bool:
        return self.soc == TRAIN_SOC and self.size_b <= TRAIN_MAX_B and self.runtime in QNN_RUNTIMES

    @property
    def label(self) -> str:
        return f"{self.model_id} {self.precision} {self.runtime} ctx {self.context}"


@lru_cache(maxsize=1)
def measurements() -> tuple[Measurement, ...]:
    """Every row of the data file whose runtime and precision map to a program."""
    out = []
    with DATA.open() as f:
        for r in csv.DictReader(f):
            m = Measurement(r["source"], r["device"], r["soc"], r["model_id"], r["shape"], float(r["size_b"]),
                            r["precision"], r["runtime"], int(r["context"]),
                            int(r["prompt_tokens"]) if r["prompt_tokens"] else None,
                            int(r["graphs"]) if r["graphs"] else None, float(r["prefill_tok_s"]))
            if m.program:
                out.append(m)
    return tuple(out)


@dataclass(frozen=True)
class GraphExecute:
    """One execute of a small model's whole QNN graph on a phone's NPU, as AI Hub times it."""
    source: str
    device: str
    soc: str
    model_id: str
    component: str
    precision: str
    runtime: str
    layers: int
    seconds: float

    @property
    def label(self) -> str:
        return f"{self.model_id}/{self.component} {self.precision} {self.runtime} on {self.device}"


@lru_cache(maxsize=1)
def graph_executes() -> tuple[GraphExecute, ...]:
    with EXECUTES.open() as f:
        return tuple(GraphExecute(r["source"], r["device"], r["soc"], r["model_id"], r["component"], r["precision"],
                                  r["runtime"], int(r["layers"]), float(r["inference_ms"]) / 1e3)
                     for r in csv.DictReader(f))


@lru_cache(maxsize=None)
def _config(shape: str):
    from ..models import random_config

    return random_config(shape)


def predict_row(m: Measurement, device: Device) -> dict:
    """The prediction of ``m``'s prefill on ``device`` (its SoC's profile, or a fit's candidate)."""
    return predict(_config(m.shape), get_program(m.program), device, m.prompt_tokens or m.context, m.context,
                   m.graphs)


def validation() -> dict:
    """Every row predicted on its SoC's profile: training rows (what the fit reached) and validation
    rows (never fitted), with the relative error of each and the summary of the validation rows."""
    from .device import load_device

    rows = []
    for m in measurements():
        p = predict_row(m, load_device(m.soc))
        rows.append({"label": m.label, "soc": m.soc, "device": m.device, "model_id": m.model_id, "shape": m.shape,
                     "runtime": m.runtime, "precision": m.precision, "program": m.program, "context": m.context,
                     "prompt_tokens": m.prompt_tokens, "training": m.training, "source": m.source,
                     "measured_tok_s": m.prefill_tok_s, "predicted_tok_s": p["tok_s"],
                     "error": p["tok_s"] / m.prefill_tok_s - 1})
    return {"rows": rows, "summary": summarize([r for r in rows if not r["training"]]),
            "training_summary": summarize([r for r in rows if r["training"]])}


def summarize(rows: list[dict]) -> dict:
    errors = sorted(abs(r["error"]) for r in rows)
    if not errors:
        return {"rows": 0}
    mid = len(errors) // 2
    median = errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
    return {"rows": len(errors), "median_abs_error": median, "max_abs_error": errors[-1],
            "within_25": sum(e <= 0.25 for e in errors)}
