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
# what the cost model reads; a profile must define each one
PARAMETERS = (
    "npu.int8_ops_per_s", "npu.weight_bytes_per_s", "npu.graph_launch_s", "npu.io_bytes_per_s",
    "npu.power_busy_w", "npu.power_idle_w",
    "cpu.float_ops_per_s", "cpu.memory_bytes_per_s", "cpu.op_launch_s", "cpu.float_bytes",
    "cpu.power_busy_w", "cpu.power_idle_w",
)


@dataclass(frozen=True)
class Device:
    soc: str
    name: str
    params: dict          # name -> value
    sources: dict         # name -> source text
    microbenchmarks: dict | None

    def __getitem__(self, name: str) -> float:
        return self.params[name]


def socs() -> list[str]:
    return sorted(p.stem for p in DEVICES_DIR.glob("*.json"))


@lru_cache(maxsize=None)
def load_device(soc: str) -> Device:
    """The profile of ``soc`` (e.g. "SM8650"); a one-line error naming the known SoCs otherwise."""
    path = DEVICES_DIR / f"{soc}.json"
    if not soc or "/" in soc or not path.is_file():
        raise LlmNpuError(f"unknown SoC '{soc}': choose one of {', '.join(socs())}")
    d = json.loads(path.read_text())
    params, sources = {}, {}
    for name, entry in d["params"].items():
        source = entry.get("source", "")
        if not isinstance(source, str) or len(source.strip()) < 8:
            raise LlmNpuError(f"{path.name}: parameter {name} has no source")
        if "scale_of" in entry:
            base = load_device(entry["scale_of"])
            value = base[name] * float(entry["by"])
            source = f"{source} (x {float(entry['by']):.4g} of {base.soc}, whose source: {base.sources[name]})"
        else:
            value = float(entry["value"])
        if not math.isfinite(value) or value <= 0:
            raise LlmNpuError(f"{path.name}: parameter {name} = {value} is not a positive number")
        params[name], sources[name] = value, source
    missing = [p for p in PARAMETERS if p not in params]
    if missing:
        raise LlmNpuError(f"{path.name}: missing parameters {missing}")
    return Device(soc, d["name"], params, sources, d.get("microbenchmarks"))
