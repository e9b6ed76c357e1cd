"""Phone SoC profiles: every number the cost model uses, each with the public source it comes from.

A profile is a JSON file in ``devices/`` named after the SoC's part number. A parameter is either
``{"value": v, "source": "..."}`` or, for a SoC without its own micro-benchmarks, a scaling of
another profile's parameter: ``{"scale_of": "SM8650", "by": f, "source": "..."}`` (the source names
the published ratio). Loading checks that every parameter has a source and a finite positive value.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import LlmNpuError

DEVICES_DIR = Path(__file__).parent / "devices"
# what the cost models read; a profile must define each one
PARAMETERS = (
    # the NPU as QNN programs reach it (fitted on SM8750, the other SoCs by published ratios)
    "npu.a16_ops_per_s", "npu.a8_speedup", "npu.fp16_ops_per_s", "npu.vector_elems_per_s",
    "npu.dram_bytes_per_s", "npu.graph_launch_s", "npu.io_bytes_per_s",
    "npu.power_busy_w", "npu.power_idle_w",
    # the paper's 2024 implementation on the NPU (its Table 3)
    "paper.int8_ops_per_s", "paper.weight_bytes_per_s", "paper.graph_launch_s",
    "cpu.float_ops_per_s", "cpu.memory_bytes_per_s", "cpu.op_launch_s", "cpu.float_bytes",
    "cpu.kv_update_bytes_per_s", "cpu.power_busy_w", "cpu.power_idle_w",
)
# parameters no measurement decides: `llmnpu simulate --validate` prints how predictions move across
# each one's plausible range
ASSUMPTIONS = {"npu.a8_speedup": (1.0, 2.0)}


def matrix_ops_per_s(device: "Device", activations: str) -> float:
    """The NPU matrix unit's rate for activations of ``activations`` (``programs.ACTIVATIONS``):
    8-bit activations run ``npu.a8_speedup`` times the 16-bit rate (weights of 4 or 8 bits alike)."""
    if activations == "fp16":
        return device["npu.fp16_ops_per_s"]
    a16 = device["npu.a16_ops_per_s"]
    return a16 * device["npu.a8_speedup"] if activations == "a8" else a16


def graph_launch_s(device: "Device", rates: str) -> float:
    """What one graph execute costs before its work, for a program of ``rates`` (``programs.Program``):
    a QNN graph's as AI Hub measures small models, or the paper's runtime's (Table 3's intercept)."""
    return device["paper.graph_launch_s"] if rates == "paper" else device["npu.graph_launch_s"]


@dataclass(frozen=True)
class Device:
    soc: str
    name: str
    params: dict          # name -> value
    sources: dict         # name -> source text
    microbenchmarks: dict | None

    def __getitem__(self, name: str) -> float:
        return self.params[name]

    def with_params(self, params: dict[str, float]) -> "Device":
        """This profile with some parameters replaced (a fit's candidates, an assumption's range)."""
        return Device(self.soc, self.name, {**self.params, **params}, self.sources, self.microbenchmarks)


def socs() -> list[str]:
    return sorted(p.stem for p in DEVICES_DIR.glob("*.json"))


@lru_cache(maxsize=None)
def _profile(soc: str) -> dict:
    path = DEVICES_DIR / f"{soc}.json"
    if not soc or "/" in soc or not path.is_file():
        raise LlmNpuError(f"unknown SoC '{soc}': choose one of {', '.join(socs())}")
    return json.loads(path.read_text())


def _param(soc: str, name: str, seen: tuple = ()) -> tuple[float, str]:
    """(value, source) of one parameter, following ``scale_of`` from SoC to SoC (a profile may scale
    another's NPU while that one scales its CPU: each parameter is resolved on its own)."""
    if (soc, name) in seen:
        raise LlmNpuError(f"{soc}.json: parameter {name} scales itself through {', '.join(s for s, _ in seen)}")
    entry = _profile(soc)["params"].get(name)
    if entry is None:
        raise LlmNpuError(f"{soc}.json: missing parameter {name}")
    source = entry.get("source", "")
    if not isinstance(source, str) or len(source.strip()) < 8:
        raise LlmNpuError(f"{soc}.json: parameter {name} has no source")
    if "scale_of" in entry:
        base, base_source = _param(entry["scale_of"], name, (*seen, (soc, name)))
        by = float(entry["by"])
        value, source = base * by, f"{source} (x {by:.4g} of {entry['scale_of']}, whose source: {base_source})"
    else:
        value = float(entry["value"])
    if not math.isfinite(value) or value <= 0:
        raise LlmNpuError(f"{soc}.json: parameter {name} = {value} is not a positive number")
    return value, source


@lru_cache(maxsize=None)
def load_device(soc: str) -> Device:
    """The profile of ``soc`` (e.g. "SM8650"); a one-line error naming the known SoCs otherwise."""
    d = _profile(soc)
    missing = [p for p in PARAMETERS if p not in d["params"]]
    if missing:
        raise LlmNpuError(f"{soc}.json: missing parameters {missing}")
    resolved = {name: _param(soc, name) for name in d["params"]}
    return Device(soc, d["name"], {k: v for k, (v, _) in resolved.items()},
                  {k: s for k, (_, s) in resolved.items()}, d.get("microbenchmarks"))
