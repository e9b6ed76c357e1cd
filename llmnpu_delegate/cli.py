"""The `llmnpu` command line: run, eval, calibrate, partition, bench, simulate, export, validate, prepare-text."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path


def _quiet_third_party_logs() -> None:
    # torchao (pulled in by transformers) logs missing CUDA kernels and pytree notices on import.
    for name in ("torchao", "torch.utils._pytree", "transformers.modeling_utils",
                 "transformers.distributed.tensor_parallel"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # torch's own deprecation notice, once per graph copied during export
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (default), a Hugging Face folder, a .gguf file or random:<shape>")
    p.add_argument("--calib-text-file", default=None,
                   help="calibration text (default: the shipped news text, disjoint from the evaluation text)")
    p.add_argument("--calib-samples", type=int, default=8, help="calibration sequences (default 8)")
    p.add_argument("--calib-tokens", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--calib-percentiles", type=float, nargs="+", default=None,
                   help="percentiles of |x| to record (default 99 99.5 99.9 99.99); clipping uses one of them")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _add_output_args(p: argparse.ArgumentParser, json_help: str = "print one JSON object") -> None:
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--json", action="store_true", help=json_help)


def _setup(args):
    import torch

    from .errors import LlmNpuError
    from .models import load_model
    from .quantize import CalibConfig

    if args.threads is not None:
        if args.threads < 1:
            raise LlmNpuError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    lm = load_model(args.model)
    extra = {"percentiles": tuple(args.calib_percentiles)} if args.calib_percentiles else {}
    calib_config = CalibConfig(samples=args.calib_samples, tokens=args.calib_tokens, **extra)
    return lm, calib_config


def cmd_calibrate(args) -> dict:
    from .quantize import load_or_calibrate
    from .quantize.importance import ratio_importance
    from .text import calibration_ids

    lm, calib_config = _setup(args)
    ids = calibration_ids(lm, args.calib_text_file)
    calib = load_or_calibrate(lm.model, ids, lm.fingerprint, calib_config, path=args.out,
                              progress=not args.no_progress)
    p = args.clip_percentile
    calib.threshold(next(iter(calib.layers)), p)  # a clear error if p was not calibrated
    ratio = ratio_importance(calib, p)  # the paper's importance: largest outlier / scale
    layers = {n: {"absmax": round(s.absmax, 4), f"p{p}": round(s.percentiles[p], 4),
                  "outlier_fraction": round(s.outlier_fraction(p), 5),
                  "max_over_scale": round(ratio[n], 1)}
              for n, s in calib.layers.items()}
    return {"model": lm.spec, "fingerprint": lm.fingerprint, "artefact": str(calib.path),
            "calibration": calib.config.to_dict(), "layers": layers}


def cmd_eval(args) -> dict:
    from .evaluate import MODES, evaluate, sweep
    from .text import calibration_ids, read_text, tokenize

    lm, calib_config = _setup(args)
    eval_ids = tokenize(lm, read_text(args.text_file, "eval"))
    calib_ids = calibration_ids(lm, args.calib_text_file)
    overrides = {k: v for k, v in (("clip_percentile", args.clip_percentile),
                                   ("pruning_rate", args.pruning_rate),
                                   ("importance", args.importance)) if v is not None}
    modes = args.modes or list(MODES)
    result = evaluate(lm, eval_ids, calib_ids, modes, args.window, args.max_tokens, calib_config,
                      overrides, progress=not args.no_progress)
    if args.sweep:
        result["sweep"] = sweep(lm, eval_ids, calib_ids, args.window, args.max_tokens, calib_config,
                                progress=not args.no_progress)
    return result


def cmd_partition(args) -> dict:
    from .errors import LlmNpuError
    from .partitioner.report import format_summary, partition_summary
    from .prefill import default_calibration, plan_and_partition, resolve_quant

    lm, calib_config = _setup(args)
    if args.prompt_len < 1:
        raise LlmNpuError(f"--prompt-len must be positive, got {args.prompt_len}")
    quant = resolve_quant(args.quant)
    calib = (default_calibration(lm, not args.no_progress, calib_config, args.calib_text_file)
             if quant is not None else None)
    _, partition = plan_and_partition(lm.model, lm, lm.fingerprint, args.chunk, quant, calib, args.norms,
                                      not args.no_progress)
    summary = partition_summary(partition, args.chunk, args.prompt_len, quantized=quant is not None)
    args.text = format_summary(lm.spec, summary)
    return {"model": lm.spec, "quant": args.quant, **summary}


def pruning_rate(value: str):
    """``--pruning-rate``: "auto" or a share in [0, 1]."""
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number in [0, 1], got '{value}'") from None


def _read_prompt(args) -> str:
    from .errors import LlmNpuError

    if args.prompt_file is None:
        return args.prompt
    path = Path(args.prompt_file)
    if not path.is_file():
        raise LlmNpuError(f"prompt file {path} does not exist")
    return path.read_text(encoding="utf-8", errors="replace")


def cmd_bench(args) -> dict:
    from .bench import bench, bench_e2e
    from .errors import LlmNpuError
    from .models import load_model
    from .run import prompt_ids

    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if args.e2e != (args.prompt_file is not None or args.prompt is not None):
        raise LlmNpuError("--e2e times one prompt: give --e2e with --prompt or --prompt-file (and only with --e2e)")
    lm = load_model(args.model)
    if args.e2e:
        ids = prompt_ids(lm.tokenizer, lm.spec, _read_prompt(args), args.chat)[0]
        result = bench_e2e(lm, ids, args.max_new_tokens, args.chunk, args.repeats, args.quant,
                           progress=not args.no_progress)
        args.text = _format_e2e(result)
        return result
    result = bench(lm, args.prompt_len, args.chunk, tuple(args.policies), args.ablation, args.trace_dir,
                   args.repeats, args.quant, progress=not args.no_progress, attention=args.attention)
    args.text = _format_bench(result)
    return result


def cmd_simulate(args) -> dict:
    from .simulate.device import load_device
    from .simulate.paper import format_validation, validate

    load_device(args.soc)   # an unknown SoC fails before any model is loaded
    if args.validate:
        result = validate(args.soc, args.chunk, args.prompt_len, progress=not args.no_progress)
        args.text = format_validation(result)
        return result
    from .evaluate import SWEEP_PRUNING_RATES
    from .simulate.phone import prepare, simulate_prefill, sweep

    if args.sweep:
        rows = sweep(args.model, args.soc, args.prompt_len, SWEEP_PRUNING_RATES, progress=not args.no_progress)
        args.text = _format_sweep(args, rows)
        return {"model": args.model, "soc": args.soc, "prompt_len": args.prompt_len, "sweep": rows}
    scn = prepare(args.model, args.chunk, args.quant, args.pruning_rate, args.norms, progress=not args.no_progress)
    result = simulate_prefill(scn, args.soc, args.prompt_len, tuple(args.policies), args.trace_dir)
    args.text = _format_simulate(result)
    return result


def _format_simulate(r: dict) -> str:
    lines = [f"{r['model']} on {r['soc']} ({r['device']}), simulated: {r['prompt_len']} tokens in {r['chunks']} "
             f"chunks of {r['chunk']}, {r['subgraphs']} subgraphs, {r['shadowed_linears']} shadowed linears "
             f"(plan: {r['plan_source']})"]
    lines.append(f"{'policy':<10}{'tok/s':>8}{'wall ms':>9}{'NPU ms':>8}{'CPU ms':>8}{'bubbles':>9}{'bound':>8}"
                 f"{'energy J':>10}{'tok/J':>7}")
    for p, d in r["policies"].items():
        lines.append(f"{p:<10}{d['tok_s']:>8.0f}{1e3 * d['wall_s']:>9.0f}{1e3 * d['npu_busy_s']:>8.0f}"
                     f"{1e3 * d['cpu_busy_s']:>8.0f}{100 * d['npu_bubble_rate']:>8.1f}%{d['bound_tok_s']:>8.0f}"
                     f"{d['energy_j']:>10.2f}{d['tokens_per_j']:>7.0f}")
    return "\n".join(lines)


def _format_sweep(args, rows: list[dict]) -> str:
    lines = [f"{args.model} on {args.soc}, {args.prompt_len} tokens, ooo: predicted tok/s by chunk and pruning rate; "
             f"perplexity measured on the embedded model at that rate"]
    chunks = sorted({r["chunk"] for r in rows})
    lines.append(f"{'pruning':>8}{'ppl':>8}" + "".join(f"{'C=' + str(c):>9}" for c in chunks))
    for rate in sorted({r["pruning_rate"] for r in rows}):
        rs = {r["chunk"]: r for r in rows if r["pruning_rate"] == rate}
        ppl = next(iter(rs.values()))["embedded_ppl"]
        lines.append(f"{rate:>8.0%}{ppl:>8.2f}" + "".join(f"{rs[c]['tok_s']:>9.0f}" for c in chunks))
    return "\n".join(lines)


def cmd_run(args) -> dict:

    from .errors import LlmNpuError
    from .hf import LlmNpuForCausalLM
    from .models import load_model
    from .run import format_summary, run

    prompt = _read_prompt(args)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if args.temperature is not None and args.temperature <= 0:
        raise LlmNpuError(f"--temperature must be positive (omit it for greedy decoding), got {args.temperature}")
    if args.native and args.pte is None:
        raise LlmNpuError("--native runs an exported program: give it with --pte FILE (llmnpu export writes one)")
    if args.pte is not None:
        if args.decode != "auto":
            raise LlmNpuError("--decode chooses the wrapper's decoder; an exported program decodes with its own "
                              "method (set at export: llmnpu export --decode)")
        return _run_pte(args, prompt)
    from .prefill import BACKENDS, DEFAULT_CHUNK

    wrapper = LlmNpuForCausalLM(load_model(args.model or "smollm2-135m"), chunk_len=args.chunk or DEFAULT_CHUNK,
                                backend=args.backend or BACKENDS[0], quant=args.quant or "w8a8-shadow",
                                pruning_rate=args.pruning_rate, policy=args.policy, decode=args.decode,
                                progress=not args.no_progress)
    sampling = ({"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
                if args.temperature is not None else {"do_sample": False})
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    summary = run(wrapper, prompt, args.max_new_tokens, args.chat, stream=not args.json, trace_dir=args.trace,
                  **sampling)
    args.text = format_summary(summary)
    return summary


_MODEL_OPTIONS = ("model", "backend", "quant", "pruning_rate", "chunk")


def _run_pte(args, prompt: str) -> dict:
    from .errors import LlmNpuError
    from .run import format_summary, run_pte

    given = [f"--{k.replace('_', '-')}" for k in _MODEL_OPTIONS if getattr(args, k) is not None]
    if given:
        raise LlmNpuError(f"--pte runs the exported program alone, which fixes the model and its settings: "
                          f"drop {', '.join(given)}")
    summary = run_pte(args.pte, prompt, args.max_new_tokens, args.chat, stream=not args.json,
                      temperature=args.temperature, top_p=args.top_p, seed=args.seed, policy=args.policy,
                      native=args.native, trace_dir=args.trace)
    args.text = format_summary(summary)
    return summary


def cmd_export(args) -> dict:
    from .lower.pte import export_pte
    from .prefill import export_engine, quant_config
    from .text import calibration_ids

    quant = quant_config(args.quant, args.pruning_rate)
    if args.backend == "qnn":
        from .lower.qnn import check_soc

        check_soc(args.soc)              # before the model is loaded and planned
    lm, engine = export_engine(args.model, args.chunk, quant, args.blocks, progress=not args.no_progress)
    calib_ids = calibration_ids(lm, None)
    summary = export_pte(engine, args.out, calib_ids, target=args.backend, soc=args.soc, context=args.context,
                         model={"spec": args.model, "blocks": args.blocks}, progress=not args.no_progress,
                         shadow=args.shadow_branch, decode=args.decode, tokenizer=lm.tokenizer)
    sh = summary["shadow"]
    flops, wbytes = sh["flops_per_chunk"], sh["program_weight_bytes"]
    args.text = (f"wrote {summary['pte']} ({summary['pte_bytes'] / 2**20:.1f} MiB: {summary['npu_methods']} NPU "
                 f"methods for {args.backend}{' ' + args.soc if args.backend == 'qnn' else ''}, "
                 f"{summary['cpu_methods']} CPU methods, decode {summary['decode']} on XNNPACK) and "
                 f"{summary['sidecar']} ({summary['sidecar_bytes'] / 2**10:.0f} KiB); chunk {summary['chunk_len']}, "
                 f"context {summary['context']} tokens, {summary['seconds']:.0f} s\n"
                 f"shadow branches ({sh['form']}, {sh['linears']} linears) per chunk: float work "
                 f"{flops[sh['form']] / 1e6:.1f} MFLOP (dense {flops['dense'] / 1e6:.1f}), float rows in the program "
                 f"{wbytes[sh['form']] / 2**20:.2f} MiB (dense {wbytes['dense'] / 2**20:.2f}); cold rows on disk "
                 f"{summary['rows_bytes'] / 2**20:.1f} MiB\n"
                 f"check it: llmnpu validate --pte {summary['pte']}   generate: llmnpu run --pte {summary['pte']} --prompt ...")
    return summary


def cmd_info(args) -> dict:
    from .info import format_info, info

    result = info()
    args.text = format_info(result)
    return result


def cmd_prepare_text(args) -> dict:
    from .text import prepare_text, text_dir

    result = prepare_text(Path(args.out) if args.out else text_dir(), Path(args.wheel) if args.wheel else None)
    if not args.json:
        args.text = (f"calibration: {result['calib_documents']} news documents, {result['calib_words']} words\n"
                     f"evaluation:  {result['eval_paragraphs']} Wikipedia paragraphs, {result['eval_words']} words\n"
                     f"-> {result['folder']}")
    return result


def cmd_validate(args) -> dict:
    from .errors import LlmNpuError
    from .prefill import export_engine
    from .quantize import QuantConfig
    from .runtime.pte_runner import PteRunner
    from .runtime.validate import validate_pte
    from .text import read_text, tokenize

    runner = PteRunner(args.pte)             # checks the .pte and its sidecar first
    meta = runner.meta
    model = meta["model"]
    if "spec" not in model:
        raise LlmNpuError(f"{args.pte}'s sidecar does not say which model it was exported from")
    lm, engine = export_engine(model["spec"], meta["chunk_len"], QuantConfig.from_dict(meta["quant"]),
                               model.get("blocks"), progress=not args.no_progress)
    ids = tokenize(lm, read_text(None, "eval"))
    prompt = ids[: args.prompt_tokens] if args.prompt_tokens else None
    result = validate_pte(args.pte, engine, ids, prompt, runner=runner)
    args.text = _format_validate(result)
    args.failed = not result["prefill"]["same_next_token"]
    return result


def _format_validate(r: dict) -> str:
    where = f"{r['target']}{' on ' + r['soc'] + ' (HTP simulator)' if r['target'] == 'qnn' else ''}"
    lines = [f"NPU subgraphs of the .pte ({where}) against the cpu-int8 engine, one chunk of evaluation text:",
             f"{'subgraph':>8} {'layer':>5}  {'linear':<28} {'max steps':>9} {'<= 2 steps':>10} {'saturated':>9} "
             f"{'SQNR dB':>8}"]
    for x in r["linears"]:
        steps = f"{x['max_steps']:.2f}" if x["max_steps"] is not None else "-"
        lines.append(f"{x['subgraph']:>8} {x['layer'] if x['layer'] is not None else '-':>5}  "
                     f"{x['linear'].split('.', 3)[-1]:<28} {steps:>9} {100 * x['within_2_steps']:>9.2f}% "
                     f"{100 * x['saturated']:>8.3f}% {x['sqnr_db']:>8.1f}")
    inside = [x["max_steps"] for x in r["linears"] if x["max_steps"] is not None]
    lines.append(f"{len(r['linears'])} linears: elements within 2 output steps >= "
                 f"{100 * min(x['within_2_steps'] for x in r['linears']):.2f} % in every linear; largest difference "
                 f"{max(inside):.2f} steps where the engine's value is inside the output range; "
                 f"{100 * max(x['saturated'] for x in r['linears']):.3f} % saturated at most")
    p = r["prefill"]
    verdict = "same next token" if p["same_next_token"] else "DIFFERENT next token"
    lines.append(f"whole prefill from the .pte alone ({p['tokens']} tokens, {p['chunks']} chunks, {p['policy']} "
                 f"schedule): {verdict} (pte {p['next_token_pte']}, engine {p['next_token_engine']}); logits SQNR "
                 f"{p['logits_sqnr_db']:.1f} dB, K/V SQNR >= {p['kv_sqnr_db_min']:.1f} dB")
    vs = p["logits_sqnr_db_vs_fp32"]
    lines.append(f"against the float model: logits SQNR pte {vs['pte']:.1f} dB, engine {vs['engine']:.1f} dB; "
                 f"fp32 next token {p['next_token_fp32']}")
    return "\n".join(lines)


def _machine_line(r: dict) -> str:
    m = r["machine"]
    return (f"on {m['cpu']} ({m['isa']}), INT8 kernel {m['int8_kernel']}, "
            f"decode {m.get('decode_kernel', 'fbgemm')} ({m['decode_activation_bits']}-bit activations)")


def _format_bench(r: dict) -> str:
    from .runtime.executor import POLICIES

    lines = [f"prefill of {r['prompt_len']} tokens, {r['model']}, chunk {r['chunk']}, {r['threads']} threads, "
             f"{r['quant']}, median of {r['repeats']}", _machine_line(r)]
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
        lines.append("lane help: the idle CPU worker ran " + ", ".join(f"{n} ({p})" for p, n in lent.items())
                     + " pieces of NPU kernels a run (LLMNPU_LANE_HELP=0 turns it off)")
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
             f"median of {r['repeats']}", _machine_line(r),
             f"{'':<26}{'TTFT':>9}{'vs hf':>8}{'decode':>12}{'vs hf':>8}"]
    for name, v in r["variants"].items():
        lines.append(f"{names.get(name, name):<26}{1e3 * v['ttft_s']:>7.0f}ms{v['ttft_vs_hf']:>7.2f}x"
                     f"{v['decode_tok_s']:>8.1f}tok/s{v['decode_vs_hf']:>7.2f}x")
    if r.get("llamacpp_reason"):
        lines.append(f"llama.cpp: not measured ({r['llamacpp_reason']})")
    return "\n".join(lines)


def _print_eval(result: dict) -> None:
    print(f"model {result['model']}: perplexity on {result['tokens']} tokens, windows of {result['window']}")
    base = result["results"].get("fp32", {}).get("ppl")
    print(f"{'mode':<22}{'ppl':>9}{'vs fp32':>9}{'outliers':>10}")
    for mode, r in result["results"].items():
        rel = f"{r['ppl'] / base:.3f}x" if base else ""
        frac = f"{100 * r['outlier_fraction']:.2f}%" if "outlier_fraction" in r else ""
        print(f"{mode:<22}{r['ppl']:>9.3f}{rel:>9}{frac:>10}")
    for row in result.get("sweep", []):
        print("sweep", json.dumps(row))


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .evaluate import MODES

    ap = argparse.ArgumentParser(
        prog="llmnpu", description="Fast LLM prefill on phone NPUs (llm.npu) for PyTorch.",
        epilog="start with: llmnpu run --prompt 'What is a lighthouse?' --chat   "
               "(each command: llmnpu COMMAND --help)")
    ap.add_argument("--version", action="version", version=f"llmnpu_delegate {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    from .kernels.attention import PRECISIONS as ATTENTION_PRECISIONS
    from .prefill import BACKENDS, DEFAULT_CHUNK, QUANT_MODES
    from .runtime.executor import POLICIES

    p = sub.add_parser("run", help="generate from a prompt: NPU-path prefill, CPU decode, streamed, with a summary",
                       description="Prefill the prompt through the NPU path (chunks, shadow outliers, out-of-order "
                                   "schedule), decode on the CPU (INT8 by default), stream the tokens, then print time to "
                                   "first token, prefill and decode speed, chunks and outlier share. The first use "
                                   "of a model calibrates, compiles and profiles its subgraphs for the out-of-order "
                                   "schedule (a few minutes, all cached); later starts take seconds.")
    p.add_argument("--model", default=None,
                   help="smollm2-135m (default), a Hugging Face folder, a .gguf file or random:<shape>")
    p.add_argument("--pte", default=None,
                   help="generate with an exported program alone (llmnpu export): its .pte, sidecar, cold rows "
                        "and tokenizer; no model, weights or calibration are loaded")
    p.add_argument("--native", action="store_true",
                   help="with --pte: generate with the C++ runner (runner/, built by `make runner`) instead of the "
                        "Python reference runner")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this text file")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling share when sampling (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--backend", choices=list(BACKENDS), default=None, help=f"prefill backend (default {BACKENDS[0]})")
    p.add_argument("--quant", choices=list(QUANT_MODES), default=None,
                   help="quantization of the prefill (default w8a8-shadow)")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None,
                   help="share of layers without a shadow path (w8a8-shadow): auto (default) or a share in [0, 1]")
    p.add_argument("--chunk", type=int, default=None, help=f"chunk length (default {DEFAULT_CHUNK})")
    p.add_argument("--policy", choices=list(POLICIES), default="ooo", help="prefill schedule (default ooo)")
    p.add_argument("--decode", choices=["auto", "int8", "fp32"], default="auto",
                   help="decode after the prompt: int8 (INT8 linears, static K/V cache), fp32 (Hugging Face's own "
                        "float forward, token for token) or auto (default: int8 where the family allows it)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write the prefill's Chrome/Perfetto trace and timeline PNG into DIR")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--json", action="store_true", help="no streaming; print the text and summary as one JSON object")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("calibrate", help="record activation statistics of every decoder linear and save them",
                       description="Run the float model over calibration text; save the versioned artefact.")
    _add_model_args(p)
    p.add_argument("--out", default=None, help="artefact path (default: in the cache, keyed by model and text)")
    p.add_argument("--clip-percentile", type=float, default=99.5, help="percentile shown in the summary")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("eval", help="perplexity of fp32 and each quantization mode",
                       description="Perplexity of the float model and of each W8A8 mode on held-out text.")
    _add_model_args(p)
    p.add_argument("--text-file", default=None, help="evaluation text (default: the shipped Wikipedia text)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens to evaluate (default 4096)")
    p.add_argument("--window", type=int, default=512, help="tokens per evaluation window (default 512)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=None, help="modes (default: all)")
    p.add_argument("--clip-percentile", type=float, default=None, help="shadow clipping percentile (default 99.5)")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None, help="pruning rate of pruned modes: auto (default: the highest within 1 %% perplexity on "
                        "held-apart calibration text) or a share in [0, 1]")
    p.add_argument("--importance", choices=["output", "ratio"], default=None,
                   help="layer ranking for pruning (default: output)")
    p.add_argument("--sweep", action="store_true",
                   help="also print the trade-off curve over clipping percentiles and pruning rates")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("partition", help="cut a chunk step into NPU/CPU subgraphs and print the table",
                       description="Export one prefill chunk step, partition it into NPU (INT8 linears) and CPU "
                                   "(float) subgraphs, and print counts, sharing, NPU FLOP share and memory "
                                   "against one graph set per chunk position.")
    _add_model_args(p)
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help=f"chunk length (default {DEFAULT_CHUNK})")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt length for FLOPs and memory (default 1024)")
    p.add_argument("--quant", choices=list(QUANT_MODES), default="w8a8-shadow",
                   help="quantization mode (default w8a8-shadow: shadow paths where calibration keeps them)")
    p.add_argument("--norms", choices=["cpu", "npu"], default="cpu",
                   help="where norms run (default cpu; npu folds them into the NPU region they feed)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser("bench", help="prefill speed of each scheduling policy against HF eager fp32 and llama.cpp",
                       description="Time the chunked prefill (two workers: INT8 'npu', float 'cpu') under each "
                                   "policy, interleaved with the baselines, in one process; medians of --repeats.")
    p.add_argument("--model", default="smollm2-135m", help="model spec (default smollm2-135m)")
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
    _add_output_args(p)
    p.set_defaults(func=cmd_bench)

    from .models import RANDOM_SHAPES
    from .simulate.device import socs
    from .simulate.phone import QUANT_MODES as SIM_QUANT

    p = sub.add_parser("simulate", help="predict phone prefill speed, bubbles and energy (discrete-event model)",
                       description="Simulate the chunked prefill on a Snapdragon SoC: the real partition, shadow "
                                   "plan and scheduler, each subgraph priced by a device profile fitted to the "
                                   "paper's micro-benchmarks. Nothing runs on a phone.")
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (default), a Hugging Face folder, or random:<shape> (shapes only; the "
                        f"paper's models: {', '.join(s for s in RANDOM_SHAPES if not s.startswith('tiny'))})")
    p.add_argument("--soc", default="SM8650", help=f"device profile: {', '.join(socs())} (default SM8650)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help=f"chunk length (default {DEFAULT_CHUNK})")
    p.add_argument("--quant", choices=list(SIM_QUANT), default="w8a8-shadow", help="default w8a8-shadow")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None, help="share of linears without a shadow path (default auto)")
    p.add_argument("--norms", choices=["cpu", "npu"], default="cpu", help="where norms run (default cpu)")
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES),
                   help="scheduling policies (default: all)")
    p.add_argument("--trace-dir", default=None, help="write Chrome/Perfetto traces and timeline PNGs here")
    p.add_argument("--sweep", action="store_true",
                   help="chunk length x pruning rate trade-off, with the embedded model's measured perplexity")
    p.add_argument("--validate", action="store_true", help="predictions beside the paper's published figures")
    _add_output_args(p)
    p.set_defaults(func=cmd_simulate)

    from .lower.npu_subgraphs import TARGETS
    from .lower.pte import DEFAULT_CONTEXT
    from .lower.qnn import DEFAULT_SOC

    p = sub.add_parser("export", help="write a deployable .pte (QNN/HTP or cpu-int8 NPU methods) and its sidecar",
                       description="Lower the partitioned chunk step into one ExecuTorch .pte: a method per static "
                                   "NPU subgraph (ExecuTorch's Qualcomm QNN delegate with our INT8 encodings, or "
                                   "XNNPACK INT8 for cpu-int8), a float method per CPU subgraph (portable kernels; "
                                   "attention with a symbolic past up to --context), and a sidecar JSON with what "
                                   "a runner needs (names, scales, thresholds, hot channels, pruned layers, profile).")
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (default), a Hugging Face folder, a .gguf file or random:<shape>")
    p.add_argument("--backend", choices=list(TARGETS), default="qnn", help="NPU methods for (default qnn)")
    p.add_argument("--soc", default=DEFAULT_SOC, help=f"Snapdragon SoC for qnn (default {DEFAULT_SOC}, 8 Gen 3)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help=f"chunk length (default {DEFAULT_CHUNK})")
    p.add_argument("--context", type=int, default=None,
                   help=f"longest prompt the .pte serves (default {DEFAULT_CONTEXT} or the model's context)")
    p.add_argument("--blocks", type=int, default=None, help="keep the first N decoder blocks (a quick check)")
    p.add_argument("--quant", choices=[m for m in QUANT_MODES if m != "fp32"], default="w8a8-shadow",
                   help="quantization (default w8a8-shadow)")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None,
                   help="share of layers without a shadow path (w8a8-shadow): auto (default) or a share in [0, 1]")
    p.add_argument("--shadow-branch", choices=["sparse", "dense"], default="sparse",
                   help="shadow outlier branches: sparse (default: hot channels' rows in the program, cold rows "
                        "in a file read when hit) or dense (the whole linear on the residue: a reference)")
    p.add_argument("--decode", choices=["int8", "fp32"], default="int8",
                   help="decode method on XNNPACK: int8 (default: INT8 weights, per-token dynamic activations) "
                        "or fp32 (the float reference)")
    p.add_argument("--out", required=True, help="the .pte to write (beside it: .json sidecar, .rows.bin cold "
                                                "shadow rows, .tokenizer/ folder)")
    _add_output_args(p, "print the summary as JSON")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("validate", help="run an exported .pte on this host and compare it with the cpu-int8 engine",
                       description="Run each NPU method of the .pte (QNN methods on Qualcomm's HTP simulator) on one "
                                   "chunk of evaluation text and compare with the cpu-int8 engine in output "
                                   "quantization steps and SQNR; then prefill a short prompt from the .pte alone "
                                   "(reference runner, out-of-order executor) and compare the next token. Exit "
                                   "status 1 when the next token differs. Simulator times are not speed.")
    p.add_argument("--pte", required=True, help="the .pte written by llmnpu export (its .json beside it)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="tokens of the whole-prefill prompt (default 1.5 chunks)")
    _add_output_args(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("info", help="this machine as the project sees it: CPU, INT8 kernel, native builds, QNN, cache",
                       description="One screen for bug reports: the CPU and its INT8 class, the INT8 kernel every "
                                   "NPU subgraph runs here (never one that saturates), decode's activation bits, "
                                   "whether the native kernels and runner are built (and for this CPU), Qualcomm's "
                                   "libraries, and the cache folder.")
    _add_output_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("prepare-text", help="extract the default calibration and evaluation text (first use does it too)",
                       description="Write calib.txt (the Lee news corpus) and eval.txt (English Wikipedia prose) from "
                                   "the gensim 4.4.0 wheel, fetched by pip unless --wheel is given, into the text "
                                   "folder (LLMNPU_DATA_DIR, else text/ in the cache folder).")
    p.add_argument("--wheel", default=None, help="a downloaded gensim-4.4.0 wheel (default: pip download it)")
    p.add_argument("--out", default=None, help="output folder (default: the text folder)")
    _add_output_args(p)
    p.set_defaults(func=cmd_prepare_text)
    return ap


def main(argv: list[str] | None = None) -> int:
    _quiet_third_party_logs()
    from .errors import LlmNpuError

    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except LlmNpuError as e:
        print(f"llmnpu: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(result, indent=1))
    elif args.command == "eval":
        _print_eval(result)
    elif hasattr(args, "text"):
        print(args.text)
    else:
        print(json.dumps(result, indent=1))
    return 1 if getattr(args, "failed", False) else 0


if __name__ == "__main__":
    sys.exit(main())
