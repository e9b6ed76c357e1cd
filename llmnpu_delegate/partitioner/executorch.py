"""The partitioner as ExecuTorch sees it: ``LlmNpuPartitioner`` for ``to_edge_transform_and_lower``
/ ``to_backend``, tagging the same NPU regions as ``partition_graph`` (one shared core pass).

``LlmNpuPayloadBackend`` is the delegate the tagged regions lower to by default (an inspection
aid, not the engine's ``cpu-int8`` backend): its payload is the region's INT8 weights, per-channel
weight scales and static activation scales (from a quantization plan passed as compile specs),
serialized with ``torch.save``. It has no ExecuTorch C++ runtime counterpart: a program lowered to
it runs in Python (delegates fall back to their original graphs) and shows what the NPU side
receives; on a phone, the QNN delegate takes the same tags with its own ``DelegationSpec``.
"""
from __future__ import annotations

import io
import json

import torch
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import (
    DelegationSpec,
    Partitioner,
    PartitionResult,
)
from torch.export import ExportedProgram

from ..quantize.linear import quantize_weight
from .placement import PAPER
from .regions import is_linear, is_qdq, linear_names, npu_regions

PAYLOAD_FORMAT = 1


def plan_compile_specs(act_scales: dict[str, float], weights: str = "channel") -> list[CompileSpec]:
    """Compile specs carrying a quantization plan (linear name -> static activation scale)."""
    return [CompileSpec("act_scales", json.dumps(act_scales).encode()), CompileSpec("weights", weights.encode())]


class LlmNpuPartitioner(Partitioner):
    """Tags each NPU region of an exported chunk step (linears sharing an input, their weights) for
    one delegate. ``quantizable`` names the decoder linears (``prefix`` is stripped from weight names)."""

    def __init__(self, quantizable, prefix: str = "", placement: str = PAPER,
                 delegation_spec: DelegationSpec | None = None):
        super().__init__()
        self.quantizable = list(quantizable)
        self.prefix = prefix
        self.placement = placement
        self.delegation_spec = delegation_spec or DelegationSpec(LlmNpuPayloadBackend.__name__, [])

    def ops_to_not_decompose(self, ep: ExportedProgram):
        # Keep the decoder linears whole in the edge dialect (the regions are found by them); the
        # others (lm_head) decompose as usual for the CPU.
        keep = set(linear_names(ep.graph_module, self.quantizable, self.prefix,
                                dict(ep.graph_signature.inputs_to_parameters)))
        names = {n.name for n in keep}
        return [torch.ops.aten.linear.default], lambda node: node.name in names

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        gm = exported_program.graph_module
        sig = exported_program.graph_signature
        params = dict(sig.inputs_to_parameters)
        constants = {**params, **dict(sig.inputs_to_buffers), **dict(sig.inputs_to_lifted_tensor_constants)}
        linears = linear_names(gm, self.quantizable, self.prefix, params)
        tags = {}
        for i, region in enumerate(npu_regions(_grouped_by_source(gm, linears), linears, self.placement)):
            tag = f"llmnpu_npu_{i}"
            for node in _with_qdq(region):
                node.meta["delegation_tag"] = tag
                for arg in node.all_input_nodes:
                    if arg.op == "placeholder" and arg.name in constants:
                        arg.meta["delegation_tag"] = tag
            tags[tag] = self.delegation_spec
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)


def _grouped_by_source(gm, linears):
    """In a quantized graph each linear reads its own dequantize of a shared quantize: group the
    linears by that quantize (``npu_regions`` groups by a linear's first argument)."""
    for node in linears:
        x = node.args[0]
        if isinstance(x, torch.fx.Node) and is_qdq(x) and isinstance(x.args[0], torch.fx.Node) and is_qdq(x.args[0]):
            node.meta["llmnpu_source"] = x.args[0]
    return gm


def _with_qdq(region: list) -> list:
    """A region of a quantized graph with its quantization boundary: input quantize/dequantize, the
    weights' dequantize, the output quantize and its dequantizes (float in, float out)."""
    out = list(region)
    for node in region:
        if not is_linear(node):
            continue
        for arg in node.args[:3]:
            if isinstance(arg, torch.fx.Node) and is_qdq(arg):
                out.append(arg)
                src = arg.args[0]
                if isinstance(src, torch.fx.Node) and is_qdq(src) and all(
                        is_qdq(u) and any(is_linear(v) and v in region for v in u.users) for u in src.users):
                    out.append(src)
        for q in node.users:
            if is_qdq(q):
                out.append(q)
                out.extend(d for d in q.users if is_qdq(d))
    return list(dict.fromkeys(out))


class LlmNpuPayloadBackend(BackendDetails):
    """Lowers a tagged NPU region to its INT8 payload (weights quantized here, scales from the plan)."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        specs = {s.key: s.value for s in compile_specs}
        scales = json.loads(specs["act_scales"].decode()) if "act_scales" in specs else {}
        granularity = specs.get("weights", b"channel").decode()
        params = dict(edge_program.graph_signature.inputs_to_parameters)
        state = edge_program.state_dict
        entries = []
        for node in edge_program.graph.nodes:
            if not is_linear(node):
                continue
            w_name = params.get(node.args[1].name) if node.args[1].op == "placeholder" else None
            if w_name is None:
                continue
            name = w_name[: -len(".weight")]
            short = next((k for k in scales if name.endswith(k)), None)
            w_q, w_scale = quantize_weight(state[w_name], granularity)
            entries.append({"name": name, "w_q": w_q, "w_scale": w_scale,
                            "act_scale": scales.get(short) if short else None})
        buf = io.BytesIO()
        torch.save({"format": PAYLOAD_FORMAT, "linears": entries}, buf)
        return PreprocessResult(processed_bytes=buf.getvalue())


__all__ = ["LlmNpuPartitioner", "LlmNpuPayloadBackend", "plan_compile_specs", "linear_names"]
