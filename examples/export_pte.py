"""The ExecuTorch flow, step by step: torch.export -> our encodings -> our partitioner ->
to_edge_transform_and_lower -> .pte, then the .pte run by the ExecuTorch runtime.

    .venv/bin/python examples/export_pte.py [--chunk 128] [--layers N] [--out prefill_chunk.pte]

The program is one prefill chunk of the embedded model (the first chunk: no past), with W8A8 and
shadow outliers. Its NPU regions (the decoder linears, grouped by shared input) are delegated by
LlmNpuPartitioner to XNNPACK's INT8 kernels with *our* calibrated scales; the shadow branches and
the rest of the model run on ExecuTorch's portable float kernels. On a phone, the QNN delegate takes
the place of XNNPACK for the NPU regions. The last step compares the .pte's logits with our
cpu-int8 engine. ``--layers N`` keeps the first N decoder blocks (a quick run; default: all 30).

This is the whole-graph view of the partitioner. The deployable artefact, one method per shared
subgraph (QNN or XNNPACK INT8) with a sidecar and a reference runner, is ``llmnpu export``.
"""
import argparse
import os
from pathlib import Path

import torch
from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.backend.partitioner import DelegationSpec
from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from llmnpu_delegate import load_model
from llmnpu_delegate.lower.encodings import LlmNpuQuantizer
from llmnpu_delegate.lower.shadow_branches import add_shadow_paths
from llmnpu_delegate.partitioner.executorch import LlmNpuPartitioner
from llmnpu_delegate.prepare import default_calibration
from llmnpu_delegate.quantize import QuantConfig, plan_linears, quantizable_linears
from llmnpu_delegate.runtime.engine import Prefiller
from llmnpu_delegate.text import read_text, tokenize

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--chunk", type=int, default=128)
ap.add_argument("--layers", type=int, default=0, help="keep the first N decoder blocks (default: all)")
ap.add_argument("--out", default="prefill_chunk.pte")
args = ap.parse_args()

lm = load_model(args.model)
config = QuantConfig()                                    # W8A8 + shadow, 85 % of layers pruned
plans = plan_linears(lm.model, default_calibration(lm), config, lm.fingerprint)
if args.layers:
    lm.model.model.layers = lm.model.model.layers[: args.layers]
    lm.model.config.num_hidden_layers = args.layers
    plans = {n: p for n, p in plans.items() if int(n.split(".")[2]) < args.layers}
calib_ids = tokenize(lm, read_text(None, "calib"))[: args.chunk][None]
ids = tokenize(lm, read_text(None, "eval"))[: args.chunk][None]


class ChunkLogits(torch.nn.Module):
    """One prefill chunk without a past: token ids -> logits of its last token."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits[:, -1]


# 1. torch.export (the model's own modules; SDPA attention, which ExecuTorch decomposes)
lm.model.config._attn_implementation = "sdpa"
exported = torch.export.export(ChunkLogits(lm.model).eval(), (ids,), strict=False)

# 2. shadow branches as float ops, then our encodings: fixed activation and weight scales from
#    the plan; only each linear's output encoding is observed, on one chunk of calibration text
graph = exported.module()
shadowed = add_shadow_paths(graph, plans, prefix="model.")
prepared = prepare_pt2e(graph, LlmNpuQuantizer(plans, config.weights, flavour="xnnpack", prefix="model."))
prepared(calib_ids)
quantized = torch.export.export(convert_pt2e(prepared), (ids,), strict=False)

# 3. our partitioner tags the NPU regions (and their quantize/dequantize boundary) for XNNPACK's
#    INT8 kernels; everything else stays on ExecuTorch's portable kernels
npu = LlmNpuPartitioner(quantizable_linears(lm.model), prefix="model.",
                        delegation_spec=DelegationSpec(XnnpackBackend.__name__, []))
edge = to_edge_transform_and_lower(quantized, partitioner=[npu])
regions = sum(1 for n in edge.exported_program().graph_module.graph.nodes
              if n.op == "get_attr" and n.target.startswith("lowered_module"))

# 4. the .pte, written to a temporary name and renamed
program = edge.to_executorch()
out = Path(args.out)
tmp = out.with_name(f".{out.name}.tmp")
tmp.write_bytes(program.buffer)
os.replace(tmp, out)
print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {regions} NPU regions delegated, "
      f"{len(shadowed)} shadow branches, {lm.model.config.num_hidden_layers} blocks, chunk {args.chunk}")

# 5. run it with the ExecuTorch runtime and compare with our cpu-int8 engine and the float model
data = out.read_bytes()                     # the runtime reads this buffer in place: keep it alive
pte = _load_for_executorch_from_buffer(data)
pte_logits = pte.forward((ids,))[0][0].clone()
engine_logits = Prefiller(lm, chunk_len=args.chunk, quant=config).__call__(ids).logits
with torch.no_grad():
    float_logits = lm.model(ids).logits[0, -1]
decode = lm.tokenizer.decode


def sqnr(x, ref):
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


print(f"pte vs cpu-int8 engine: SQNR {sqnr(pte_logits, engine_logits):.1f} dB, "
      f"max |diff| {float((pte_logits - engine_logits).abs().max()):.3f}; "
      f"engine vs fp32: SQNR {sqnr(engine_logits, float_logits):.1f} dB")
print(f"next token: pte {decode(pte_logits.argmax())!r}, engine {decode(engine_logits.argmax())!r}, "
      f"fp32 {decode(float_logits.argmax())!r}")
