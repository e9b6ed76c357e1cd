"""How close INT8 decode (``runtime/decode.Int8Decoder``) stays to float decode, and what it costs, per
number of per-token outliers taken out of the INT8 activation.

    .venv/bin/python benchmarks/decode_accuracy.py [--outliers 0 2 4 8 16] [--windows 3]

On the *calibration* text (news; the evaluation text is never used to choose a setting): for each
window, the float model prefills 200 tokens, then decodes the next 100 teacher-forced, once with its
own forward (the reference) and once with the decoder. Prints the share of steps whose greedy token
agrees, the logits' SQNR against the reference, and the median step time (interleaved runs).
"""
import argparse
import json
import statistics
import time

import torch

from llmnpu_delegate import load_model
from llmnpu_delegate.hf import fill_cache
from llmnpu_delegate.runtime.decode import DecodeCache, Int8Decoder
from llmnpu_delegate.text import read_text, tokenize

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--outliers", type=int, nargs="+", default=[0, 2, 4, 8, 16])
ap.add_argument("--windows", type=int, default=3)
args = ap.parse_args()

lm = load_model(args.model)
model = lm.model
text = tokenize(lm, read_text(None, "calib"))
decoders = {k: Int8Decoder(model, "int8", outliers=k) for k in args.outliers}
decoders["bf16"] = Int8Decoder(model, "bf16")
stats = {k: {"same": 0, "steps": 0, "err": 0.0, "ref": 0.0, "times": []} for k in decoders}
with torch.inference_mode():
    for w in range(args.windows):
        start = 4000 + 4000 * w
        ids = text[None, start:start + 300]
        out = model(ids[:, :200], use_cache=True)
        past_k = [layer.keys for layer in out.past_key_values.layers]
        past_v = [layer.values for layer in out.past_key_values.layers]
        ref = model(ids[:, 200:], past_key_values=out.past_key_values).logits[0]

        class Prefill:   # what fill_cache reads
            pass
        pre = Prefill()
        pre.past_k, pre.past_v = past_k, past_v
        for k, dec in decoders.items():
            cache = DecodeCache(model.config, 310)
            fill_cache(cache, pre)
            rows = []
            for i in range(100):
                t = time.perf_counter()
                rows.append(dec.step(ids[:, 200 + i:201 + i], cache)[0])
                stats[k]["times"].append(time.perf_counter() - t)
            got = torch.stack(rows)
            stats[k]["same"] += int((got.argmax(-1) == ref.argmax(-1)).sum())
            stats[k]["steps"] += 100
            stats[k]["err"] += float((got - ref).pow(2).sum())
            stats[k]["ref"] += float(ref.pow(2).sum())
for k, s in stats.items():
    print(json.dumps({"outliers": k, "agreement": round(s["same"] / s["steps"], 3),
                      "sqnr_db": round(10 * torch.log10(torch.tensor(s["ref"] / s["err"])).item(), 1),
                      "step_ms": round(1e3 * statistics.median(s["times"]), 2)}))
