"""``llmnpu bench``: prefill speed under each scheduling policy, against the baselines a user has,
measured in one process and interleaved (these machines are shared: only same-run ratios count).

- ``hf_fp32``: transformers eager fp32 forward of the prompt with the same total thread count,
  logits for the last position only (what ``generate`` computes for a prompt). It runs with the
  same tuned allocator as the engine (``runtime/allocator.py``), which speeds it up too;
  ``hf_fp32_default_malloc_tok_s`` is the same measurement before the tuning, for reference.
- ``inorder`` / ``overlap`` / ``ooo``: the chunked engine (W8A8 + shadow by default) on its two
  workers (``npu`` = the INT8 stand-in, ``cpu`` = float work), one core's worth of threads each.
- ``llamacpp``: llama.cpp prompt processing of the same GGUF (through the optional ``cyllama``
  wheel), when the model is a GGUF.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..backends.graph_cache import GraphCache
from ..errors import LlmNpuError
from ..hf import LlmNpuForCausalLM
from ..kernels import int8_path
from ..models import DEFAULT_MODEL, SMOLLM2_GGUF, LoadedModel, smollm2_folder
from ..partitioner.placement import PAPER
from ..generation import TokenClock
from ..runtime.allocator import tune_malloc, tuned
from ..runtime.engine import Prefiller
from ..runtime.rates import token_rates
from ..runtime.executor import Workers
from ..runtime.schedule import POLICIES
from ..runtime.trace import metrics, step_label, write_timeline, write_trace
from ..text import read_text, tokenize


def prompt_ids(lm: LoadedModel, length: int) -> torch.Tensor:
    """``length`` tokens of the shipped evaluation text (random ids for models without a tokenizer)."""
    if lm.tokenizer is not None:
        try:
            ids = tokenize(lm, read_text(None, "eval"))
            if ids.numel() >= length:
                return ids[:length]
        except LlmNpuError:
            pass
    return torch.randint(0, min(lm.model.config.vocab_size, 30000), (length,), generator=torch.Generator().manual_seed(0))


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


@contextmanager
def torch_threads(threads: int):
    """torch's intra-op thread count set to ``threads`` for a baseline, then restored."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@torch.inference_mode()
def _hf_once(model, ids: torch.Tensor, threads: int) -> float:
    with torch_threads(threads):
        t = time.perf_counter()
        model(input_ids=ids[None], use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t


def llamacpp_model(lm: LoadedModel):
    """(llama.cpp's module, the model's GGUF loaded in it), or (None, why not)."""
    if lm.spec != DEFAULT_MODEL and not lm.spec.endswith(".gguf"):
        return None, "the model is not a GGUF file"
    try:
        from cyllama.llama import llama_cpp as cy
    except ImportError:
        return None, "cyllama is not installed (pip install -e '.[bench]')"
    path = smollm2_folder() / SMOLLM2_GGUF if lm.spec == DEFAULT_MODEL else Path(lm.spec)
    cy.disable_logging()
    cy.ggml_backend_load_all()
    return cy, cy.LlamaModel(str(path), cy.LlamaModelParams())


def llamacpp_prefill(lm: LoadedModel, ids: torch.Tensor, threads: int, repeats: int) -> tuple[float | None, str | None]:
    """(tokens/s of llama.cpp prompt processing of ``ids`` with ``threads`` threads, reason when unavailable)."""
    cy, model = llamacpp_model(lm)
    if cy is None:
        return None, model
    tokens = [int(t) for t in ids]          # the very same token ids (same tokenizer, same GGUF)
    times = []
    for _ in range(repeats + 1):            # the first pass warms up
        params = cy.LlamaContextParams()
        params.n_ctx = params.n_batch = params.n_ubatch = len(tokens)
        params.n_threads = params.n_threads_batch = threads
        ctx = cy.LlamaContext(model, params)
        batch = cy.llama_batch_get_one(tokens)
        t = time.perf_counter()
        ctx.decode(batch)                   # one prompt-processing pass (logits of the last token)
        times.append(time.perf_counter() - t)
        del ctx
    return len(tokens) / _median(times[1:]), None


def bench(lm: LoadedModel, prompt_len: int, chunk: int, policies=POLICIES, ablation: bool = False,
          trace_dir: Path | None = None, repeats: int = 3, quant="w8a8-shadow", progress: bool = True,
          attention: str = "auto", placement: str = PAPER) -> dict:
    if prompt_len < 1:
        raise LlmNpuError(f"prompt length must be positive, got {prompt_len}")
    if repeats < 1:
        raise LlmNpuError(f"repeats must be at least 1, got {repeats}")
    if not policies:
        raise LlmNpuError(f"give at least one policy of {', '.join(POLICIES)}")
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise LlmNpuError(f"unknown policies {sorted(unknown)}: use {', '.join(POLICIES)}")
    workers = Workers.auto()
    threads = workers.threads * 2
    ids = prompt_ids(lm, prompt_len)
    # What a user of transformers sees today, with glibc's default allocator (before we tune it)...
    untuned = None
    if not tuned():
        _hf_once(lm.model, ids, threads)
        untuned = _median([_hf_once(lm.model, ids, threads) for _ in range(repeats)])
    tune_malloc()     # ...then every compared variant, the HF baseline included, runs with the tuned one
    engine = Prefiller(lm, chunk, quant=quant, progress=progress, workers=workers, attention=attention,
                       placement=placement)
    engine(ids, policy="inorder")                 # warm-up; profiles the subgraphs on first use
    runs = {p: [] for p in policies}
    hf = []
    _hf_once(lm.model, ids, threads)             # warm-up
    for _ in tqdm(range(repeats), desc="bench", disable=not progress, leave=False):
        hf.append(_hf_once(lm.model, ids, threads))
        for p in policies:
            engine(ids, policy=p)
            runs[p].append(engine.last_run)
    out = {"model": lm.spec, "machine": int8_path.describe(), "prompt_len": prompt_len, "chunk": chunk, "threads": threads,
           "quant": quant if isinstance(quant, str) else "custom", "attention": engine.attention,
           "placement": engine.config.placement,
           "placement_prefill_s": (engine.placement_choice or {}).get("prefill_s") or None, "repeats": repeats,
           "lane_help": workers.help, "lane_steal": workers.steal,
           "hf_fp32_s": _median(hf), "hf_fp32_tok_s": prompt_len / _median(hf),
           "hf_fp32_default_malloc_tok_s": prompt_len / untuned if untuned else None}
    medians = {}
    for p in policies:
        walls = [s.wall_s for s in runs[p]]
        med = sorted(runs[p], key=lambda s: s.wall_s)[len(walls) // 2]
        medians[p] = med
        m = metrics(med)
        out[f"{p}_s"] = _median(walls)
        out[f"{p}_tok_s"] = prompt_len / _median(walls)
        out[f"bubble_rate_{p}"] = m["npu_bubble_rate"]
        out[f"{p}_npu_busy_s"], out[f"{p}_cpu_busy_s"] = m["npu_busy_s"], m["cpu_busy_s"]
        out[f"decision_us_{p}"] = m["decision_us"]
        out[f"pieces_lent_{p}"] = med.pieces_lent
        out[f"stolen_{p}"] = med.stolen
    best = "ooo" if "ooo" in policies else policies[-1]
    bound = metrics(medians[best])["bound_s"]
    out["bound_tok_s"] = prompt_len / bound
    out["speedup_vs_hf"] = out[f"{best}_tok_s"] / out["hf_fp32_tok_s"]
    if "inorder" in policies and "ooo" in policies:
        out["ooo_vs_inorder"] = out["ooo_tok_s"] / out["inorder_tok_s"]
    out["efficiency_vs_bound"] = out[f"{best}_tok_s"] / out["bound_tok_s"]
    tok_s, reason = llamacpp_prefill(lm, ids, threads, repeats)
    out["llamacpp_tok_s"] = tok_s
    if reason:
        out["llamacpp_reason"] = reason
    if ablation:
        out["ablation"] = _ablation(lm, ids, chunk, quant, out, workers, progress)
    if trace_dir is not None:
        names = {i: step_label(s.sub) for i, s in enumerate(engine.program.steps)}
        trace_dir = Path(trace_dir)
        out["traces"] = {}
        for p, stats in medians.items():
            out["traces"][p] = {"json": str(write_trace(stats, trace_dir / f"{p}.trace.json", names)),
                                "png": str(write_timeline(stats, trace_dir / f"{p}.png",
                                                          f"{lm.spec} {prompt_len} tokens, chunk {chunk}, {p}"))}
    return out


def _ablation(lm: LoadedModel, ids, chunk: int, quant, out: dict, workers: Workers, progress: bool) -> dict:
    """The paper's Figure 19 steps. Without outlier handling, per-tensor INT8 is not accurate enough
    (W8A8 at absmax: 2.3x perplexity on the embedded model), so the steps before "outlier" run
    their linears in float on the NPU worker (the NPU's slow float path)."""
    n = ids.numel()
    t = time.perf_counter()
    # one capture, as a naive engine has: no tail program to build
    fresh = Prefiller(lm, chunk, quant=None, cache=GraphCache(), progress=False, workers=workers, tail_len=None)
    prepare = time.perf_counter() - t
    fresh(ids, policy="inorder")
    walls = []
    for _ in range(2):
        fresh(ids, policy="inorder")
        walls.append(fresh.last_run.wall_s)
    float_inorder = _median(walls)
    steps = {
        "naive (float linears, graphs rebuilt for the prompt)": n / (prepare + float_inorder),
        "+ chunk-sharing (graphs built once)": n / float_inorder,
        "+ shadow outliers (W8A8 + shadow, in order)": out.get("inorder_tok_s"),
        "+ out-of-order": out.get("ooo_tok_s"),
    }
    return {"tok_s": steps, "prepare_s": prepare}


# --------------------------------------------------------------------------- end to end (--e2e)
def _timed_generate(generate, ids: torch.Tensor, new_tokens: int) -> dict:
    """TTFT and decode speed of one greedy ``generate`` of exactly ``new_tokens`` tokens (EOS ignored,
    so every variant decodes as many)."""
    clock = TokenClock()
    start = time.perf_counter()
    generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=new_tokens,
             min_new_tokens=new_tokens, do_sample=False, streamer=clock, pad_token_id=0)
    return token_rates(start, clock.times)


def llamacpp_generate(lm: LoadedModel, threads: int):
    """A function ``ids, new_tokens -> timings`` of llama.cpp greedy generation on the same GGUF, or
    (None, reason) when unavailable."""
    cy, model = llamacpp_model(lm)
    if cy is None:
        return None, model

    def generate(ids: torch.Tensor, new_tokens: int) -> dict:
        tokens = [int(t) for t in ids]
        params = cy.LlamaContextParams()
        params.n_ctx = len(tokens) + new_tokens
        params.n_batch = params.n_ubatch = len(tokens)
        params.n_threads = params.n_threads_batch = threads
        ctx = cy.LlamaContext(model, params)
        sampler = cy.LlamaSampler(cy.LlamaSamplerChainParams())
        sampler.add_greedy()
        times = []
        start = time.perf_counter()
        ctx.decode(cy.llama_batch_get_one(tokens))
        token = sampler.sample(ctx, -1)
        times.append(time.perf_counter())
        for i in range(new_tokens - 1):
            ctx.decode(cy.llama_batch_get_one([token], len(tokens) + i))
            token = sampler.sample(ctx, -1)
            times.append(time.perf_counter())
        del ctx
        return token_rates(start, times)

    return generate, None


def bench_e2e(lm: LoadedModel, ids: torch.Tensor, new_tokens: int, chunk: int, repeats: int = 3,
              quant="w8a8-shadow", progress: bool = True, placement: str = PAPER) -> dict:
    """What a user waits for: time to first token and decode tok/s of one prompt, for Hugging Face eager
    ``generate``, the wrapper with float and with INT8 decode, and llama.cpp on the same GGUF;
    interleaved, medians of ``repeats``, ratios against Hugging Face."""
    if new_tokens < 2:
        raise LlmNpuError(f"--max-new-tokens must be at least 2 to time decode, got {new_tokens}")
    if repeats < 1:
        raise LlmNpuError(f"repeats must be at least 1, got {repeats}")
    tune_malloc()
    threads = Workers.auto().threads * 2
    # no prefix cache: every timed run repeats the same prompt, which it would serve from memory
    wrappers = {mode: LlmNpuForCausalLM(lm, chunk_len=chunk, quant=quant, decode=mode, prefix_cache=False,
                                        progress=progress, placement=placement)
                for mode in ("fp32", "int8")}
    if wrappers["int8"].decode_mode != "int8":
        del wrappers["int8"]          # a family the INT8 decoder does not cover: nothing to time

    def hf(ids, n):
        with torch_threads(threads), torch.inference_mode():
            return _timed_generate(lm.model.generate, ids, n)

    variants = {"hf_eager": hf}
    variants.update({f"wrapper_{mode}_decode": (lambda ids, n, w=w: _timed_generate(w.generate, ids, n))
                     for mode, w in wrappers.items()})
    llama, reason = llamacpp_generate(lm, threads)
    if llama is not None:
        variants["llamacpp"] = llama
    runs = {name: [] for name in variants}
    for name, fn in variants.items():            # warm-up
        fn(ids, 2)
    for _ in tqdm(range(repeats), desc="bench --e2e", disable=not progress, leave=False):
        for name, fn in variants.items():
            runs[name].append(fn(ids, new_tokens))
    out = {"model": lm.spec, "machine": int8_path.describe(), "prompt_tokens": int(ids.numel()), "new_tokens": new_tokens, "chunk": chunk,
           "quant": quant if isinstance(quant, str) else "custom", "threads": threads, "repeats": repeats,
           "placement": next(iter(wrappers.values())).engine.config.placement, "variants": {}}
    for name, rs in runs.items():
        out["variants"][name] = {"ttft_s": _median([r["ttft_s"] for r in rs]),
                                 "decode_tok_s": _median([r["decode_tok_s"] for r in rs])}
    base = out["variants"]["hf_eager"]
    for v in out["variants"].values():
        v["ttft_vs_hf"] = base["ttft_s"] / v["ttft_s"]
        v["decode_vs_hf"] = v["decode_tok_s"] / base["decode_tok_s"]
    if reason:
        out["llamacpp_reason"] = reason
    return out
