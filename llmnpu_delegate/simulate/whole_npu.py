"""A prefill with every op on the NPU (``Program.placement == "all"``), priced op kind by op kind.

Such a program has no second lane to overlap: each chunk runs its graphs back to back, so the
prefill is the sum of its chunks. A chunk of ``C`` rows attending over ``T`` keys costs, per block
of the model (hidden ``h``, FFN ``I``, ``H`` query and ``G`` K/V heads of ``d``):

- linears: each GEMM ``max(2 C K N / matrix rate, K N weight bytes / DRAM bandwidth)``;
- attention: ``Q K^T`` and ``P V``, ``4 C T H d`` FLOPs on the matrix unit;
- softmax: ``C T H`` elements on the vector unit; the other elementwise ops (two norms, RoPE of q
  and k, two residual adds, the gated activation) ``C (4 h + 2 (H + G) d + 2 I)`` elements;
- K/V: the ``2 T G d`` cached values the chunk reads from DRAM;

plus the LM head over ``C`` rows (or one), a fixed cost per graph execute, and, for a runtime that
writes each chunk's K/V into its fixed window between chunks (``kv_update``), that window's bytes
through the CPU. The matrix rate is the device's for the program's activation precision. A program
of static graphs pads its last chunk to ``C`` rows; a dynamic one (llama.cpp) runs the rows left.
"""
from __future__ import annotations

import math

from .device import Device, graph_launch_s, matrix_ops_per_s
from .programs import Program

KINDS = ("linears", "head", "attention", "softmax", "elementwise", "kv_read", "launch", "kv_update")
NPU_KINDS = KINDS[:-1]          # kv_update runs on the CPU, between the NPU's chunks


def shape(config) -> dict:
    h, heads = config.hidden_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    return {"hidden": h, "ffn": config.intermediate_size, "layers": config.num_hidden_layers, "heads": heads,
            "kv_heads": config.num_key_value_heads, "head_dim": d, "vocab": config.vocab_size}


def gemms(s: dict) -> list[tuple[int, int]]:
    """(K, N) of one block's linears: q, k, v, o, gate, up, down."""
    h, i, q, kv = s["hidden"], s["ffn"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def chunk_seconds(s: dict, program: Program, device: Device, rows: int, keys: int, graphs: int,
                  context: int) -> dict:
    """Seconds per op kind of one chunk of ``rows`` rows attending over ``keys`` keys."""
    c, layers = rows, s["layers"]
    rate = matrix_ops_per_s(device, program.activations)
    dram = device["npu.dram_bytes_per_s"]
    vector = device["npu.vector_elems_per_s"]
    wbytes = program.weight_bits / 8

    def gemm(k: int, n: int, rows: int) -> float:
        return max(2.0 * rows * k * n / rate, k * n * wbytes / dram)

    heads, kv_dim = s["heads"], s["kv_heads"] * s["head_dim"]
    kv_bytes = program.kv_bits / 8
    out = {
        "linears": layers * sum(gemm(k, n, c) for k, n in gemms(s)),
        "head": gemm(s["hidden"], s["vocab"], c if program.head_rows == "all" else 1),
        "attention": layers * 4.0 * c * keys * heads * s["head_dim"] / rate,
        "softmax": layers * float(c * keys * heads) / vector,
        "elementwise": layers * float(c * (4 * s["hidden"] + 2 * (heads * s["head_dim"] + kv_dim) + 2 * s["ffn"]))
                       / vector,
        "kv_read": layers * 2.0 * keys * kv_dim * kv_bytes / dram,
        "launch": graphs * graph_launch_s(device, program.rates),
        "kv_update": (layers * 2.0 * context * kv_dim * kv_bytes / device["cpu.kv_update_bytes_per_s"]
                      if program.kv_update else 0.0),
    }
    return out


def predict(config, program: Program, device: Device, prompt_len: int, context: int,
            graphs: int | None = None) -> dict:
    """The predicted prefill of a ``prompt_len``-token prompt: seconds per op kind summed over the
    chunks, tok/s, and what each processor is busy with. ``graphs``: graph executes per chunk (the
    program's default where None). A fixed window is ``context`` keys for every chunk; a growing
    one the chunk's own tokens and those before it."""
    s = shape(config)
    graphs = program.graphs_per_chunk if graphs is None else graphs
    chunks = math.ceil(prompt_len / program.chunk)
    total = dict.fromkeys(KINDS, 0.0)
    for i in range(chunks):
        rows = program.chunk if program.padded else min(program.chunk, prompt_len - i * program.chunk)
        keys = context if program.window == "fixed" else i * program.chunk + rows
        part = chunk_seconds(s, program, device, rows, keys, graphs, context)
        if i == chunks - 1:
            part["kv_update"] = 0.0       # the last chunk's K/V is written after the first token
        for k, v in part.items():
            total[k] += v
    npu = sum(total[k] for k in NPU_KINDS)
    cpu = total["kv_update"]
    wall = npu + cpu
    energy = (device["npu.power_busy_w"] * npu + device["npu.power_idle_w"] * cpu
              + device["cpu.power_busy_w"] * cpu + device["cpu.power_idle_w"] * npu)
    return {"program": program.name, "prompt_len": prompt_len, "context": context, "chunks": chunks,
            "chunk": program.chunk, "graphs_per_chunk": graphs, "wall_s": wall, "tok_s": prompt_len / wall,
            "npu_busy_s": npu, "cpu_busy_s": cpu, "energy_j": energy, "seconds_by_kind": total}
