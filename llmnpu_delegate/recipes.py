"""ExecuTorch's own Qualcomm quantization, as a peer to score beside our modes (``llmnpu eval --modes
et-16a8w ...``).

ExecuTorch's Qualcomm LLM flow quantizes the whole graph with its ``QnnQuantizer``: every op's
activations at 16 bits (or 8) with per-tensor min/max encodings, linear weights per output channel
at 8 or 4 bits. Its recipe for the embedded model (``Smollm2QuantRecipe``, in the ``executorch``
wheel's ``examples/qualcomm/oss_scripts/llama/static_llm_quant_recipe.py``) is 16a8w with min/max
observers. Here that quantizer annotates the Hugging Face model's exported graph (sequence length
dynamic), observes our calibration windows, and the converted fake-quant graph is the scorer: what
its QNN program would compute, up to HTP's rounding. Left out: the R3 rotation that ExecuTorch's
static llama applies to K and Q after RoPE (its own model code, not a quantizer setting), and that
model's other rewrites (linears as 1x1 convolutions, its static K/V cache layout).
"""
from __future__ import annotations

import contextlib
import io
import logging

import torch
from torch import Tensor, nn

from .errors import LlmNpuError
from .models import LoadedModel

log = logging.getLogger(__name__)

# mode name -> ExecuTorch's QuantDtype member
RECIPES = {"et-16a8w": "use_16a8w", "et-16a4w": "use_16a4w", "et-8a8w": "use_8a8w"}

# ExecuTorch's CI floor for its QNN program of a model we ship (backends/qualcomm/tests/
# test_qnn_delegate.py, LlmSpecs): logits SQNR against the float model (its sqnr_eval, on one
# wikitext prompt of up to 1,024 tokens), a measure relative to fp32 and so comparable on our
# text. Its other floor, wikitext word perplexity <= 23, is absolute and wikitext's: on our
# Wikipedia extract fp32 itself scores 56 (docs/results.md), so it is not checked here.
ET_CI_GATES = {"smollm2-135m": {"logits_sqnr_db": 19.0}}


class _Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


class _Output:
    def __init__(self, logits: Tensor, past: Tensor):
        self.logits, self.past_key_values = logits, past


class RecipeScorer(nn.Module):
    """The converted graph behind the calls a scorer gets (``input_ids``, ``past_key_values``,
    ``logits_to_keep``). It keeps no K/V: its "past" is the tokens so far, and each call runs them
    all again (static per-tensor encodings: a prefix's logits do not depend on what follows)."""

    def __init__(self, graph: nn.Module, dtype: str):
        super().__init__()
        self.graph, self.dtype = graph, dtype

    def forward(self, input_ids: Tensor, past_key_values: Tensor | None = None, use_cache: bool = False,
                logits_to_keep: int = 0, **_) -> _Output:
        ids = input_ids if past_key_values is None else torch.cat([past_key_values, input_ids], 1)
        logits = self.graph(ids)[:, -input_ids.shape[1]:]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return _Output(logits, ids)


def recipe_model(lm: LoadedModel, mode: str, calib_windows: Tensor, progress: bool = True) -> RecipeScorer:
    """``lm``'s model quantized by ExecuTorch's Qualcomm quantizer with the setting ``mode`` (``RECIPES``),
    its encodings observed on ``calib_windows`` [n, length]."""
    if mode not in RECIPES:
        raise LlmNpuError(f"unknown ExecuTorch recipe {mode!r}: choose from {', '.join(RECIPES)}")
    from tqdm.auto import tqdm

    from .backends.qnn import qnn_quantizer

    quantizer = qnn_quantizer()
    from executorch.backends.qualcomm.quantizer.quantizer import QuantDtype
    from torchao.quantization.pt2e import MinMaxObserver
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    seq = torch.export.Dim("seq", min=2, max=int(getattr(lm.model.config, "max_position_embeddings", 2048)))
    # under no_grad: the rotary embedding's own no_grad would otherwise be a higher-order op the
    # quantizer's passes cannot read
    with torch.no_grad():
        graph = torch.export.export(_Logits(lm.model).eval(), (calib_windows[:1],), dynamic_shapes=({1: seq},),
                                    strict=False).module()
    quantizer.set_default_quant_config(getattr(QuantDtype, RECIPES[mode]), is_conv_per_channel=True,
                                       is_linear_per_channel=True, act_observer=MinMaxObserver)
    # the quantizer prints a line for every node of an op it has no config for (shape reads, clones,
    # aliases: nothing to quantize), hundreds per model: kept as one debug line instead
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        prepared = prepare_pt2e(graph, quantizer)
    skipped = sorted({line.rsplit(", ", 1)[-1] for line in printed.getvalue().splitlines() if line})
    log.debug("%s: ExecuTorch's quantizer left unannotated: %s", mode, ", ".join(skipped))
    with torch.no_grad():
        for window in tqdm(calib_windows, desc=f"{mode} calibration", unit="window", disable=not progress,
                           leave=False):
            prepared(window[None])
    return RecipeScorer(convert_pt2e(prepared), RECIPES[mode])
