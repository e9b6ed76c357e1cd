"""``qnn``: ExecuTorch's Qualcomm (QNN/HTP) delegate, a real NPU's backend: no engine on this host
(the engine runs ``cpu-int8``); export lowers each NPU subgraph to an HTP context binary for a SoC,
and the runners load Qualcomm's libraries (on an x86 host, the HTP simulator: numerics only).

ExecuTorch's Qualcomm package looks for the SDK when it is imported: every path here calls
``qnn.sdk.activate()`` first.

Linears stay QNN FullyConnected ops (``convert_linear_to_conv2d`` off): the weights are then laid
out as in our INT8 engine, and the validation compares the very same encodings.
"""
from __future__ import annotations

import contextlib

from ..errors import LlmNpuError
from ..qnn.sdk import activate, native_env
from .registry import register

DEFAULT_SOC = "SM8650"     # Snapdragon 8 Gen 3, the paper's device
BACKEND_ID, SPEC_KEY = "QnnBackend", "qnn_compile_spec"     # ExecuTorch's names for the delegate and its options


def _quiet_qualcomm_logs() -> None:
    # The Qualcomm package sets its own loggers to DEBUG (a line per op and pass).
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("executorch.backends.qualcomm"):
            logging.getLogger(name).setLevel(logging.WARNING)


def chipsets() -> dict:
    activate()
    from executorch.backends.qualcomm.utils.utils import get_soc_to_chipset_map

    return get_soc_to_chipset_map()


def check_soc(soc: str):
    table = chipsets()
    if soc not in table:
        raise LlmNpuError(f"unknown SoC '{soc}': use one of {', '.join(sorted(table))}")
    return table[soc]


def to_qnn_edge(graphs: dict[str, tuple], soc: str = DEFAULT_SOC):
    """Converted (pt2e) graphs (method name -> (graph, example inputs)), each lowered whole, all into
    one HTP context binary for ``soc`` (ExecuTorch's multi-method lowering: ``preprocess_multimethod``).
    Every method's delegate call carries that same binary, which the program stores once; each graph
    carries its method's name, by which the runtime runs it, and the runtime loads the context once,
    for the first of its methods to load (its cached delegate handle serves the others)."""
    chipset = check_soc(soc)
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
        to_edge_transform_and_lower_to_qnn,
        update_spill_fill_size,
    )

    _quiet_qualcomm_logs()
    # multi-contexts: the program's contexts may share one spill-fill buffer (``Qnn.join``), the
    # context's own size recorded in its spec here, as ExecuTorch's ``update_spill_fill_size`` does
    options = generate_htp_compiler_spec(use_fp16=False, use_multi_contexts=True)
    specs = generate_qnn_executorch_compiler_spec(soc_model=chipset, backend_options=options)
    with _keeping_onednn():     # its QnnManager turns oneDNN off on AMD hosts, each lowering
        edge = to_edge_transform_and_lower_to_qnn({m: g for m, (g, _) in graphs.items()},
                                                  {m: e for m, (_, e) in graphs.items()}, dict.fromkeys(graphs, specs))
        for method in graphs:
            update_spill_fill_size(edge.exported_program(method))
    return edge


@register
class Qnn:
    name = "qnn"
    summary = "Qualcomm HTP through ExecuTorch's QNN delegate; export only, run on the HTP simulator here"
    runs_engine = False
    encodings = "qnn"
    uses_soc = True
    shares_contexts = True
    output_bits = (8,)       # HTP's FullyConnected gives 8-bit inputs 8-bit outputs only (tried: 16 refused)
    # HTP runs each piece in a static graph; attention against the fixed K/V window of the context
    pieces = {
        "attention": "MatMul (Q K^T, P V) and Softmax at 16-bit activations, K/V window at 8 or 16 bits, "
                     "causal and padding mask as an input",
        "norms": "RmsNorm at 16-bit activations",
        "rope": "ElementWiseMultiply/Add on q and k with cos/sin as inputs, 16-bit",
        "residual": "ElementWiseAdd, 16-bit",
        "act": "Sigmoid and ElementWiseMultiply (SiLU-mul), 16-bit",
        "merge": "ElementWiseAdd of the shadow product (a graph input from the CPU), 16-bit",
        "peak": "FullyConnected of the peak channels' residues (16-bit activations, 8-bit weights, picked by a "
                "one-hot FullyConnected) beside the norm readers' 8-bit linears",
    }
    missing = "none"

    def engine(self, *args, **kwargs):
        raise LlmNpuError("backend 'qnn' has no engine on this host: prefill with cpu-int8")

    def check_target(self, soc: str | None) -> None:
        check_soc(soc or DEFAULT_SOC)

    def quantizer(self, ours, *more):
        """ExecuTorch's quantizer with our annotations (``ours``, then each of ``more``) over its own."""
        quantizer = qnn_quantizer()
        quantizer.add_custom_quant_annotations(tuple(a.annotate for a in (ours, *more)))   # replaces, not adds
        return quantizer

    def lower(self, graphs: dict[str, tuple], soc: str | None):
        return to_qnn_edge(graphs, soc or DEFAULT_SOC)

    def join(self, delegates: list) -> None:
        """One spill-fill buffer for all the program's contexts, as large as the largest asks: each
        context alone reserves its own, and at chunk 1,024 (attention's 16-bit scores, ~19 MB a
        context) the HTP simulator ran out of memory after 68 of 137 contexts."""
        from executorch.backends.qualcomm.serialization.qc_schema_serialize import (
            flatbuffer_to_option,
            option_to_flatbuffer,
        )

        specs = [s for backend, specs in delegates if backend == BACKEND_ID for s in specs if s.key == SPEC_KEY]
        options = [flatbuffer_to_option(s.value) for s in specs]
        largest = max((o.backend_options.htp_options.max_sf_buf_size for o in options), default=0)
        for spec, option in zip(specs, options):
            if option.backend_options.htp_options.max_sf_buf_size != largest:
                option.backend_options.htp_options.max_sf_buf_size = largest
                spec.value = option_to_flatbuffer(option)

    def prepare_runtime(self) -> None:
        activate()            # the QNN libraries (and the shim) before the program loads

    def native_env(self) -> dict:
        return native_env()


def qnn_quantizer():
    """ExecuTorch's ``QnnQuantizer`` with the QNN libraries active, and this process's oneDNN setting
    kept (``_keeping_onednn``): a later bf16 prefill in the same process would fail without it."""
    activate()
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer

    with _keeping_onednn():
        return QnnQuantizer()


@contextlib.contextmanager
def _keeping_onednn():
    """This process's oneDNN setting as it was before the block, whatever ExecuTorch's Qualcomm code
    does to it inside (on an AMD host it turns oneDNN off process-wide, against a convolution crash
    our graphs cannot meet; the engine's bf16 attention runs on oneDNN's brgemm)."""
    import torch

    enabled = torch.backends.mkldnn.enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled
