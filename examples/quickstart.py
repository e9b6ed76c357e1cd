"""Quickstart: load the embedded model, prepare it for the NPU path, chat with generate().

    .venv/bin/python examples/quickstart.py [--max-new-tokens 48] [--model smollm2-135m]

The prompt is prefilled in chunks on the INT8 stand-in NPU (shadow outliers, out-of-order
schedule); the answer is decoded on the CPU from the KV cache the prefill produced. The first run
calibrates and compiles (a few minutes, cached); later runs start in seconds.
"""
import argparse

from transformers import TextStreamer

from llmnpu_delegate.hf import LlmNpuForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--max-new-tokens", type=int, default=48)
ap.add_argument("--pruning-rate", type=float, default=None, help="shadow paths removed from this share of layers")
args = ap.parse_args()

model = LlmNpuForCausalLM.from_pretrained(args.model, chunk_len=256, quant="w8a8-shadow",
                                          pruning_rate=args.pruning_rate)
tok = model.tokenizer
messages = [{"role": "user", "content": "Give me three tips for writing clear technical documentation."}]
inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

# transformers' own generate(): greedy here; do_sample/temperature/top_p, eos_token_id, streamers all work
out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                     streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
stats = model.last_prefill
print(f"\nprefill: {stats['tokens']} tokens in {stats['chunks']} chunk(s), {1e3 * stats['prefill_s']:.0f} ms; "
      f"{100 * stats['outlier_share']:.2f} % of activations on the shadow path")
