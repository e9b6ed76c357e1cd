"""``cpu-int8``: the stand-in NPU. It runs the partition's NPU subgraphs with integer kernels only,
and exports them to ExecuTorch's XNNPACK INT8 kernels (the same program without Qualcomm libraries).

Like an NPU graph it takes a float tensor at its entry, quantizes it once with a static per-tensor
scale, runs INT8 x INT8 -> INT32 GEMMs and dequantizes at its exit (per-output-channel weight
scales are applied to the int32 accumulator, as HTP does). Nothing else runs inside a region:
under a placement beyond the paper's, the engine runs the other pieces of an NPU subgraph in float
around its regions, on the NPU lane, attention and the block norms at an integer NPU's 16-bit
encodings (``lower/npu_graph.py``). Weights are converted once, at
compile time, and cached on disk by the graph cache.

With ``plans=None`` the same subgraphs run as float linears: the float reference of the engine.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels as K
from ..errors import LlmNpuError
from ..format.rows import RowStore
from ..partitioner.placement import PIECES
from ..partitioner.regions import Subgraph, is_linear
from ..quantize.apply import LinearPlan
from ..quantize.linear import quantize_weight
from ..quantize.shadow_rows import shadow_rows
from .graph_cache import GraphCache
from .registry import register

NAME = "cpu-int8"


class NpuRegion(nn.Module):
    """A lowered NPU subgraph: ``x`` -> one output per linear. Linears that share an activation
    scale share one quantized copy of ``x``."""

    def __init__(self, payload: dict):
        super().__init__()
        self.linears: list[str] = list(payload["names"])
        self.in_features = int(payload["w_q"][0].shape[1])
        groups: dict[float, list[int]] = {}
        for i, s in enumerate(payload["act_scale"]):
            groups.setdefault(float(s), []).append(i)
        self.groups = [(scale, idx, K.W8A8Linears([(payload["w_q"][i], payload["w_scale"][i], payload["bias"][i])
                                                    for i in idx]))
                       for scale, idx in groups.items()]

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        outs: list[Tensor | None] = [None] * len(self.linears)
        for scale, idx, linears in self.groups:
            for i, y in zip(idx, linears(x2, scale)):
                outs[i] = y.view(*lead, y.shape[-1])
        return tuple(outs)


class FloatRegion(nn.Module):
    """The float reference of an NPU subgraph (no quantization)."""

    def __init__(self, linears: list[nn.Linear], names: list[str]):
        super().__init__()
        self.mods = linears
        self.linears = names

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(F.linear(x, m.weight, m.bias) for m in self.mods)


class ShadowDelta(nn.Module):
    """One linear's shadow product ``(x - clip(x)) @ W^T`` (a [.., N] float tensor), or a scalar zero
    when no element crossed the threshold.

    Its cost follows the outliers: ``RowStore.product`` scans ``x`` once and adds one row of W^T per
    outlier element, from RAM for hot channels and from the rows file for cold ones. A chunk's
    outliers spread over hundreds of channels, ~4 each, so a dense block of the hit columns is mostly
    zeros."""

    merges_into = True    # forward(x, into=y) adds into y in place (runtime/fuse.py)

    def __init__(self, name: str, clip: float, rows: RowStore):
        super().__init__()
        self.name, self.clip, self.rows = name, clip, rows
        self.outlier_elements = 0
        self.seen_elements = 0
        self.calls, self.seconds = 0, 0.0     # what this path costs (automatic pruning reads it)

    def forward(self, x: Tensor, into: Tensor | None = None) -> Tensor:
        """The product, or ``into`` + the product when given: added in place into a contiguous float
        ``into`` (the linear's output, which nothing else reads: ``runtime/fuse.py`` arranges it)."""
        t = time.perf_counter()
        x2 = x.reshape(-1, x.shape[-1])
        n = self.rows.out_features
        if into is not None and into.is_contiguous() and into.dtype == torch.float32:
            outliers = self.rows.add_product_(into.view(-1, n), x2, self.clip)
            out = into
        else:
            y, outliers = self.rows.product(x2, self.clip)
            delta = x.new_zeros(()) if y is None else y.view(*x.shape[:-1], n)
            out = delta if into is None else into + delta
        # plain counters, written past nn.Module.__setattr__: its checks cost ~1 us each, with the
        # GIL held, on every product of a prefill
        stats = self.__dict__
        stats["calls"] += 1
        stats["seconds"] += time.perf_counter() - t
        stats["outlier_elements"] += outliers
        stats["seen_elements"] += x2.numel()
        return out


class PeakProduct(nn.Module):
    """One linear's shadow product over a static set of its input's peak channels, inside its NPU
    graph (placement piece ``peak``): ``(x - clip(x))[..., P] @ W^T[P]``, a dense [.., |P|] x [|P|, N]
    GEMM whatever the chunk holds, as a static graph computes it. Float here (the stand-in NPU's
    pieces run in float); an integer NPU takes the residues at 16 bits."""

    def __init__(self, name: str, clip: float, channels: Tensor, weight: Tensor):
        super().__init__()
        self.name, self.clip = name, float(clip)
        self.register_buffer("channels", channels.to(torch.int64).clone())
        # W's columns of P, [N, |P|]: a linear's layout, which a program's float kernels take as one
        self.register_buffer("rows", weight.detach().float()[:, self.channels].contiguous())

    def forward(self, x: Tensor) -> Tensor:
        xp = torch.index_select(x, -1, self.channels).float()
        return F.linear(xp - xp.clamp(-self.clip, self.clip), self.rows)


class CpuInt8Engine:
    """Compiles NPU subgraphs to INT8 kernels (or float references) and binds shadow paths."""

    name = NAME

    def __init__(self, model: nn.Module | dict[str, nn.Linear], fingerprint: str, chunk_len: int, plans: dict[str, LinearPlan] | None,
                 weights: str = "channel", cache: GraphCache | None = None):
        self.model = model
        self.fingerprint = fingerprint
        self.chunk_len = chunk_len
        self.plans = plans
        self.weights = weights
        self.cache = cache if cache is not None else GraphCache()
        # the model, or just its linears by name (a Dynamo graph's weights)
        self.modules = dict(model.named_modules()) if isinstance(model, nn.Module) else dict(model)

    @property
    def quantized(self) -> bool:
        return self.plans is not None

    def linear(self, name: str) -> nn.Linear:
        mod = self.modules.get(name)
        if not isinstance(mod, nn.Linear):
            raise LlmNpuError(f"{name} is not a float nn.Linear of the model (was the model quantized in place?)")
        return mod

    def lower_npu(self, sub: Subgraph) -> nn.Module:
        if not all(is_linear(n) or n.op == "get_attr" for n in sub.nodes):
            raise LlmNpuError(f"NPU subgraph {sub.index} holds non-linear work; {NAME} runs INT8 linears only")
        if not self.quantized:
            return FloatRegion([self.linear(n) for n in sub.linears], sub.linears)
        scales = [self.plans[n].act_scale for n in sub.linears]
        fields = {"backend": NAME, "model": self.fingerprint, "chunk_len": self.chunk_len, "weights": self.weights,
                  "linears": sub.linears, "act_scale": scales}
        return NpuRegion(self.cache.get_or_build(fields, lambda: self._compile(sub.linears, scales),
                                                 lambda payload: self._check_payload(payload, sub.linears, scales)))

    def _compile(self, names: list[str], scales: list[float]) -> dict:
        w_q, w_scale, bias = [], [], []
        for name in names:
            lin = self.linear(name)
            q, s = quantize_weight(lin.weight, self.weights)
            w_q.append(q)
            w_scale.append(s)
            bias.append(None if lin.bias is None else lin.bias.detach().float().clone())
        return {"names": list(names), "w_q": w_q, "w_scale": w_scale, "bias": bias, "act_scale": list(scales)}

    def _check_payload(self, payload, names: list[str], scales: list[float]) -> None:
        """A cached payload must be what ``_compile`` builds for these linears: raises otherwise."""
        if not isinstance(payload, dict) or payload.get("names") != list(names) or payload.get("act_scale") != list(scales):
            raise ValueError("payload is not for these linears")
        for i, name in enumerate(names):
            lin = self.linear(name)
            n, k = lin.weight.shape
            w_q, w_scale, bias = payload["w_q"][i], payload["w_scale"][i], payload["bias"][i]
            if not (isinstance(w_q, torch.Tensor) and w_q.dtype == torch.int8 and w_q.shape == (n, k)):
                raise ValueError(f"{name}: weight is not an int8 [{n}, {k}] tensor")
            if not (isinstance(w_scale, torch.Tensor) and w_scale.dtype == torch.float32 and w_scale.shape == (n,)):
                raise ValueError(f"{name}: weight scales are not float32 [{n}]")
            if (bias is None) != (lin.bias is None) or (bias is not None and bias.shape != (n,)):
                raise ValueError(f"{name}: bias does not match the linear")

    def peak_module(self, name: str) -> PeakProduct:
        plan = self.plans[name] if self.plans else None
        if plan is None or not plan.shadow or plan.peak is None:
            raise LlmNpuError(f"{name} has no peak channels in this quantization plan (placement piece peak needs "
                              f"a shadow path)")
        return PeakProduct(name, plan.clip, plan.peak, self.linear(name).weight)

    def shadow_module(self, name: str) -> ShadowDelta:
        plan = self.plans[name] if self.plans else None
        if plan is None or not plan.shadow:
            raise LlmNpuError(f"{name} has no shadow path in this quantization plan")
        lin = self.linear(name)
        return ShadowDelta(name, plan.clip, shadow_rows(self.fingerprint, name, lin.weight, plan.hot))


@register
class CpuInt8:
    name = NAME
    summary = "the INT8 stand-in NPU: integer kernels on this CPU; exports to XNNPACK INT8"
    runs_engine = True
    encodings = "xnnpack"
    uses_soc = False
    shares_contexts = False      # XNNPACK's delegate calls are independent
    output_bits = (32, 8)    # float outputs: the engine's own numerics, at the speed of 8-bit ones
    # the engine runs each piece as the graph has it, in float, on the NPU lane's thread
    # (lower/npu_graph.py); a float-output program writes the region whole (lower/graph_methods.py)
    pieces = {**dict.fromkeys(PIECES, "float32 on the stand-in NPU's lane (attention and norms at NPU encodings)"),
              "peak": "the peak channels' residues times their weight rows, float32, on the stand-in NPU's lane"}
    missing = "none"

    def engine(self, model, fingerprint: str, chunk_len: int, plans, weights: str = "channel",
               cache=None) -> CpuInt8Engine:
        return CpuInt8Engine(model, fingerprint, chunk_len, plans, weights, cache)

    def check_target(self, soc: str | None) -> None:
        pass

    def quantizer(self, ours):
        return ours

    def lower(self, graphs: dict[str, tuple], soc: str | None):
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower

        # converted graphs: no Python to trace
        eps = {method: torch.export.export(graph, example, strict=False) for method, (graph, example) in graphs.items()}
        return to_edge_transform_and_lower(eps, partitioner=[XnnpackPartitioner()])

    def join(self, delegates: list) -> None:
        pass                  # XNNPACK's delegate calls share nothing across methods

    def prepare_runtime(self) -> None:
        pass

    def native_env(self) -> dict:
        return {}
