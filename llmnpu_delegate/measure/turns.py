"""``llmnpu bench --e2e --turns N``: what a user waits for at each turn of a conversation.

Two forms, synthetic but realistic (slices of the shipped calibration text, a fixed seed):

- ``agent`` (the paper's UI agent, section 2.1): fixed instructions of ~400 tokens, then at every
  step a new ~300-token screen, and a 16-token answer (an action); the trajectory grows;
- ``chat``: a ~400-token document and question, then at every turn a ~40-token question after the
  16-token answer.

Every turn sends the whole history. Four ways to answer it, interleaved conversation by
conversation, medians per turn: our wrapper with its prefix cache (the history's prefilled part is
reused), our wrapper without it, Hugging Face ``generate`` continuing from its own
``past_key_values``, and llama.cpp (``cyllama``, the same GGUF) keeping its context between turns.
Each conversation starts cold (an empty prefix cache), so turn 1 is a whole prefill everywhere.
"""
from __future__ import annotations

import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from .speed import llamacpp_model, torch_threads
from ..errors import LlmNpuError
from ..hf import LlmNpuForCausalLM
from ..kernels import int8_path
from ..models import LoadedModel
from ..generation import TokenClock
from ..runtime.allocator import tune_malloc
from ..runtime.executor import Workers
from ..runtime.prefix_cache import PrefixCache
from ..text import read_text, tokenize

# form: (first prompt's fixed part, new tokens per later turn, answer tokens)
FORMS = {"agent": (400, 300, 16), "chat": (400, 40, 16)}


def workload(lm: LoadedModel, form: str, turns: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(fixed start, each turn's new tokens): slices of the calibration text at seeded offsets. Turn 1
    adds a first screen (agent) or question (chat) to the fixed start."""
    if form not in FORMS:
        raise LlmNpuError(f"unknown conversation form '{form}': use one of {', '.join(FORMS)}")
    if turns < 1:
        raise LlmNpuError(f"--turns must be at least 1, got {turns}")
    fixed, new, _ = FORMS[form]
    text = tokenize(lm, read_text(None, "calib"))
    if text.numel() < fixed + new * turns + 1:
        raise LlmNpuError("the calibration text is too short for this many turns: give fewer --turns")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, text.numel() - max(fixed, new), (turns + 1,), generator=g).tolist()
    return text[starts[0]:starts[0] + fixed], [text[s:s + new] for s in starts[1:]]


def _ttft_generate(generate, ids: torch.Tensor, answer: int, **kwargs) -> tuple[float, object]:
    clock = TokenClock()
    start = time.perf_counter()
    out = generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=answer, min_new_tokens=answer,
                   do_sample=False, streamer=clock, pad_token_id=0, **kwargs)
    return clock.times[0] - start, out


def _wrapper_conversation(wrapper: LlmNpuForCausalLM, cached: bool):
    def converse(fixed, turns, answer):
        wrapper.engine.prefix_cache = PrefixCache() if cached else None
        history, ttft = fixed, []
        for new in turns:
            history = torch.cat([history, new])
            t, out = _ttft_generate(wrapper.generate, history, answer)
            ttft.append(t)
            history = out[0]
        held = wrapper.engine.prefix_cache.bytes if cached else 0
        wrapper.engine.prefix_cache = None
        return ttft, held
    return converse


def _hf_conversation(model, threads: int):
    def converse(fixed, turns, answer):
        history, cache, ttft = fixed, DynamicCache(config=model.config), []
        with torch_threads(threads), torch.inference_mode():
            for new in turns:
                history = torch.cat([history, new])
                t, out = _ttft_generate(model.generate, history, answer, past_key_values=cache,
                                        return_dict_in_generate=True)
                ttft.append(t)
                history, cache = out.sequences[0], out.past_key_values
        held = sum(layer.keys.numel() * 4 * 2 for layer in cache.layers)
        return ttft, held
    return converse


def _llamacpp_conversation(lm: LoadedModel, threads: int, context: int):
    cy, model = llamacpp_model(lm)
    if cy is None:
        return None, model

    def converse(fixed, turns, answer):
        params = cy.LlamaContextParams()
        params.n_ctx = context
        params.n_batch = params.n_ubatch = context
        params.n_threads = params.n_threads_batch = threads
        ctx = cy.LlamaContext(model, params)
        sampler = cy.LlamaSampler(cy.LlamaSamplerChainParams())
        sampler.add_greedy()
        fed, pending, ttft = 0, [int(t) for t in fixed], []     # tokens in the context, tokens to feed
        for new in turns:
            pending += [int(t) for t in new]
            start = time.perf_counter()
            ctx.decode(cy.llama_batch_get_one(pending, fed))      # only what the context does not hold
            fed += len(pending)
            token = sampler.sample(ctx, -1)
            ttft.append(time.perf_counter() - start)
            for _ in range(answer - 1):
                ctx.decode(cy.llama_batch_get_one([token], fed))
                fed += 1
                token = sampler.sample(ctx, -1)
            pending = [token]                                     # sampled, not yet fed
        del ctx
        return ttft, None
    return converse, None


def bench_turns(lm: LoadedModel, form: str = "agent", turns: int = 4, chunk: int = 256, repeats: int = 3,
                quant="w8a8-shadow", progress: bool = True) -> dict:
    """Per-turn TTFT (medians of ``repeats`` conversations) of the four ways; ratios against turn 1 of
    the cached wrapper, and against Hugging Face and llama.cpp at the same turn."""
    if repeats < 1:
        raise LlmNpuError(f"repeats must be at least 1, got {repeats}")
    fixed, news = workload(lm, form, turns)
    answer = FORMS[form][2]
    total = fixed.numel() + sum(n.numel() for n in news) + answer * turns
    if total > lm.model.config.max_position_embeddings:
        raise LlmNpuError(f"{turns} turns need {total} tokens, more than the model's context: give fewer --turns")
    tune_malloc()
    threads = Workers.auto().threads * 2
    wrapper = LlmNpuForCausalLM(lm, chunk_len=chunk, quant=quant, prefix_cache=False, progress=progress)
    variants = {"llmnpu_prefix_cache": _wrapper_conversation(wrapper, True),
                "llmnpu_no_cache": _wrapper_conversation(wrapper, False),
                "hf_past_key_values": _hf_conversation(lm.model, threads)}
    llama, reason = _llamacpp_conversation(lm, threads, total)
    if llama is not None:
        variants["llamacpp_context"] = llama
    for fn in variants.values():                  # warm-up: one short conversation each
        fn(fixed, news[:1], 2)
    runs = {name: [] for name in variants}
    held = {}
    for _ in tqdm(range(repeats), desc=f"bench --turns ({form})", disable=not progress, leave=False):
        for name, fn in variants.items():
            ttft, held[name] = fn(fixed, news, answer)
            runs[name].append(ttft)
    per_turn = {name: [statistics.median(r[t] for r in rs) for t in range(turns)] for name, rs in runs.items()}
    new_tokens = [fixed.numel() + news[0].numel()] + [n.numel() + answer for n in news[1:]]
    out = {"model": lm.spec, "machine": int8_path.describe(), "form": form, "turns": turns, "chunk": chunk,
           "answer_tokens": answer, "new_tokens": new_tokens, "threads": threads, "repeats": repeats,
           "quant": quant if isinstance(quant, str) else "custom", "ttft_s": per_turn,
           "cache_bytes": {k: v for k, v in held.items() if v is not None}}
    ours = per_turn["llmnpu_prefix_cache"]
    out["vs_first_turn"] = [t / ours[0] for t in ours]
    out["vs"] = {name: [ours[t] / ts[t] for t in range(turns)] for name, ts in per_turn.items()
                 if name != "llmnpu_prefix_cache"}
    if reason:
        out["llamacpp_reason"] = reason
    return out


def format_turns(r: dict) -> str:
    names = {"llmnpu_prefix_cache": "llmnpu, prefix cache", "llmnpu_no_cache": "llmnpu, no cache",
             "hf_past_key_values": "HF generate, past_key_values", "llamacpp_context": "llama.cpp, kept context"}
    lines = [f"{r['model']}, {r['form']} form: TTFT per turn (ms), median of {r['repeats']} conversations, "
             f"{r['threads']} threads, chunk {r['chunk']}, {r['answer_tokens']}-token answers",
             f"cpu {r['machine']['cpu']} ({r['machine']['isa']})",
             f"{'turn':<32}" + "".join(f"{t + 1:>9}" for t in range(r["turns"])),
             f"{'new tokens':<32}" + "".join(f"{n:>9}" for n in r["new_tokens"])]
    for name, ts in r["ttft_s"].items():
        lines.append(f"{names.get(name, name):<32}" + "".join(f"{1e3 * t:>9.0f}" for t in ts))
    lines.append(f"{'prefix cache vs its turn 1':<32}" + "".join(f"{x:>8.2f}x" for x in r["vs_first_turn"]))
    for name, ratios in r["vs"].items():
        lines.append(f"{'prefix cache vs ' + names.get(name, name).split(',')[0]:<32}"
                     + "".join(f"{x:>8.2f}x" for x in ratios))
    held = ", ".join(f"{names.get(k, k)} {v / 2**20:.1f} MiB" for k, v in r["cache_bytes"].items() if v)
    if held:
        lines.append(f"K/V held after the conversation: {held}")
    if r.get("llamacpp_reason"):
        lines.append(f"llama.cpp: not measured ({r['llamacpp_reason']})")
    return "\n".join(lines)
