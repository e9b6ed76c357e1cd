"""torch.compile with the llmnpu backend: the same partitioner on Dynamo's graph, NPU regions in INT8.

    .venv/bin/python examples/torch_compile.py [--model smollm2-135m] [--tokens 64]

compile_options() holds the quantization plan (calibrated on the shipped news text, cached). The
compiled model is checked against two eager references: the float model and the same W8A8 +
shadow quantization applied in place with quantize_ (the compiled graph should equal the latter).
"""
import argparse
import copy

import torch

from llmnpu_delegate import load_model
from llmnpu_delegate.compile import compile_options
from llmnpu_delegate.prepare import default_calibration
from llmnpu_delegate.quantize import QuantConfig, quantize_

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--tokens", type=int, default=64)
args = ap.parse_args()

lm = load_model(args.model)
calib = default_calibration(lm)
options = compile_options(lm, "w8a8-shadow", calibration=calib)
compiled = torch.compile(lm.model, backend="llmnpu", options=options)

text = "The lighthouse keeper climbed the stairs every evening to light the lamp, and"
ids = lm.tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
reference = copy.deepcopy(lm.model)
quantize_(reference, calib, QuantConfig(), lm.fingerprint)
with torch.no_grad():
    got = compiled(ids).logits[0, -1]
    quantized = reference(ids).logits[0, -1]
    fp32 = lm.model(ids).logits[0, -1]
print(f"max |compiled - eager W8A8+shadow| = {float((got - quantized).abs().max()):.3g}")
print(f"max |compiled - eager fp32|        = {float((got - fp32).abs().max()):.3g}")
print(f"graphs and calls on the NPU path / eagerly: {options['counters'].to_dict()}")
print(f"next token: compiled {lm.tokenizer.decode(got.argmax())!r}, fp32 {lm.tokenizer.decode(fp32.argmax())!r}")
