"""How close INT8 decode (``runtime/hf_decoder.Int8Decoder``) stays to float decode, and what it costs, per
number of per-token outliers taken out of the INT8 activation.

    .venv/bin/python benchmarks/decode_accuracy.py [--outliers 0 2 4 8 16] [--windows 3] [--policies]

On the *calibration* text (news; the evaluation text is never used to choose a setting): for each
window, the float model prefills 200 tokens, then decodes the next 100 teacher-forced, once with its
own forward (the reference) and once with the decoder. Prints the share of steps whose greedy token
agrees, the logits' SQNR against the reference, and the median step time (interleaved runs).
``--policies`` adds the alternatives ``quantize/decode_outliers.py`` was chosen against (in the Python
loop): the outliers through the INT8 weight's own codes, whole linears kept float where calibration saw large
outliers (``quantize/decode_outliers.outlier_linears``: the program's decode method before), and a fixed set of
calibrated channels through float rows in those linears or in every one (the program's decode method now,
``quantize/decode_outliers.hot_inputs``), and the input clamped at the prefill's clip with its residue
through a second dynamic INT8 GEMM or float rows (per token, without a topk); with the extra bytes each holds.
"""
import argparse
import json
import statistics
import time

import torch

from llmnpu_delegate import kernels as K, load_model
from llmnpu_delegate.families import family_of
from llmnpu_delegate.hf import extend_hf_cache
from llmnpu_delegate.prepare import default_calibration
from llmnpu_delegate.quantize import QuantConfig, quantize_weight
from llmnpu_delegate.quantize.decode_outliers import outlier_linears
from llmnpu_delegate.runtime.hf_decoder import DecodeCache, Int8Decoder, _Linear, _stack
from llmnpu_delegate.text import read_text, tokenize

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--outliers", type=int, nargs="+", default=[0, 2, 4, 8, 16])
ap.add_argument("--windows", type=int, default=3)
ap.add_argument("--policies", action="store_true")
args = ap.parse_args()


def linears(dec):
    return [lin for b in dec.blocks for lin in (b.qkv, b.o, b.gate_up, b.down)] + [dec.lm_head]


def extra_bytes(dec) -> int:
    """Bytes beyond the INT8 weights: outlier rows (INT8 codes' rows as they would be stored: 1 byte),
    and float weights kept."""
    def size(lin):
        if lin.kind == "fp32":
            return lin.weight.numel() * 4
        if lin.rows is None:
            return 0
        return lin.rows.numel() * (1 if getattr(lin, "int8_rows", False) else lin.rows.element_size())
    return sum(size(lin) for lin in linears(dec))


def per_linear(dec, model):
    """(the decoder's linear, its attribute, its owner, its float modules, their names) for every linear."""
    family = family_of(model.config)
    for b, blk in zip(dec.blocks, model.model.layers):
        for attr, names in (("qkv", family.qkv), ("o", [family.o]), ("gate_up", family.gate_up), ("down", [family.down])):
            yield getattr(b, attr), attr, b, [blk.get_submodule(n) for n in names], names
    yield dec.lm_head, "lm_head", dec, [model.lm_head], ["lm_head"]


def int8_rows(dec, model):
    for lin, _, _, mods, _ in per_linear(dec, model):
        if lin.rows is not None:      # the outliers through the INT8 weight's own codes (held as their values)
            w_q, w_scale = quantize_weight(_stack(mods)[0], "channel")
            lin.rows = (w_q.float() * w_scale[:, None]).t().contiguous()
            lin.int8_rows = True
    return dec


def kept_float(dec, model):
    keep = set(outlier_linears(default_calibration(lm, False), QuantConfig().clip_percentile))
    for i, (lin, attr, owner, mods, names) in enumerate(per_linear(dec, model)):
        if attr != "lm_head" and any(f"model.layers.{i // 4}.{n}" in keep for n in names):
            setattr(owner, attr, _Linear(*_stack(mods), "fp32"))
    return dec


class _StaticHot(_Linear):
    """The ``hot`` input channels calibration saw largest, fixed for every token, through float rows; the
    rest through the dynamic INT8 GEMM (a form a program's decode method could hold: no per-token topk)."""

    def __init__(self, w, b, hot):
        super().__init__(w, b, "int8", outliers=0)
        self.hot, self.hot_rows = hot, w.t()[hot].float().contiguous()
        self.rows = self.hot_rows

    def __call__(self, x):
        y = K.dynamic_linear(x.index_fill(1, self.hot, 0.0), self.packed)
        return y.addmm_(x.index_select(1, self.hot), self.hot_rows)


def static_hot(dec, model, count: int, only_kept: bool):
    """Every INT8 linear but o_proj (or only the program's kept-float ones) with ``count`` calibrated
    channels (largest input maximum on the calibration text) through float rows."""
    calib = default_calibration(lm, False)
    keep = set(outlier_linears(calib, QuantConfig().clip_percentile))
    for i, (lin, attr, owner, mods, names) in enumerate(per_linear(dec, model)):
        full = [f"model.layers.{i // 4}.{n}" for n in names]
        if attr in ("lm_head", "o") or (only_kept and not any(f in keep for f in full)):
            continue
        hot = calib.layers[full[0]].channel_absmax.topk(count).indices.sort().values
        setattr(owner, attr, _StaticHot(*_stack(mods), hot))
    return dec


class _ClampResidue(_Linear):
    """Per token without a topk: the input clamped at the linear's calibrated clip through the dynamic
    INT8 GEMM, and the residue (zero but where the token crossed the clip) through a second dynamic INT8
    GEMM on the same INT8 weights (``residue="int8"``) or through float W^T (``"fp32"``, the ceiling)."""

    def __init__(self, w, b, clip, residue):
        super().__init__(w, b, "int8", outliers=0)
        self.clip, self.residue = clip, residue
        w_q, w_scale = quantize_weight(w, "channel")
        self.bare = K.prepack_dynamic(w_q, w_scale, None)
        self.rows = w.t().float().contiguous() if residue == "fp32" else None

    def __call__(self, x):
        clipped = x.clamp(-self.clip, self.clip)
        y = K.dynamic_linear(clipped, self.packed)
        r = x - clipped
        if not bool(r.any()):
            return y
        return y.addmm_(r, self.rows) if self.residue == "fp32" else y.add_(K.dynamic_linear(r, self.bare))


def clamp_residue(dec, model, residue: str):
    calib = default_calibration(lm, False)
    p = QuantConfig().clip_percentile
    for i, (lin, attr, owner, mods, names) in enumerate(per_linear(dec, model)):
        if attr in ("lm_head", "o"):
            continue
        clip = calib.threshold(f"model.layers.{i // 4}.{names[0]}", p)
        setattr(owner, attr, _ClampResidue(*_stack(mods), clip, residue))
    return dec


lm = load_model(args.model)
model = lm.model
text = tokenize(lm, read_text(None, "calib"))
decoders = {k: Int8Decoder(model, "int8", outliers=k) for k in args.outliers}
decoders["bf16"] = Int8Decoder(model, "bf16")
if args.policies:
    decoders["16, INT8 weight rows"] = int8_rows(Int8Decoder(model, "int8", native=False), model)
    decoders["calibrated linears kept float"] = kept_float(Int8Decoder(model, "int8", outliers=0, native=False), model)
    for count in (4, 16):
        decoders[f"{count} calibrated channels, float rows, kept-float linears only"] = static_hot(
            Int8Decoder(model, "int8", outliers=0, native=False), model, count, True)
        decoders[f"{count} calibrated channels, float rows, every linear"] = static_hot(
            Int8Decoder(model, "int8", outliers=0, native=False), model, count, False)
if args.policies:
    for residue in ("int8", "fp32"):
        decoders[f"clamped at the clip, residue through {residue}"] = clamp_residue(
            Int8Decoder(model, "int8", outliers=0, native=False), model, residue)
stats = {k: {"same": 0, "steps": 0, "err": 0.0, "ref": 0.0, "times": []} for k in decoders}
with torch.inference_mode():
    for w in range(args.windows):
        start = 4000 + 4000 * w
        ids = text[None, start:start + 300]
        out = model(ids[:, :200], use_cache=True)
        past_k = [layer.keys for layer in out.past_key_values.layers]
        past_v = [layer.values for layer in out.past_key_values.layers]
        ref = model(ids[:, 200:], past_key_values=out.past_key_values).logits[0]

        class Prefill:   # what extend_hf_cache reads
            pass
        pre = Prefill()
        pre.past_k, pre.past_v = past_k, past_v
        for k, dec in decoders.items():
            cache = DecodeCache(model.config, 310)
            extend_hf_cache(cache, pre)
            rows = []
            for i in range(100):
                t = time.perf_counter()
                rows.append(dec.step(ids[:, 200 + i:201 + i], cache)[0])
                stats[k]["times"].append(time.perf_counter() - t)
            got = torch.stack(rows)
            stats[k]["same"] += int((got.argmax(-1) == ref.argmax(-1)).sum())
            stats[k]["steps"] += 100
            stats[k]["err"] += float((got - ref).pow(2).sum())
            stats[k]["ref"] += float(ref.pow(2).sum())
for k, s in stats.items():
    print(json.dumps({"outliers": k, "agreement": round(s["same"] / s["steps"], 3),
                      "sqnr_db": round(10 * torch.log10(torch.tensor(s["ref"] / s["err"])).item(), 1),
                      "step_ms": round(1e3 * statistics.median(s["times"]), 2),
                      "extra_mib": None if k == "bf16" else round(extra_bytes(decoders[k]) / 2**20, 1)}))
