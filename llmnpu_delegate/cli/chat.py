"""``llmnpu chat``."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from .. import backends
from ..chunk_step import DEFAULT_CHUNK
from ..conversation import (COMMANDS, Conversation, PteResponder, WrapperResponder, chat_loop, interactive_lines,
                            read_turns)
from ..errors import LlmNpuError
from ..logs import hide_progress_bars
from ..models import DEFAULT_MODEL
from ..partitioner.placement import AUTO
from ..quantize import QUANT_MODES
from ..runtime.prefix_cache import DEFAULT_BYTES, PrefixCache
from .common import PLACEMENT_HELP, placement_or_auto, pruning_rate, sampling_of


def add_parser(sub) -> None:
    commands = "; ".join(f"{c}: {what}" for c, what in COMMANDS.items())
    p = sub.add_parser("chat", help="a conversation in the terminal: each turn prefills only what is new",
                       description="Chat with a model (or an exported program) in the terminal, streaming. Each turn "
                                   "sends the whole history through the chat template; the prefix cache finds what "
                                   "was prefilled before, so a turn prefills only the last answer and the new "
                                   "message. After each answer: time to first token and how many prompt tokens "
                                   f"came from the cache. Commands: {commands}.")
    p.add_argument("--model", default=None,
                   help="smollm2-135m (default), a Hugging Face folder, a .gguf file or random:<shape>")
    p.add_argument("--pte", default=None, help="chat with an exported program alone (llmnpu export)")
    p.add_argument("--native", action="store_true",
                   help="with --pte: the C++ runner (runner/, `make runner`) instead of the Python reference runner")
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--turns", default=None, metavar="FILE",
                   help='read the turns from FILE (- for stdin), one JSON object per line: {"role": "user", '
                        '"content": TEXT} or {"command": "/reset"}; without it, lines typed (or piped) are turns')
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer at most (default 128)")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling share when sampling (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="also keep the prompts' K/V in DIR, so another process resumes a conversation (/load) "
                        "without prefilling it again")
    p.add_argument("--kv-cache-mb", type=int, default=None,
                   help=f"K/V of earlier prompts held in memory, MiB (default {DEFAULT_BYTES >> 20})")
    p.add_argument("--backend", choices=list(backends.names(engine=True)), default=None,
                   help=f"NPU backend of the prefill (default {backends.DEFAULT})")
    p.add_argument("--quant", choices=list(QUANT_MODES), default=None, help="quantization (default w8a8-shadow)")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None,
                   help="share of layers without a shadow path: auto (default) or a share in [0, 1]")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"chunk length (default {DEFAULT_CHUNK}; a later turn's few new tokens run on the "
                        "engine's tail program of a quarter of it)")
    p.add_argument("--placement", type=placement_or_auto, default=None, help=PLACEMENT_HELP)
    p.add_argument("--decode", choices=["auto", "int8", "fp32"], default="auto", help="decode (as for llmnpu run)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--json", action="store_true", help="no streaming; print every turn's record as one JSON object")
    p.set_defaults(func=cmd_chat, streams=True)


_MODEL_OPTIONS = ("model", "backend", "quant", "pruning_rate", "chunk", "placement")


def cmd_chat(args) -> dict:
    if args.max_new_tokens < 1:
        raise LlmNpuError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.kv_cache_mb is not None and args.kv_cache_mb < 0:
        raise LlmNpuError(f"--kv-cache-mb must be >= 0, got {args.kv_cache_mb}")
    sampling = sampling_of(args)
    if args.no_progress:
        hide_progress_bars()
    cache = PrefixCache((DEFAULT_BYTES >> 20 if args.kv_cache_mb is None else args.kv_cache_mb) << 20,
                        args.kv_cache_dir)
    if args.pte is not None:
        responder = _pte_responder(args, cache, sampling)
    elif args.native:
        raise LlmNpuError("--native runs an exported program: give it with --pte FILE (llmnpu export writes one)")
    else:
        responder = _wrapper_responder(args, cache, sampling)
    conv = Conversation(responder, args.system)
    lines = read_turns(args.turns) if args.turns is not None else interactive_lines()
    interactive = args.turns is None and sys.stdin.isatty()
    # with --json, stdout holds the one JSON object; what commands say goes to stderr
    try:
        records = chat_loop(conv, lines, stream=not args.json, out=sys.stderr if args.json else sys.stdout,
                            keep_going=interactive)
    finally:
        if hasattr(responder, "close"):
            responder.close()
    turns = [r for r in records if "text" in r]
    args.text = (f"--- {len(turns)} turn(s); prompt tokens from the cache: "
                 f"{sum(r['cached_tokens'] for r in turns)} of {sum(r['prompt_tokens'] for r in turns)}")
    return {"turns": records, "cache": cache.stats.to_dict()}


def _wrapper_responder(args, cache: PrefixCache, sampling) -> WrapperResponder:
    from ..hf import LlmNpuForCausalLM
    from ..models import load_model

    wrapper = LlmNpuForCausalLM(load_model(args.model or DEFAULT_MODEL), chunk_len=args.chunk or DEFAULT_CHUNK,
                                backend=args.backend or backends.DEFAULT, quant=args.quant or "w8a8-shadow",
                                pruning_rate=args.pruning_rate, placement=str(args.placement or AUTO),
                                decode=args.decode, prefix_cache=cache,
                                progress=not args.no_progress)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    return WrapperResponder(wrapper, args.max_new_tokens, sampling.generate_kwargs())


def _pte_responder(args, cache: PrefixCache, sampling):
    from ..format.sidecar import load_program_tokenizer
    from ..runtime.pte_runner import PteRunner

    given = [f"--{k.replace('_', '-')}" for k in _MODEL_OPTIONS if getattr(args, k) is not None]
    if given or args.decode != "auto":
        given += ["--decode"] if args.decode != "auto" else []
        raise LlmNpuError(f"--pte runs the exported program alone, which fixes the model and its settings: "
                          f"drop {', '.join(given)}")
    if args.native:
        from ..conversation import NativeResponder
        from ..format.sidecar import load_sidecar
        from ..runtime.native import NativeSession

        if args.kv_cache_dir is not None or args.kv_cache_mb is not None:
            raise LlmNpuError("the native runner keeps the last prompt's K/V in its own memory: drop "
                              "--kv-cache-dir and --kv-cache-mb")
        meta = load_sidecar(args.pte)
        tok = load_program_tokenizer(meta, Path(args.pte))
        session = NativeSession(args.pte, meta, sampling=sampling)
        return NativeResponder(session, meta["context"], tok, args.max_new_tokens)
    runner = PteRunner(args.pte, prefix_cache=cache)
    tok = load_program_tokenizer(runner.meta, runner.pte)
    return PteResponder(runner, tok, args.max_new_tokens, sampling)
