"""Check an ExecuTorch recipe's scorer on the HTP simulator (``llmnpu validate --recipe``).

``llmnpu eval --modes et-16a8w ...`` scores ExecuTorch's Qualcomm quantization with its converted
fake-quant graph on the host (``recipes.py``). Here the same converted graph is lowered whole to QNN
for a fixed prompt length (``recipes.recipe_program``) and run on Qualcomm's HTP simulator on a few
prompts of evaluation text: the program's logits against the scorer's (does the scorer compute what
the recipe's QNN program computes?) and both against the float model's.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor

from .. import backends
from ..models import LoadedModel
from ..quantize.sqnr import sqnr_db
from ..recipes import recipe_converted, recipe_program, scorer_of


def validate_recipe(lm: LoadedModel, mode: str, prompts: Tensor, calib_windows: Tensor, soc: str,
                    r3: bool = True, progress: bool = True) -> dict:
    """The recipe ``mode`` observed on ``calib_windows`` as ``llmnpu eval`` scores it, and as its QNN
    program for ``soc`` computes it on the HTP simulator, on each of ``prompts`` [n, length]."""
    from executorch.runtime import Runtime

    converted = recipe_converted(lm, mode, calib_windows, progress, r3)
    scorer = scorer_of(copy.deepcopy(converted), mode)
    program = recipe_program(converted, prompts[:1], soc)
    backends.get("qnn").prepare_runtime()
    forward = Runtime.get().load_program(program).load_method("forward")
    rows = []
    for ids in prompts:
        with torch.no_grad():
            recipe = scorer(ids[None]).logits[0]
            fp32 = lm.model(input_ids=ids[None], use_cache=False).logits[0].float()
        htp = forward.execute([ids[None]])[0][0]
        rows.append({
            "logits_sqnr_db": {"htp_vs_recipe": round(sqnr_db(htp, recipe), 1),
                               "htp_vs_fp32": round(sqnr_db(htp, fp32), 1),
                               "recipe_vs_fp32": round(sqnr_db(recipe, fp32), 1)},
            # every position's greedy choice, the last one being the next token
            "top1_htp_is_recipe": round(float((htp.argmax(-1) == recipe.argmax(-1)).float().mean()), 4),
            "top1_htp_is_fp32": round(float((htp.argmax(-1) == fp32.argmax(-1)).float().mean()), 4),
            "top1_recipe_is_fp32": round(float((recipe.argmax(-1) == fp32.argmax(-1)).float().mean()), 4),
            "next_token": {"htp": int(htp[-1].argmax()), "recipe": int(recipe[-1].argmax()),
                           "fp32": int(fp32[-1].argmax())},
        })
    return {"recipe": mode, "r3": r3, "soc": soc, "prompt_tokens": prompts.shape[1],
            "program_bytes": len(program), "prompts": rows,
            "same_next_token": all(r["next_token"]["htp"] == r["next_token"]["recipe"] for r in rows)}
