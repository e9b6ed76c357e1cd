"""The native runner against the Python reference runner, the cpu-int8 engine and Hugging Face's eager
decode, in one process, interleaved (these machines are shared: only same-run ratios count).

Usage: python benchmarks/bench_native.py model.pte [other.pte ...] [--prompt-len 1024] [--new-tokens 32]
       [--repeats 3] [--trace-dir D]
(cpu-int8 programs of the default settings, e.g. `llmnpu export --backend cpu-int8 --chunk 256 --context 1280`
and the same with `--model random:qwen2-0.5b`.)

Per program: prefill of the same prompt by the engine the program came from (its ``ooo`` executor on its
own kernels), by the Python reference runner and by ``llmnpu-runner`` (both on the program's methods),
and decode tok/s of both runners and of transformers' eager loop (fp32, a DynamicCache, the same two
cores) from the same prompt. Every timed run is warm (the native one with ``--warmup``); the native
runner's cold first prefill in a fresh process is reported apart. The native run's trace and timeline go to --trace-dir.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")


@torch.inference_mode()
def hf_decode_tok_s(model, ids: torch.Tensor, n: int) -> float:
    """Greedy decode of ``n`` tokens after ``ids`` with transformers' eager forward and its cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[0, -1].argmax().view(1, 1)
    t = time.perf_counter()
    for _ in range(n):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[0, -1].argmax().view(1, 1)
    return n / (time.perf_counter() - t)


def bench_program(pte: Path, prompt_len: int, new_tokens: int, repeats: int, trace_dir: Path | None) -> dict:
    from llmnpu_delegate.measure.speed import prompt_ids
    from llmnpu_delegate.quantize import quant_config
    from llmnpu_delegate.runtime.engine import export_engine
    from llmnpu_delegate.runtime.native import run_native
    from llmnpu_delegate.runtime.pte_runner import PteRunner
    from llmnpu_delegate.runtime.trace import metrics, read_trace, write_timeline

    runner = PteRunner(pte)
    meta = runner.meta
    spec, blocks = meta["model"]["spec"], meta["model"].get("blocks")
    quant = quant_config("w8a8-shadow", meta["quant"]["pruning_rate"])
    lm, engine = export_engine(spec, meta["chunk_len"], quant, blocks=blocks, progress=False,
                               placement=meta["placement"])
    ids = prompt_ids(lm, prompt_len)
    threads = torch.get_num_threads()
    engine(ids, policy="ooo")                                 # warm-ups
    runner.generate(ids, 2)
    cold = run_native(pte, ids.tolist(), meta, 2).summary      # a fresh process: first calls included
    rows: dict[str, list[float]] = {k: [] for k in ("engine_s", "python_s", "native_s", "python_decode", "native_decode",
                                                     "hf_decode", "decision_us")}
    for _ in range(repeats):
        engine(ids, policy="ooo")
        rows["engine_s"].append(engine.last_run.wall_s)
        g = runner.generate(ids, new_tokens)
        rows["python_s"].append(g.prefill_s)
        rows["python_decode"].append(g.decode_tok_s)
        # --warmup: one chunk and one decode step first, as the other two have had (not timed)
        n = run_native(pte, ids.tolist(), meta, new_tokens, extra=["--warmup"]).summary
        rows["native_s"].append(n["prefill_s"])
        rows["native_decode"].append(n["decode_tok_s"])
        rows["decision_us"].append(n["decision_us"])
        torch.set_num_threads(threads)
        rows["hf_decode"].append(hf_decode_tok_s(lm.model, ids, new_tokens))
    med = {k: statistics.median(v) for k, v in rows.items()}
    out = {"pte": str(pte), "model": spec, "placement": meta["placement"], "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
           "engine_prefill_tok_s": prompt_len / med["engine_s"],
           "python_prefill_tok_s": prompt_len / med["python_s"],
           "native_prefill_tok_s": prompt_len / med["native_s"],
           "native_cold_prefill_tok_s": prompt_len / cold["prefill_s"],
           "native_time_vs_engine": med["native_s"] / med["engine_s"],
           "native_speedup_vs_python": med["python_s"] / med["native_s"],
           "hf_decode_tok_s": med["hf_decode"], "python_decode_tok_s": med["python_decode"],
           "native_decode_tok_s": med["native_decode"],
           "native_decode_vs_hf": med["native_decode"] / med["hf_decode"],
           "decision_us": med["decision_us"]}
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        trace = trace_dir / f"{pte.stem}.native.trace.json"
        run_native(pte, ids.tolist(), meta, 1, trace=trace, extra=["--warmup"])
        stats = read_trace(trace)
        m = metrics(stats)
        out.update(trace=str(trace), npu_busy_s=m["npu_busy_s"], cpu_busy_s=m["cpu_busy_s"],
                   npu_bubble_rate=m["npu_bubble_rate"],
                   timeline=str(write_timeline(stats, trace_dir / f"{pte.stem}.native.png",
                                               f"llmnpu-runner: {spec}, {prompt_len} tokens, chunk {meta['chunk_len']}, ooo")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pte", nargs="+", type=Path)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace-dir", type=Path, default=None)
    args = ap.parse_args()
    results = [bench_program(p, args.prompt_len, args.new_tokens, args.repeats, args.trace_dir) for p in args.pte]
    print(json.dumps(results, indent=1))
    print("\n| model | placement | prefill tok/s engine / python / native | native time vs engine | decode tok/s HF / python / "
          "native | native decode vs HF | decision |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['placement']} | {r['engine_prefill_tok_s']:.0f} / {r['python_prefill_tok_s']:.0f} / "
              f"{r['native_prefill_tok_s']:.0f} | {r['native_time_vs_engine']:.2f}x | {r['hf_decode_tok_s']:.1f} / "
              f"{r['python_decode_tok_s']:.1f} / {r['native_decode_tok_s']:.1f} | {r['native_decode_vs_hf']:.2f}x | "
              f"{r['decision_us']:.1f} us |")


if __name__ == "__main__":
    main()
