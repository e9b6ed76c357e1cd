"""``llmnpu validate``."""
from __future__ import annotations

from ..backends.qnn import DEFAULT_SOC
from ..errors import LlmNpuError
from ..models import DEFAULT_MODEL, load_model
from ..quantize import CalibConfig, QuantConfig
from ..quantize.calibrate import calibration_samples
from ..recipes import RECIPES, validate_recipe
from ..runtime.engine import export_engine
from ..runtime.pte_runner import PteRunner
from ..runtime.validate import validate_pte
from ..simulate.phone import choose_pruning
from ..text import calibration_ids, read_text, tokenize
from .common import add_output_args


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="run an exported .pte (or an ExecuTorch recipe's QNN program) on this host "
                                        "and compare it with its host reference",
                       description="Run each NPU method of the .pte (QNN methods on Qualcomm's HTP simulator) on one "
                                   "chunk of evaluation text and compare with the cpu-int8 engine in output "
                                   "quantization steps and SQNR; then prefill a short prompt from the .pte alone "
                                   "(reference runner, out-of-order executor) and compare the next token. Exit "
                                   "status 1 when the next token differs. With --recipe, lower ExecuTorch's "
                                   "Qualcomm recipe (as llmnpu eval scores it) whole to QNN and compare its logits on "
                                   "the HTP simulator with the recipe's scorer on a few prompts of evaluation text; "
                                   "exit status 1 when a next token differs. Simulator times are not speed.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--pte", help="the .pte written by llmnpu export (its .json beside it)")
    what.add_argument("--recipe", choices=sorted(RECIPES),
                      help="an ExecuTorch recipe of llmnpu eval's et-* modes, on --model")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="tokens of the whole-prefill prompt (default 1.5 chunks; with --recipe, of each prompt: "
                        f"default {RECIPE_TOKENS})")
    p.add_argument("--per-layer", action="store_true",
                   help=f"list every NPU linear, worst SQNR first (default: the {WORST} worst)")
    recipe = p.add_argument_group("with --recipe")
    recipe.add_argument("--model", default=DEFAULT_MODEL, help=f"the model (default {DEFAULT_MODEL})")
    recipe.add_argument("--soc", default=DEFAULT_SOC, help=f"the SoC the program is compiled for (default {DEFAULT_SOC})")
    recipe.add_argument("--prompts", type=int, default=RECIPE_PROMPTS, help="prompts of evaluation text (default 3)")
    recipe.add_argument("--no-r3", action="store_true", help="without the recipe's R3 rotation of Q and K")
    add_output_args(p)
    p.set_defaults(func=cmd_validate)


RECIPE_TOKENS, RECIPE_PROMPTS = 128, 3


def cmd_validate(args) -> dict:
    if args.recipe:
        return _validate_recipe(args)
    given = [flag for flag, value, default in (("--model", args.model, DEFAULT_MODEL), ("--soc", args.soc, DEFAULT_SOC),
                                               ("--prompts", args.prompts, RECIPE_PROMPTS), ("--no-r3", args.no_r3, False))
             if value != default]
    if given:
        raise LlmNpuError(f"{', '.join(given)} go with --recipe: a .pte carries its own model and SoC")
    runner = PteRunner(args.pte)             # checks the .pte and its sidecar first
    meta = runner.meta
    model = meta["model"]
    if "spec" not in model:
        raise LlmNpuError(f"{args.pte}'s sidecar does not say which model it was exported from")
    lm, engine = export_engine(model["spec"], meta["chunk_len"], QuantConfig.from_dict(meta["quant"]),
                               model.get("blocks"), progress=not args.no_progress, choose=choose_pruning,
                               placement=meta["placement"])
    ids = tokenize(lm, read_text(None, "eval"))
    prompt = ids[: args.prompt_tokens] if args.prompt_tokens else None
    result = validate_pte(args.pte, engine, ids, prompt, runner=runner)
    args.text = _format_validate(result, None if args.per_layer else WORST)
    args.failed = not result["prefill"]["same_next_token"]
    return result


def _validate_recipe(args) -> dict:
    from ..backends.qnn import check_soc

    length = args.prompt_tokens or RECIPE_TOKENS
    if length < 2 or args.prompts < 1:
        raise LlmNpuError(f"--prompts must be at least 1 and --prompt-tokens at least 2, got {args.prompts} and "
                          f"{length}")
    check_soc(args.soc)
    lm = load_model(args.model)
    ids = tokenize(lm, read_text(None, "eval"))
    if ids.numel() < args.prompts * length:
        raise LlmNpuError(f"the evaluation text holds {ids.numel()} tokens, fewer than --prompts x --prompt-tokens "
                          f"({args.prompts} x {length}): ask for fewer")
    prompts = ids[: args.prompts * length].reshape(args.prompts, length)
    calib = calibration_samples(calibration_ids(lm), CalibConfig())      # as llmnpu eval observes the recipes
    result = validate_recipe(lm, args.recipe, prompts, calib, args.soc, not args.no_r3, not args.no_progress)
    args.text = _format_recipe(result)
    args.failed = not result["same_next_token"]
    return result


def _format_recipe(r: dict) -> str:
    lines = [f"ExecuTorch {r['recipe']}{' + R3' if r['r3'] else ''} as one QNN graph on {r['soc']} (HTP simulator), "
             f"{len(r['prompts'])} prompts of {r['prompt_tokens']} tokens of evaluation text; logits SQNR in dB and "
             f"the share of positions whose greedy token agrees:",
             f"{'prompt':>6} {'HTP~recipe':>10} {'HTP~fp32':>8} {'recipe~fp32':>11} {'top-1 HTP=recipe':>16} "
             f"{'HTP=fp32':>8} {'recipe=fp32':>11}  next token HTP / recipe / fp32"]
    for i, x in enumerate(r["prompts"]):
        db, nt = x["logits_sqnr_db"], x["next_token"]
        lines.append(f"{i:>6} {db['htp_vs_recipe']:>10.1f} {db['htp_vs_fp32']:>8.1f} {db['recipe_vs_fp32']:>11.1f} "
                     f"{100 * x['top1_htp_is_recipe']:>15.1f}% {100 * x['top1_htp_is_fp32']:>7.1f}% "
                     f"{100 * x['top1_recipe_is_fp32']:>10.1f}%  {nt['htp']} / {nt['recipe']} / {nt['fp32']}")
    lines.append("the HTP program gives the recipe's next token on every prompt" if r["same_next_token"]
                 else "the HTP program's next token DIFFERS from the recipe's on some prompt")
    return "\n".join(lines)


WORST = 10


def _bits(x: dict) -> str:
    """The output's bits; ``8+`` when some part of it has a second, finer 8-bit encoding."""
    return f"{x['output_bits']}{'+' if x.get('fine_outputs') else ''}"


def _format_validate(r: dict, rows: int | None = None) -> str:
    """The report as text: the NPU linears worst SQNR first (``rows`` of them, or all), the NPU graphs,
    then the totals."""
    lines = _format_linears(r, rows)
    if r["npu_graphs"]:
        worst = min(r["npu_graphs"], key=lambda x: x["sqnr_db_min"])
        lines.append(f"{len(r['npu_graphs'])} NPU graphs (placement {r['placement']}: methods holding more than "
                     f"linears) on the engine's inputs of their subgraphs: every output >= "
                     f"{worst['sqnr_db_min']:.1f} dB from the engine's (worst: {worst['method']}, layer {worst['layer']})")
    p = r["prefill"]
    verdict = "same next token" if p["same_next_token"] else "DIFFERENT next token"
    lines.append(f"whole prefill from the .pte alone ({p['tokens']} tokens, {p['chunks']} chunks, {p['policy']} "
                 f"schedule): {verdict} (pte {p['next_token_pte']}, engine {p['next_token_engine']}); logits SQNR "
                 f"{p['logits_sqnr_db']:.1f} dB, K/V SQNR >= {p['kv_sqnr_db_min']:.1f} dB")
    vs = p["logits_sqnr_db_vs_fp32"]
    lines.append(f"against the float model: logits SQNR pte {vs['pte']:.1f} dB, engine {vs['engine']:.1f} dB; "
                 f"fp32 next token {p['next_token_fp32']}")
    return "\n".join(lines)


def _format_linears(r: dict, rows: int | None) -> list[str]:
    if not r["linears"]:
        return []
    where = f"{r['target']}{' on ' + r['soc'] + ' (HTP simulator)' if r['soc'] else ''}"
    ranked = sorted(r["linears"], key=lambda x: x["sqnr_db"])
    shown = ranked if rows is None else ranked[:rows]
    which = "every NPU linear" if len(shown) == len(ranked) else f"the {len(shown)} worst of {len(ranked)} NPU linears"
    lines = [f"{which} of the .pte ({where}) against the cpu-int8 engine, worst first, one chunk of evaluation "
             f"text (steps: of the 8-bit output encoding, or of the int32 accumulator for a float output):",
             f"{'subgraph':>8} {'layer':>5}  {'linear':<28} {'bits':>4} {'max steps':>9} {'<= 2 steps':>10} "
             f"{'saturated':>9} {'SQNR dB':>8}"]
    for x in shown:
        steps = f"{x['max_steps']:.2f}" if x["max_steps"] is not None else "-"
        lines.append(f"{x['subgraph']:>8} {x['layer'] if x['layer'] is not None else '-':>5}  "
                     f"{x['linear'].split('.', 3)[-1]:<28} {_bits(x):>4} {steps:>9} "
                     f"{100 * x['within_2_steps']:>9.2f}% {100 * x['saturated']:>8.3f}% {x['sqnr_db']:>8.1f}")
    inside = [x["max_steps"] for x in r["linears"] if x["max_steps"] is not None]
    fine = sum(bool(x.get("fine_outputs")) for x in r["linears"])
    if fine:
        lines.append(f"8+: {fine} linears with a second, finer 8-bit encoding of some output (steps: of the "
                     f"encoding the runner took)")
    lines.append(f"{len(r['linears'])} linears: elements within 2 steps >= "
                 f"{100 * min(x['within_2_steps'] for x in r['linears']):.2f} % in every linear; largest difference "
                 f"{max(inside):.2f} steps where the engine's value is inside the output range; "
                 f"{100 * max(x['saturated'] for x in r['linears']):.3f} % saturated at most")
    return lines
