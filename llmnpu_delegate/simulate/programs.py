"""The programs a phone can run for a prefill: ours, and the ones users would pick instead.

A ``Program`` says what runs where and at which precision; the device profile says how fast each
piece goes. Two kinds of program are priced:

- ``placement="linears"``: ``llmnpu export``'s program. INT8 linears run as NPU graphs with what
  the placement adds to them (``partitioner/placement.py``; the paper's split adds nothing), the
  rest and the shadow products in float on the CPU, both lanes overlapped by the scheduler
  (``phone.simulate_prefill`` on the partitioned FX graph).
- ``placement="all"``: every op of a chunk on the NPU, one graph per split of the model, chunks
  back to back (``whole_npu.py``), the form of Qualcomm's Genie and ExecuTorch's Qualcomm llama.

``rates`` names which NPU rates the program reaches: ``"qnn"``, the device's (fitted on programs
built by Qualcomm's QNN toolchain, which our ``.pte`` methods are too), or ``"paper"``, the paper's
2024 implementation (its Table 3 micro-benchmarks, used to check the model on its figures).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import LlmNpuError

ACTIVATIONS = ("a8", "a16", "fp16")     # the NPU matrix unit's activation operand


@dataclass(frozen=True)
class Program:
    name: str
    description: str
    placement: str              # "linears" (the paper's split) or "all" (everything on the NPU)
    activations: str            # one of ACTIVATIONS
    weight_bits: float          # bits per weight streamed from DRAM (with block scales)
    kv_bits: int                # bits per cached key or value
    chunk: int                  # rows per chunk graph
    window: str                 # "fixed": each chunk attends over the whole context (masked);
                                # "growing": over the tokens before it only
    head_rows: str              # "all": logits for every row of a chunk; "last": for the last token
    graphs_per_chunk: int       # graph executes per chunk (whole-NPU programs: the model's splits)
    kv_update: bool             # the runtime writes each chunk's K/V into its window between chunks
    padded: bool = True         # static graphs pad the last chunk; dynamic ones run the rows left
    residual_activations: str | None = None     # the residual writers' (o_proj, down_proj) operand, if
                                                # not ``activations`` (``export --residual-bits 16``)
    rates: str = "qnn"          # "qnn" or "paper"

    def __post_init__(self):
        if self.placement not in ("linears", "all"):
            raise LlmNpuError(f"program {self.name}: placement must be 'linears' or 'all'")
        if self.activations not in ACTIVATIONS or self.residual_activations not in (None, *ACTIVATIONS):
            raise LlmNpuError(f"program {self.name}: activations must be one of {', '.join(ACTIVATIONS)}")
        if self.window not in ("fixed", "growing") or self.head_rows not in ("all", "last"):
            raise LlmNpuError(f"program {self.name}: window must be fixed/growing, head_rows all/last")
        if self.rates not in ("qnn", "paper"):
            raise LlmNpuError(f"program {self.name}: rates must be 'qnn' or 'paper'")


_OURS = Program("ours", "llmnpu export's .pte: W8A8 linears on the NPU with what --placement adds (one graph per "
                        "NPU subgraph), the rest and the shadow products in fp16 on the CPU, overlapped out of order",
                placement="linears", activations="a8", weight_bits=8, kv_bits=16, chunk=256, window="growing",
                head_rows="last", graphs_per_chunk=0, kv_update=False)
_GENIE = Program("genie", "Qualcomm Genie / ExecuTorch's Qualcomm llama: everything on the NPU, w4a16, 128-row "
                          "chunks against a fixed K/V window of the context, logits for every row",
                 placement="all", activations="a16", weight_bits=4, kv_bits=8, chunk=128, window="fixed",
                 head_rows="all", graphs_per_chunk=4, kv_update=True)
# ExecuTorch's Qualcomm llama (examples/qualcomm/oss_scripts/llama in the executorch wheel) as its
# recipes quantize it: K/V I/O at 16 bits unless 8a8w (StaticLLMQuantRecipe.get_kv_io_bit_width),
# one graph per chunk (SmolLM2's num_sharding), chunks of --prefill_ar_len rows (128 here; its
# default is 32)
_EXECUTORCH = Program("executorch-16a8w", "ExecuTorch's Qualcomm llama with its 16a8w recipe (SmolLM2's): everything "
                                          "on the NPU, 16-bit K/V, one graph per 128-row chunk against a fixed window",
                      placement="all", activations="a16", weight_bits=8, kv_bits=16, chunk=128, window="fixed",
                      head_rows="all", graphs_per_chunk=1, kv_update=True)
PROGRAMS: dict[str, Program] = {p.name: p for p in (
    _OURS,
    replace(_OURS, name="ours-r16", residual_activations="a16",
            description="as ours with 16-bit outputs for the linears that write the residual stream (o_proj, "
                        "down_proj), at the matrix unit's 16-bit rate (llmnpu export --residual-bits 16)"),
    replace(_OURS, name="paper", rates="paper",
            description="the paper's 2024 implementation (mllm on QNN): our partition priced at its Table 3 rates"),
    _GENIE,
    replace(_GENIE, name="genie-fp16", activations="fp16",
            description="as genie with fp16 activations (AI Hub's 'w4' precision)"),
    Program("llamacpp-hexagon", "llama.cpp's Hexagon backend: q4_0 weights, fp16 matrix operands on the NPU, "
                                "512-row batches against the tokens before them, f16 K/V cache",
            placement="all", activations="fp16", weight_bits=4.5, kv_bits=16, chunk=512, window="growing",
            head_rows="last", graphs_per_chunk=1, kv_update=False, padded=False),
    _EXECUTORCH,
    replace(_EXECUTORCH, name="executorch-16a4w", weight_bits=4,
            description="as executorch-16a8w with 4-bit weights (its 16a4w setting)"),
    replace(_EXECUTORCH, name="executorch-8a8w", activations="a8", kv_bits=8,
            description="as executorch-16a8w with 8-bit activations and K/V (its 8a8w setting)"),
)}


def get_program(name: str) -> Program:
    if name not in PROGRAMS:
        raise LlmNpuError(f"unknown program '{name}': choose one of {', '.join(PROGRAMS)}")
    return PROGRAMS[name]
