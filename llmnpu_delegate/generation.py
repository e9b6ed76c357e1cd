"""``llmnpu run``: one prompt through the wrapper (or an exported ``.pte`` alone), tokens streamed,
then a summary of where time went."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from transformers import TextStreamer
from transformers.generation.streamers import BaseStreamer

from .errors import LlmNpuError
from .format.sidecar import load_program_tokenizer, load_sidecar
from .hf import LlmNpuForCausalLM
from .kernels import int8_path
from .partitioner.placement import PIECES, parse_placement
from .runtime.engine import PRUNING_PROMPT
from .runtime.native import run_native
from .runtime.pte_runner import PteRunner
from .runtime.rates import token_rates
from .runtime.sampling import GREEDY, Sampling
from .runtime.trace import read_trace, write_timeline, write_trace


class TokenClock(BaseStreamer):
    """Records when each generated token arrives; forwards to an optional printing streamer."""

    def __init__(self, inner: BaseStreamer | None = None):
        self.inner, self.times, self._prompt_seen = inner, [], False

    def put(self, value):
        if self._prompt_seen:
            self.times.extend([time.perf_counter()] * value.numel())
        self._prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        if self.inner is not None:
            self.inner.end()


def prompt_ids(tok, name: str, prompt: str, chat: bool) -> torch.Tensor:
    if tok is None:
        raise LlmNpuError(f"model '{name}' has no tokenizer: give a model folder with tokenizer files")
    if not prompt.strip():
        raise LlmNpuError("the prompt is empty: give --prompt TEXT or a --prompt-file with text in it")
    if chat:
        if not getattr(tok, "chat_template", None):
            raise LlmNpuError(f"the tokenizer of '{name}' has no chat template: drop --chat")
        return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"]
    return tok(prompt, return_tensors="pt").input_ids


def run(wrapper: LlmNpuForCausalLM, prompt: str, max_new_tokens: int = 64, chat: bool = False,
        stream: bool = True, trace_dir: str | None = None, **generate_kwargs) -> dict:
    """Generate from ``prompt``; returns the text and the summary (TTFT, prefill and decode speed, ...)."""
    if max_new_tokens < 1:
        raise LlmNpuError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    ids = prompt_ids(wrapper.tokenizer, wrapper.loaded.spec, prompt, chat)
    printer = TextStreamer(wrapper.tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    clock = TokenClock(printer)
    start = time.perf_counter()
    out = wrapper.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           streamer=clock, pad_token_id=wrapper.tokenizer.eos_token_id, **generate_kwargs)
    if stream:
        sys.stdout.flush()
    new = out[0, ids.shape[1]:]
    pre = wrapper.last_prefill
    rates = token_rates(start, clock.times)
    summary = {
        "model": wrapper.loaded.spec,
        "backend": wrapper.engine.backend_name, "machine": int8_path.describe(),
        "quant": "fp32" if wrapper.engine.quant is None else
                 ("w8a8-shadow" if wrapper.engine.quant.outliers == "shadow" else "w8a8"),
        "chunk": wrapper.engine.chunk_len,
        "placement": wrapper.engine.config.placement,
        "placement_prefill_s": (wrapper.engine.placement_choice or {}).get("prefill_s") or None,
        "prompt_tokens": int(ids.shape[1]),
        "new_tokens": int(new.numel()),
        "chunks": pre["chunks"],
        "rows": pre["rows"],
        "ttft_s": round(rates["ttft_s"], 4) if rates["ttft_s"] is not None else None,
        "prefill_s": round(pre["prefill_s"], 4),
        "prefill_tok_s": round(pre["tokens"] / pre["prefill_s"], 1),
        "decode_tok_s": round(rates["decode_tok_s"], 1) if rates["decode_tok_s"] else None,
        "outlier_share": round(pre["outlier_share"], 6),
        "decode_mode": "INT8, CPU" if wrapper.decode_mode == "int8" else "float (Hugging Face forward), CPU",
        "policy": wrapper.engine.last_run.policy if wrapper.engine.last_run else None,
        "text": wrapper.tokenizer.decode(new, skip_special_tokens=True),
    }
    if trace_dir is not None:
        write_prefill_trace(summary, wrapper.engine.last_run, trace_dir, f"prefill of {ids.shape[1]} tokens")
    return summary


def write_prefill_trace(summary: dict, stats, trace_dir: str, title: str) -> None:
    """The prefill's Chrome/Perfetto trace and timeline picture in ``trace_dir``; their paths go into ``summary``."""
    summary["trace"] = str(write_trace(stats, Path(trace_dir) / "prefill.trace.json"))
    summary["timeline"] = str(write_timeline(stats, Path(trace_dir) / "prefill.png", title))


def run_pte(pte: str | Path, prompt: str, max_new_tokens: int = 64, chat: bool = False, stream: bool = True,
            sampling: Sampling = GREEDY, policy: str = "ooo",
            native: bool = False, trace_dir: str | None = None) -> dict:
    """Generate from ``prompt`` with an exported program alone: the Python reference runner
    (``PteRunner``) or, with ``native``, the C++ one (``llmnpu-runner``); the same summary as ``run``."""
    pte = Path(pte)
    runner = None if native else PteRunner(pte, policy=policy)     # checks the program and its files
    meta = runner.meta if runner else load_sidecar(pte)
    tok = load_program_tokenizer(meta, pte)
    ids = prompt_ids(tok, pte.name, prompt, chat)[0]
    printer = TextStreamer(tok, skip_special_tokens=True) if stream else None
    on_token = (lambda t: printer.put(torch.tensor([t]))) if printer else None
    if native:
        trace = Path(trace_dir) / "prefill.trace.json" if trace_dir is not None else None
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
        out = run_native(pte, ids.tolist(), meta, max_new_tokens, policy, sampling, trace,
                         on_token=on_token).summary
        engine = "native runner"
    else:
        g = runner.generate(ids, max_new_tokens, sampling, meta["tokenizer"]["eos_ids"], on_token)
        out = {"tokens": g.tokens, "prompt_tokens": g.prompt_tokens, "chunks": g.chunks, "ttft_s": g.ttft_s,
               "prefill_s": g.prefill_s, "decode_tok_s": g.decode_tok_s, "cold_rows": g.cold_rows,
               "policy": g.policy, "stopped": g.stopped}
        engine = "Python reference runner"
    if printer:
        printer.end()
        sys.stdout.flush()
    target = meta["target"] + (f" {meta['soc']}" if meta.get("soc") else "")
    quant = meta["quant"]
    summary = {
        "model": meta["model"].get("spec") or pte.name, "pte": str(pte),
        "backend": f".pte ({target} NPU methods, {engine})", "machine": int8_path.describe(),
        "quant": "w8a8-shadow" if quant.get("outliers") == "shadow" else "w8a8",
        "chunk": meta["chunk_len"], "placement": meta["placement"], "prompt_tokens": out["prompt_tokens"], "new_tokens": len(out["tokens"]),
        "chunks": out["chunks"], "ttft_s": round(out["ttft_s"], 4), "prefill_s": round(out["prefill_s"], 4),
        "prefill_tok_s": round(out["prompt_tokens"] / out["prefill_s"], 1),
        "decode_tok_s": round(out["decode_tok_s"], 1) if out["decode_tok_s"] else None,
        "decode_mode": f"{meta['decode']['mode']}, XNNPACK, CPU",
        "cold_rows": out["cold_rows"], "policy": out["policy"], "stopped": out["stopped"], "tokens": out["tokens"],
        "text": tok.decode(out["tokens"], skip_special_tokens=True),
    }
    if trace_dir is not None:
        title = f"prefill of {summary['prompt_tokens']} tokens (.pte, {engine})"
        if native:
            summary["trace"] = str(trace)
            summary["timeline"] = str(write_timeline(read_trace(trace), Path(trace_dir) / "prefill.png", title))
        else:
            write_prefill_trace(summary, runner.last_run, trace_dir, title)
    return summary


def _chunks(s: dict) -> str:
    text = f"{s['chunks']} chunk(s)"
    last = s.get("rows", 0) - (s["chunks"] - 1) * s["chunk"]
    if s.get("rows") and last != s["chunk"]:
        text += f", the last of {last} rows (tail program)"
    return text


def placement_line(placement: str, timed: dict | None) -> str:
    """What a summary says of its placement, with the timings it was chosen by (if it was)."""
    text = f"placement {placement} (NPU regions: the linears"
    parsed = parse_placement(placement)
    text += "".join(f", {p}" for p in PIECES if p in parsed.pieces)
    text += "; shadow products inline, added into their linears' outputs)" if parsed.inline else ")"
    if timed:
        text += f"; chosen by timing each on this machine, {PRUNING_PROMPT:,}-token prefill: " + ", ".join(
            f"{name} {1e3 * t:.0f} ms" for name, t in sorted(timed.items(), key=lambda kv: kv[1]))
    return text


def format_summary(s: dict) -> str:
    decode = f"{s['decode_tok_s']:.1f} tok/s" if s["decode_tok_s"] else "n/a (one token)"
    lines = [
        "",
        f"--- {s['model']} on {s['backend']} ({s['quant']}, chunk {s['chunk']}, {s['policy']} schedule)",
        f"prompt {s['prompt_tokens']} tokens in {_chunks(s)}; {s['new_tokens']} new tokens",
        f"time to first token {1e3 * s['ttft_s']:.0f} ms",
        f"prefill {s['prefill_tok_s']:.1f} tok/s ({1e3 * s['prefill_s']:.0f} ms)",
        f"decode  {decode} ({s['decode_mode']})",
    ]
    if "placement" in s:
        lines.append(placement_line(s["placement"], s.get("placement_prefill_s")))
    if "machine" in s:
        m = s["machine"]
        lines.append(f"cpu {m['cpu']} ({m['isa']}); INT8 kernel {m['int8_kernel']}")
    if "outlier_share" in s:
        lines.append(f"activations on the shadow outlier path: {100 * s['outlier_share']:.3f} %")
    if "cold_rows" in s:
        lines.append(f"cold shadow rows read from disk: {s['cold_rows']}")
    if "trace" in s:
        lines.append(f"trace: {s['trace']}  timeline: {s['timeline']}")
    return "\n".join(lines)
