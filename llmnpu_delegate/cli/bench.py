"""``llmnpu bench``."""
from __future__ import annotations

from ..measure.speed import bench, bench_e2e
from ..measure.turns import bench_turns, format_turns
from ..chunk_step import DEFAULT_CHUNK
from ..errors import LlmNpuError
from ..kernels.attention import PRECISIONS as ATTENTION_PRECISIONS
from ..logs import hide_progress_bars
from ..models import DEFAULT_MODEL, load_model
from ..partitioner.placement import AUTO
from ..quantize import QUANT_MODES
from ..generation import placement_line, prompt_ids
from ..runtime.schedule import POLICIES
from .common import PLACEMENT_HELP, add_output_args, machine_line, placement_or_auto, read_prompt


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="prefill speed of each scheduling policy against HF eager fp32 and llama.cpp",
                       description="Time the chunked prefill (two workers: INT8 'npu', float 'cpu') under each "
                                   "policy, interleaved with the baselines, in one process; medians of --repeats.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model spec (default {DEFAULT_MODEL})")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help=f"chunk length (default {DEFAULT_CHUNK})")
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES),
                   help="scheduling policies to time (default: all)")
    p.add_argument("--quant", choices=[m for m in QUANT_MODES if m != "fp32"] + ["fp32"], default="w8a8-shadow",
                   help="quantization (default w8a8-shadow)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per variant (default 3)")
    p.add_argument("--attention", choices=list(ATTENTION_PRECISIONS), default="auto",
                   help="precision of the float side's attention and LM head (default auto: bf16 operands "
                        "and head weights with fp32 accumulation for the quantized modes where the CPU has "
                        "AVX-512 BF16)")
    p.add_argument("--placement", type=placement_or_auto, default=AUTO, help=PLACEMENT_HELP)
    p.add_argument("--ablation", action="store_true",
                   help="add the paper's Figure 19 steps (naive, + chunk-sharing, + shadow outliers, + out-of-order)")
    p.add_argument("--trace-dir", default=None, help="write Chrome/Perfetto traces and timeline PNGs here")
    p.add_argument("--e2e", action="store_true",
                   help="instead: time to first token and decode speed of one prompt (--prompt/--prompt-file) for HF "
                        "eager generate, the wrapper with float and INT8 decode, and llama.cpp")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="with --e2e: prompt text")
    src.add_argument("--prompt-file", help="with --e2e: read the prompt from this text file")
    p.add_argument("--chat", action="store_true", help="with --e2e: wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="with --e2e: tokens to generate (default 64)")
    p.add_argument("--turns", type=int, default=None,
                   help="with --e2e, instead of one prompt: TTFT at each turn of N-turn conversations (the whole "
                        "history sent every turn) for the wrapper with and without its prefix cache, HF generate "
                        "with past_key_values and llama.cpp keeping its context")
    p.add_argument("--form", choices=["agent", "chat"], default="agent",
                   help="with --turns: agent (~400 fixed tokens, a ~300-token screen and a 16-token answer a turn; "
                        "default) or chat (a ~40-token question and a 16-token answer a turn)")
    add_output_args(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> dict:
    if args.no_progress:
        hide_progress_bars()
    if args.turns is not None:
        if not args.e2e or args.prompt is not None or args.prompt_file is not None:
            raise LlmNpuError("--turns times conversations of the shipped text: give it with --e2e and without "
                              "--prompt/--prompt-file")
        result = bench_turns(load_model(args.model), args.form, args.turns, args.chunk, args.repeats, args.quant,
                             progress=not args.no_progress)
        args.text = format_turns(result)
        return result
    if args.e2e != (args.prompt_file is not None or args.prompt is not None):
        raise LlmNpuError("--e2e times one prompt: give --e2e with --prompt or --prompt-file (and only with --e2e)")
    lm = load_model(args.model)
    if args.e2e:
        ids = prompt_ids(lm.tokenizer, lm.spec, read_prompt(args), args.chat)[0]
        result = bench_e2e(lm, ids, args.max_new_tokens, args.chunk, args.repeats, args.quant,
                           progress=not args.no_progress, placement=str(args.placement))
        args.text = _format_e2e(result)
        return result
    result = bench(lm, args.prompt_len, args.chunk, tuple(args.policies), args.ablation, args.trace_dir,
                   args.repeats, args.quant, progress=not args.no_progress, attention=args.attention,
                   placement=str(args.placement))
    args.text = _format_bench(result)
    return result


def _format_bench(r: dict) -> str:
    lines = [f"prefill of {r['prompt_len']} tokens, {r['model']}, chunk {r['chunk']}, {r['threads']} threads, "
             f"{r['quant']}, placement {r['placement']}, median of {r['repeats']}", machine_line(r)]
    if r.get("placement_prefill_s"):
        lines.append(placement_line(r["placement"], r["placement_prefill_s"]))
    rows = [("hf fp32 (eager)", r["hf_fp32_tok_s"], None, None)]
    if r.get("hf_fp32_default_malloc_tok_s"):
        rows.append(("hf fp32, default malloc", r["hf_fp32_default_malloc_tok_s"], None, None))
    for p in POLICIES:
        if f"{p}_tok_s" in r:
            rows.append((f"llmnpu {p}", r[f"{p}_tok_s"], r[f"bubble_rate_{p}"], r.get(f"decision_us_{p}")))
    rows.append(("two-engine bound", r["bound_tok_s"], None, None))
    if r.get("llamacpp_tok_s"):
        rows.append(("llama.cpp (same GGUF)", r["llamacpp_tok_s"], None, None))
    lines.append(f"{'':<24}{'tok/s':>9}{'vs hf':>8}{'NPU bubbles':>13}{'decision':>11}")
    for name, tok_s, bubbles, decision in rows:
        b = f"{100 * bubbles:.1f} %" if bubbles is not None else ""
        d = f"{decision:.1f} us" if decision is not None else ""
        lines.append(f"{name:<24}{tok_s:>9.1f}{tok_s / r['hf_fp32_tok_s']:>7.2f}x{b:>13}{d:>11}")
    if "ooo_vs_inorder" in r:
        lines.append(f"ooo vs inorder {r['ooo_vs_inorder']:.2f}x, efficiency vs bound {r['efficiency_vs_bound']:.2f}")
    lent = {p: r[f"pieces_lent_{p}"] for p in POLICIES if r.get(f"pieces_lent_{p}")}
    if lent:
        lines.append("lane help: an idle worker ran " + ", ".join(f"{n} ({p})" for p, n in lent.items())
                     + " pieces of the other lane's kernels a run (LLMNPU_LANE_HELP=0 turns it off)")
    stolen = {p: r[f"stolen_{p}"] for p in POLICIES if r.get(f"stolen_{p}")}
    if stolen:
        lines.append("lane stealing: an idle worker ran " + ", ".join(f"{n} ({p})" for p, n in stolen.items())
                     + " of the other lane's tasks a run (LLMNPU_LANE_HELP=0 turns it off)")
    if r.get("llamacpp_reason"):
        lines.append(f"llama.cpp: not measured ({r['llamacpp_reason']})")
    for step, tok_s in r.get("ablation", {}).get("tok_s", {}).items():
        lines.append(f"ablation {step}: " + (f"{tok_s:.1f} tok/s" if tok_s else "not timed (policy not selected)"))
    for p, files in r.get("traces", {}).items():
        lines.append(f"trace {p}: {files['json']}  timeline: {files['png']}")
    return "\n".join(lines)


def _format_e2e(r: dict) -> str:
    names = {"hf_eager": "HF eager generate", "wrapper_fp32_decode": "llmnpu, float decode",
             "wrapper_int8_decode": "llmnpu, INT8 decode", "llamacpp": "llama.cpp (same GGUF)"}
    lines = [f"{r['model']}: {r['prompt_tokens']}-token prompt, {r['new_tokens']} new tokens, {r['threads']} threads, "
             f"placement {r['placement']}, median of {r['repeats']}", machine_line(r),
             f"{'':<26}{'TTFT':>9}{'vs hf':>8}{'decode':>12}{'vs hf':>8}"]
    for name, v in r["variants"].items():
        lines.append(f"{names.get(name, name):<26}{1e3 * v['ttft_s']:>7.0f}ms{v['ttft_vs_hf']:>7.2f}x"
                     f"{v['decode_tok_s']:>8.1f}tok/s{v['decode_vs_hf']:>7.2f}x")
    if r.get("llamacpp_reason"):
        lines.append(f"llama.cpp: not measured ({r['llamacpp_reason']})")
    return "\n".join(lines)
