"""Attention as one HTP graph on the embedded model: every layer's method on Qualcomm's simulator
against the reference it must compute (``kernels/npu_attention.py``) and against float attention.

Each layer's encodings are the engine's (``prepare.attention_ranges_of``: the calibration text);
the inputs are the evaluation text's, captured from the float chunk step at its second chunk (a
past of one chunk), placed in a window of ``--window`` slots whose tail stays empty and masked.

    python benchmarks/htp_attention.py [--chunk 256] [--window 768] [--soc SM8750] [--layers N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llmnpu_delegate.chunk_step import export_chunk_step, kv_shape
from llmnpu_delegate.kernels.attention import chunk_attention
from llmnpu_delegate.kernels.cpu import detect
from llmnpu_delegate.kernels.npu_attention import AttentionEncodings, npu_attention
from llmnpu_delegate.lower.attention_method import graph_inputs, lower_attention, output_of
from llmnpu_delegate.models import load_model
from llmnpu_delegate.partitioner.placement import layer_of
from llmnpu_delegate.partitioner.regions import ATTENTION_TARGETS
from llmnpu_delegate.prepare import attention_ranges_of
from llmnpu_delegate.qnn.sdk import activate
from llmnpu_delegate.text import read_text, tokenize


def captured_attention(lm, chunk: int, ids=None) -> dict[int, tuple]:
    """Per layer, (q, k, v, mask, scaling) of the float step's second chunk of ``ids`` (default: the
    evaluation text)."""
    step = export_chunk_step(lm.model, chunk).module()
    ids = (tokenize(lm, read_text(None, "eval")) if ids is None else ids)[: 2 * chunk]
    shape = kv_shape(lm.model.config)
    past_k = [torch.zeros(1, shape.kv_heads, 0, shape.head_dim) for _ in range(shape.layers)]
    past_v = [torch.zeros(1, shape.kv_heads, 0, shape.head_dim) for _ in range(shape.layers)]
    seen: dict[int, tuple] = {}

    class Capture(torch.fx.Interpreter):
        def run_node(self, node):
            if node.op == "call_function" and node.target in ATTENTION_TARGETS:
                seen[layer_of(node)] = tuple(self.fetch_args_kwargs_from_env(node)[0][:5])
            return super().run_node(node)

    with torch.inference_mode():
        for start in (0, chunk):
            feed = (ids[None, start:start + chunk], torch.arange(start, start + chunk), torch.tensor([chunk - 1]),
                    past_k, past_v)
            flat = torch.utils._pytree.tree_leaves(Capture(step).run(*torch.utils._pytree.tree_leaves(feed)))
            past_k, past_v = flat[1:1 + shape.layers], flat[1 + shape.layers:1 + 2 * shape.layers]
    return seen


def run_method(edge, inputs) -> torch.Tensor:
    from executorch.runtime import Runtime

    (name,) = edge.methods
    return Runtime.get().load_program(edge.to_executorch().buffer).load_method(name).execute(list(inputs))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--window", type=int, default=768)
    ap.add_argument("--soc", default="SM8750")
    ap.add_argument("--layers", type=int, default=None, help="the first N layers only")
    args = ap.parse_args()
    activate()
    lm = load_model("smollm2-135m")
    ranges = attention_ranges_of(lm, args.chunk)
    captured = captured_attention(lm, args.chunk)
    rows = []
    for layer in sorted(captured)[: args.layers]:
        q, k, v, mask, scaling = captured[layer]
        length = k.shape[2]
        if length > args.window:
            raise SystemExit(f"--window must hold the {length} keys of two chunks")
        pad = args.window - length
        kw = torch.nn.functional.pad(k, (0, 0, 0, pad))
        vw = torch.nn.functional.pad(v, (0, 0, 0, pad))
        allowed = torch.nn.functional.pad(mask.reshape(args.chunk, length), (0, pad), value=False)
        enc = AttentionEncodings.of_ranges(ranges[layer], kv_bits=16)
        ref = npu_attention(q, kw, vw, allowed, scaling, enc)
        flt = chunk_attention(q, k, v, mask, scaling, 0.0)
        example = graph_inputs(q, kw, vw, allowed, scaling, enc)
        t = time.perf_counter()
        edge = lower_attention(f"attention_{layer}", enc, scaling, example, args.soc)
        lowered = time.perf_counter() - t
        got = output_of(run_method(edge, example), q.shape[1])
        steps = ((got - ref).abs() / enc.out.scale).round()

        def sqnr(x):
            return float(10 * torch.log10(flt.pow(2).sum() / (x - flt).pow(2).sum()))
        rows.append({"layer": layer, "max_steps": int(steps.max()), "mean_steps": round(float(steps.mean()), 3),
                     "within_1_step": round(float((steps <= 1).float().mean()), 4),
                     "sqnr_vs_float_htp": round(sqnr(got), 2), "sqnr_vs_float_reference": round(sqnr(ref), 2),
                     "lower_s": round(lowered, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"# smollm2-135m, chunk {args.chunk}, window {args.window}, {args.soc} on the HTP simulator; "
          f"host {detect().model}")
    print(f"layers {len(rows)}: max steps {max(r['max_steps'] for r in rows)}, "
          f"mean steps {statistics.mean(r['mean_steps'] for r in rows):.2f}, "
          f"within 1 step (worst layer) {min(r['within_1_step'] for r in rows):.3f}; SQNR vs float: HTP "
          f"min {min(r['sqnr_vs_float_htp'] for r in rows):.1f} / median "
          f"{statistics.median(r['sqnr_vs_float_htp'] for r in rows):.1f} dB, reference min "
          f"{min(r['sqnr_vs_float_reference'] for r in rows):.1f} / median "
          f"{statistics.median(r['sqnr_vs_float_reference'] for r in rows):.1f} dB")


if __name__ == "__main__":
    main()
