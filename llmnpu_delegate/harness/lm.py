"""``lm_eval --model llmnpu``: the lm-evaluation-harness scoring our quantized numerics.

Scores (``loglikelihood``, ``loglikelihood_rolling``) come from the quantized reference: a copy of the
float model whose linears are replaced by ``quantize_`` (W8A8 per-tensor activations, per-channel
weights, shadow outliers with the chosen pruning), the numerics the chunked engine is tested equal to
(tests/test_prefill.py, within a tenth of the quantization effect). It returns every position's
logits, which the engine's chunk graphs do not (they return the last token's). Generation
(``generate_until``) is the product's own: ``LlmNpuForCausalLM.generate``, the engine's chunked NPU
prefill and its decode.

``model_args`` take what the CLI takes: ``model=`` (default smollm2-135m), ``quant=`` (an ``llmnpu eval``
mode: fp32, w8a8, smoothquant, w8a8-shadow, w8a8-shadow-pruned = the default; ``qnn`` with
``pte=`` a ``.pte``: that program's numerics; ``et-16a8w``, ``et-16a4w``, ``et-8a8w``: ExecuTorch's
Qualcomm quantizer, ``recipes.py``; those three and ``qnn`` score only), ``pruning_rate=``,
``clip_percentile=``, ``importance=``, ``chunk_len=``, ``decode=`` (int8 | fp32 | auto), ``max_length=``,
``placement=`` (a quantization mode's attention where that placement puts it: on the NPU at its 16-bit
encodings, ``placed_numerics.py``; default ``paper``, on the CPU) and ``npu_kv_bits=`` (16 | 8). It runs on the
CPU whatever ``--device`` says (lm-eval passes ``cuda:0`` by default); ``--batch_size`` is ignored
(one sequence at a time, so scores never depend on padding).
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from ..chunk_step import DEFAULT_CHUNK
from ..errors import LlmNpuError
from ..evaluate import ALL_MODES, DEFAULT_MODE, MODES, PROGRAM_MODE, check_modes, program_model, quantized_model
from ..quantize import CalibConfig
from ..quantize.calibrate import calibration_samples
from ..recipes import RECIPES, recipe_model
from ..text import calibration_ids
from ..models import DEFAULT_MODEL, LoadedModel, load_model
from ..partitioner.placement import PAPER
from ..placed_numerics import apply_placement, check_kv_bits


@register_model("llmnpu")
class LlmNpuLM(TemplateLM):
    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, quant: str = DEFAULT_MODE, pruning_rate=None,
                 clip_percentile=None, importance=None, chunk_len: int = DEFAULT_CHUNK, decode: str = "auto",
                 max_length: int | None = None, calibration=None, progress: bool = False, pte=None,
                 placement=None, npu_kv_bits=None, batch_size=1, max_batch_size=None, device=None, **unknown):
        super().__init__()
        if unknown:
            raise LlmNpuError(f"unknown model_args {sorted(unknown)}: use model, quant, pruning_rate, "
                              "clip_percentile, importance, chunk_len, decode, max_length, pte, placement, "
                              "npu_kv_bits")
        if quant not in ALL_MODES:
            raise LlmNpuError(f"unknown quant '{quant}': use one of {', '.join(ALL_MODES)}")
        check_modes([quant], pte)
        self.lm = model if isinstance(model, LoadedModel) else load_model(str(model))
        self.quant_name = quant
        self.config = MODES.get(quant)
        knobs = {k: v for k, v in (("pruning_rate", pruning_rate), ("clip_percentile", clip_percentile),
                                   ("importance", importance)) if v is not None}
        if knobs:
            if self.config is None or self.config.outliers != "shadow":
                raise LlmNpuError(f"{', '.join(knobs)} only apply to the shadow modes (quant=w8a8-shadow...)")
            self.config = dataclasses.replace(self.config, **knobs)
        if (placement is not None or npu_kv_bits is not None) and self.config is None:
            raise LlmNpuError(f"placement and npu_kv_bits apply to the quantization modes ({', '.join(m for m in MODES if MODES[m])}), "
                              f"not to quant={quant}")
        self.chunk_len, self.decode, self.progress = int(chunk_len), decode, progress
        self.tokenizer = self.lm.tokenizer
        limit = getattr(self.lm.model.config, "max_position_embeddings", 2048)
        self.max_length = int(max_length or min(limit, 2048))
        self.calibration = calibration     # None: the cached one on the shipped calibration text
        if pte is not None:
            self.scorer = program_model(self.lm, pte, calibration, progress)[0]
        elif quant in RECIPES:
            samples = calibration_samples(calibration_ids(self.lm), CalibConfig())
            self.scorer = recipe_model(self.lm, quant, samples, progress)
        else:
            self.scorer = quantized_model(self.lm, self.config, calibration, progress)[0] if self.config else self.lm.model
        self.placement, self.npu_kv_bits = placement or PAPER, check_kv_bits(npu_kv_bits or 16)
        if self.config is not None and pte is None:
            apply_placement(self.lm, self.scorer, self.placement, self.npu_kv_bits, self.chunk_len, calibration)
        self._wrapper = None

    # ---------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    # ---------------------------------------------------------------- scores
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    @torch.inference_mode()
    def _logprobs(self, tokens: list[int], keep: int | None = None, past=None):
        """[keep, vocab] log-probabilities of the next token after each of the last ``keep`` positions
        (all by default), and the K/V after ``tokens`` (given ``past``: the K/V before them)."""
        out = self.scorer(input_ids=torch.tensor([tokens]), past_key_values=past, use_cache=True,
                          logits_to_keep=keep or 0)
        return F.log_softmax(out.logits[0].float(), -1), out.past_key_values

    def _score(self, logp: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
        want = torch.tensor(continuation)
        return float(logp.gather(1, want[:, None]).sum()), bool((logp.argmax(-1) == want).all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        # Requests that share a context (a multiple-choice question's endings) run it once and continue
        # each ending from a copy of its K/V: per-token numerics (static activation scales), so the
        # same scores as one forward per request, to float rounding. A scorer that keeps no K/V would
        # run the context again for each ending: one forward per request costs one context less.
        shared = getattr(self.scorer, "keeps_kv", True)
        groups: dict[tuple, list[int]] = {}
        for i, (_, context, _) in enumerate(requests):
            groups.setdefault(tuple(context), []).append(i)
        out: list = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=f"llmnpu {self.quant_name}", disable=disable_tqdm or not self.progress)
        for context, members in groups.items():
            conts = [requests[i][2] for i in members]
            if shared and len(context) + max(map(len, conts)) - 1 <= self.max_length:
                head, past = self._logprobs(list(context), keep=1)
                for i, cont in zip(members, conts):
                    logp = head
                    if len(cont) > 1:
                        kv = copy.deepcopy(past) if len(members) > 1 else past
                        logp = torch.cat([head, self._logprobs(cont[:-1], past=kv)[0]])
                    out[i] = self._score(logp, cont)
                    bar.update()
                continue
            for i, cont in zip(members, conts):
                # the last max_length tokens of context + continuation, minus the last (nothing follows it)
                whole = (list(context) + cont)[-(self.max_length + 1):]
                if len(cont) > len(whole) - 1:
                    raise LlmNpuError(f"a continuation of {len(cont)} tokens does not fit max_length={self.max_length}")
                out[i] = self._score(self._logprobs(whole[:-1], keep=len(cont))[0], cont)
                bar.update()
        bar.close()
        for (strings, _, _), result in zip(requests, out):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in tqdm([r.args for r in requests], desc=f"llmnpu {self.quant_name} rolling", disable=disable_tqdm or not self.progress):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, c, p) for c, p in windows], disable_tqdm=True)
            out.append(sum(s for s, _ in scores))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), out[-1])
        return out

    # ---------------------------------------------------------------- generation
    @property
    def wrapper(self):
        if self.quant_name == PROGRAM_MODE or self.quant_name in RECIPES:
            raise LlmNpuError(f"quant={self.quant_name} scores (loglikelihood tasks) and does not generate: "
                              f"generation tasks run our engine's modes (and a program: llmnpu run --pte PATH)")
        if self._wrapper is None:       # built on first use: scoring-only tasks never compile the engine
            from ..hf import LlmNpuForCausalLM

            self._wrapper = LlmNpuForCausalLM(self.lm, chunk_len=self.chunk_len, quant=self.config,
                                              calibration=self.calibration, decode=self.decode, progress=False,
                                              placement=self.placement, npu_kv_bits=self.npu_kv_bits)
        return self._wrapper

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], desc=f"llmnpu {self.quant_name} generate",
                                        disable=disable_tqdm or not self.progress):
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or [self.tokenizer.decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.pop("max_gen_toks", 256))
            if kwargs.pop("do_sample", False) or kwargs.get("temperature", 0.0) > 0:
                raise LlmNpuError("llmnpu generates greedily in lm-eval: drop do_sample / temperature")
            ids = self.tok_encode(context)[-(self.max_length - new):]
            tokens = self.wrapper.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids):]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out
