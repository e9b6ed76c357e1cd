"""Greedy agreement of the NPU-prefilled wrapper with the float model, per quantization setting.

    .venv/bin/python benchmarks/greedy_agreement.py [--max-new-tokens 24] [--pruning-rates auto 0.75 0]

Six chat prompts on the embedded model. For each setting: the share of the float model's greedy
tokens that the wrapper predicts when fed the same continuation (teacher-forced), the share of
positions where the two free-running greedy outputs agree, and the prompts whose first token agrees.
"""
import argparse
import json

from llmnpu_delegate import load_model
from llmnpu_delegate.cli.common import pruning_rate
from llmnpu_delegate.hf import LlmNpuForCausalLM, greedy_agreement
from llmnpu_delegate.text import CHAT_QUESTIONS


ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--max-new-tokens", type=int, default=24)
ap.add_argument("--pruning-rates", type=pruning_rate, nargs="+", default=["auto", 0.75, 0.0],
                help='"auto" (the default choice on this machine) or shares in [0, 1]')
args = ap.parse_args()

lm = load_model(args.model)
prompts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"] for q in CHAT_QUESTIONS]
settings = [("w8a8-shadow", rate) for rate in args.pruning_rates] + [("w8a8", None)]
for quant, rate in settings:
    wrapper = LlmNpuForCausalLM(lm, quant=quant, pruning_rate=rate, prefix_cache=False, progress=False)
    result = greedy_agreement(wrapper, prompts, args.max_new_tokens)
    print(json.dumps({"quant": quant, "pruning_rate": rate, **{k: round(v, 3) for k, v in result.items()}}))
