"""``llmnpu run``."""
from __future__ import annotations

import torch

from .. import backends
from ..chunk_step import DEFAULT_CHUNK
from ..errors import LlmNpuError
from ..generation import format_summary, run, run_pte
from ..hf import LlmNpuForCausalLM
from ..logs import hide_progress_bars
from ..models import DEFAULT_MODEL, load_model
from ..partitioner.placement import AUTO
from ..quantize import QUANT_MODES
from ..runtime.schedule import POLICIES
from .common import PLACEMENT_HELP, placement_or_auto, pruning_rate, read_prompt, sampling_of


def add_parser(sub) -> None:
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
    p.add_argument("--backend", choices=list(backends.names(engine=True)), default=None,
                   help=f"NPU backend of the prefill: one whose engine runs here (default {backends.DEFAULT})")
    p.add_argument("--quant", choices=list(QUANT_MODES), default=None,
                   help="quantization of the prefill (default w8a8-shadow)")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None,
                   help="share of layers without a shadow path (w8a8-shadow): auto (default) or a share in [0, 1]")
    p.add_argument("--chunk", type=int, default=None, help=f"chunk length (default {DEFAULT_CHUNK})")
    p.add_argument("--placement", type=placement_or_auto, default=None, help=PLACEMENT_HELP)
    p.add_argument("--policy", choices=list(POLICIES), default="ooo", help="prefill schedule (default ooo)")
    p.add_argument("--decode", choices=["auto", "int8", "fp32"], default="auto",
                   help="decode after the prompt: int8 (INT8 linears, static K/V cache), fp32 (Hugging Face's own "
                        "float forward, token for token) or auto (default: int8 where the family allows it)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write the prefill's Chrome/Perfetto trace and timeline PNG into DIR")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--json", action="store_true", help="no streaming; print the text and summary as one JSON object")
    p.set_defaults(func=cmd_run, streams=True)


def cmd_run(args) -> dict:

    prompt = read_prompt(args)
    if args.no_progress:
        hide_progress_bars()
    sampling = sampling_of(args)
    if args.native and args.pte is None:
        raise LlmNpuError("--native runs an exported program: give it with --pte FILE (llmnpu export writes one)")
    if args.pte is not None:
        if args.decode != "auto":
            raise LlmNpuError("--decode chooses the wrapper's decoder; an exported program decodes with its own "
                              "method (set at export: llmnpu export --decode)")
        return _run_pte(args, prompt, sampling)

    wrapper = LlmNpuForCausalLM(load_model(args.model or DEFAULT_MODEL), chunk_len=args.chunk or DEFAULT_CHUNK,
                                backend=args.backend or backends.DEFAULT, quant=args.quant or "w8a8-shadow",
                                pruning_rate=args.pruning_rate, placement=str(args.placement or AUTO),
                                policy=args.policy, decode=args.decode,
                                prefix_cache=False, progress=not args.no_progress)   # one prompt: nothing to reuse
    if args.seed is not None:
        torch.manual_seed(args.seed)
    summary = run(wrapper, prompt, args.max_new_tokens, args.chat, stream=not args.json, trace_dir=args.trace,
                  **sampling.generate_kwargs())
    args.text = format_summary(summary)
    return summary


_MODEL_OPTIONS = ("model", "backend", "quant", "pruning_rate", "chunk", "placement")


def _run_pte(args, prompt: str, sampling) -> dict:
    given = [f"--{k.replace('_', '-')}" for k in _MODEL_OPTIONS if getattr(args, k) is not None]
    if given:
        raise LlmNpuError(f"--pte runs the exported program alone, which fixes the model and its settings: "
                          f"drop {', '.join(given)}")
    summary = run_pte(args.pte, prompt, args.max_new_tokens, args.chat, stream=not args.json,
                      sampling=sampling, policy=args.policy,
                      native=args.native, trace_dir=args.trace)
    args.text = format_summary(summary)
    return summary
