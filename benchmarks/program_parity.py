"""An exported program against the engine it came from and the float model: prefill logits (SQNR), the
decode step against Hugging Face's from the same K/V, greedy tokens against the wrapper, and
teacher-forced agreement with the float model's own answer.

Usage: python benchmarks/program_parity.py model.pte [other.pte ...] [--tokens 64]
(programs of the default model settings at chunk 256, e.g. `llmnpu export --backend cpu-int8 --chunk 256`;
one with `--shadow-branch dense --decode fp32` gives the reference forms). Prompts: examples/prompt.txt as
a chat, and 700 tokens of the evaluation text; teacher-forced agreement on the chat prompt alone and with
the six questions of benchmarks/greedy_agreement.py (``--tokens`` each).
"""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")


def main() -> None:
    from transformers import DynamicCache

    from llmnpu_delegate.hf import LlmNpuForCausalLM, extend_hf_cache
    from llmnpu_delegate.quantize import quant_config
    from llmnpu_delegate.runtime.hf_decoder import DecodeCache
    from llmnpu_delegate.runtime.engine import export_engine
    from llmnpu_delegate.runtime.pte_runner import PteRunner
    from llmnpu_delegate.runtime.validate import sqnr_db
    from llmnpu_delegate.text import CHAT_QUESTIONS, read_text, tokenize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pte", nargs="+")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    runners = {p: PteRunner(p) for p in args.pte}
    spec = next(iter(runners.values())).meta["model"]["spec"]
    chunk = next(iter(runners.values())).chunk_len
    lm, engine = export_engine(spec, chunk, quant_config("w8a8-shadow", None), progress=False)
    model, tok = lm.model, lm.tokenizer
    prompt = (Path(__file__).resolve().parents[1] / "examples" / "prompt.txt").read_text()
    demo = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"][0]
    prompts = {"demo": demo, "eval700": tokenize(lm, read_text(None, "eval"))[:700]}

    result = {}
    for name, ids in prompts.items():
        want = engine(ids)
        with torch.no_grad():
            f = model(ids[None]).logits[0, -1]
        result[f"{name}/engine_vs_fp32_db"] = round(sqnr_db(want.logits, f), 2)
        for path, r in runners.items():
            got = r(ids)
            result[f"{name}/{path}"] = {"vs_engine_db": round(sqnr_db(got.logits, want.logits), 2),
                                        "vs_fp32_db": round(sqnr_db(got.logits, f), 2), "next": int(got.logits.argmax()),
                                        "engine_next": int(want.logits.argmax()), "fp32_next": int(f.argmax())}

    n = args.tokens
    wrapper = LlmNpuForCausalLM(lm, chunk_len=chunk, prefix_cache=False, progress=False)
    want = wrapper.generate(demo[None], attention_mask=torch.ones(1, demo.numel(), dtype=torch.long), max_new_tokens=n,
                            do_sample=False, pad_token_id=tok.eos_token_id)[0, demo.numel():].tolist()
    for path, r in runners.items():
        p = r(demo)
        cache = DynamicCache(config=model.config)
        extend_hf_cache(cache, p)
        first = int(p.logits.argmax())
        with torch.no_grad():
            hf_step = model(torch.tensor([[first]]), past_key_values=cache, use_cache=True).logits[0, -1]
        step = r.decode(r.start_decode(p), first)
        got = r.generate(demo, n, eos_ids=[tok.eos_token_id]).tokens
        same = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)))
        result[path] = {"decode": r.meta["decode"]["mode"], "decode_step_vs_hf_db": round(sqnr_db(step, hf_step), 2),
                        "decode_step_max_diff": float((step - hf_step).abs().max()),
                        "greedy_same_prefix": same, "greedy_identical": got == want}

    # Teacher-forced agreement with the float model's own greedy answer: the demo prompt alone (64
    # tokens: one miss moves it by 0.016), and with the six chat questions of greedy_agreement.py
    questions = {"demo": demo, **{f"q{i}": tok.apply_chat_template([{"role": "user", "content": q}],
                                                                     add_generation_prompt=True, return_tensors="pt",
                                                                     return_dict=True)["input_ids"][0]
                                  for i, q in enumerate(CHAT_QUESTIONS)}}
    hits: dict = {}
    for qname, ids in questions.items():
        with torch.no_grad():
            ref = model.generate(ids[None], max_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.eos_token_id)[0, ids.numel():]
        pre = engine(ids)
        cache = DynamicCache(config=model.config)
        extend_hf_cache(cache, pre)
        with torch.no_grad():
            rest = model(ref[None, :-1], past_key_values=cache).logits[0].argmax(-1)
        preds = {"wrapper_teacher_forced": torch.cat([pre.logits.argmax().reshape(1), rest])}
        if wrapper.decoder is not None:          # the wrapper's own INT8 decode, the INT8 program's peer
            static = DecodeCache(model.config, pre.tokens + len(ref))
            extend_hf_cache(static, pre)
            steps = [int(wrapper.decoder.step(t.reshape(1, 1), static)[0].argmax()) for t in ref[:-1]]
            preds["wrapper_int8_decode_teacher_forced"] = torch.tensor([int(pre.logits.argmax()), *steps])
        for path, r in runners.items():
            p = r(ids)
            state = r.start_decode(p)
            preds[path] = torch.tensor([int(p.logits.argmax()), *[int(r.decode(state, t).argmax()) for t in ref[:-1].tolist()]])
        for way, pred in preds.items():
            h = hits.setdefault(way, {"demo": (0, 0), "all": (0, 0)})
            match = int((pred == ref).sum())
            for scope in (("demo", "all") if qname == "demo" else ("all",)):
                h[scope] = (h[scope][0] + match, h[scope][1] + len(ref))
    for way, h in hits.items():
        demo_share = round(h["demo"][0] / h["demo"][1], 3)
        all_share = round(h["all"][0] / h["all"][1], 3)
        if way in runners:
            result[way].update(teacher_forced=demo_share, teacher_forced_7_prompts=all_share,
                               teacher_forced_tokens=h["all"][1])
        else:
            result[way] = demo_share
            result[way + "_7_prompts"] = all_share
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
