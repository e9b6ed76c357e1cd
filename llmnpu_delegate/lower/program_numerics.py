"""An exported program's numerics on a quantized copy of the float model (``llmnpu eval --modes qnn``).

The engine's NPU regions return float outputs; an integer NPU program does not. What a program with
8-bit outputs (``qnn``; ``cpu-int8 --output-bits 8`` has the same encodings on XNNPACK) computes, as
its sidecar writes it, applied to a model quantized by ``quantize_`` with the program's config:

- each decoder linear's integer product is requantized to its output encoding (8 bits; 16 for the
  residual writers of a ``--residual-bits 16`` program) before the CPU adds the shadow path: the main encoding, the split channel groups' own, and a part's second, finer
  encoding taken where its value is inside that range (``FineOutput.take``, as both runners merge);
- a norm reader's shadow product that the program's norm graph computes (placement piece ``peak``,
  ``norm_region.PeakBranch``) on its grids as written, in place of the CPU's (``PeakOnGrid``);
- a norm the program runs on the NPU (``norm_region.py``; a q/k norm in ``attention_region.py``) at its
  16-bit encodings as written
  (``norm_encodings``; the caller swaps them in, ``placed_numerics.swap_norms``);
- attention the program runs on the NPU (``attention_region.py``) at its 16-bit encodings as written
  (``attention_encodings``; ``placed_numerics.swap_attention``);
- the LM head is the dynamic INT8 linear (each row quantized over its own range, ``int8`` decode
  programs); the embedding lookups read the float16 table (``embedding_head.TABLE_DTYPE``).

Left out: the HTP's own rounding of a requantization and of a norm's result (the simulator's outputs
are within a step of these), RoPE's 16-bit products, and HTP's softmax, its own approximation (the
attention's outputs a few steps of its grid off: ``tests/test_qnn.py``). The decoder's shapes are the model's, so every position of a
window is scored, which the program (one answer row per prefill) does not return.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import LlmNpuError
from ..format.npu_io import FineOutput, part_channels
from ..format.sidecar import ATTENTION_REGION, NORM_REGION
from ..kernels.npu_attention import AttentionEncodings, Encoding
from ..kernels.npu_norm import NormEncodings
from ..kernels.ops import quantize_weight
from ..quantize.linear import QuantLinear
from .embedding_head import TABLE_DTYPE

MODE = "qnn"
# programs whose NPU outputs carry 8-bit encodings: the ones this mode reproduces
TARGETS = ("qnn", "cpu-int8")


class OutputEncodings:
    """One linear's output encodings (sidecar ``linears[name]``, 8 or 16 bits) as a function of its product."""

    def __init__(self, linear: dict, width: int):
        splits = linear["split_channels"]

        def channels(part: int) -> Tensor:
            return torch.tensor(part_channels(width, splits, part), dtype=torch.long)
        self.parts = [(channels(p), enc) for p, enc in enumerate([linear["output"], *linear["split_outputs"]])]
        self.fine = [(channels(f["part"]), FineOutput(0, f["part"], f["scale"], *f["range"]))
                     for f in linear["fine_outputs"]]

    @staticmethod
    def _grid(y: Tensor, scale: float, low: float, high: float) -> Tensor:
        # round(y / s) + z clamped to the codes, back to float: the encoding's zero point is an
        # integer, so this is y's nearest grid point inside [low, high]
        return torch.clamp(torch.round(y / scale) * scale, low, high)

    def __call__(self, y: Tensor) -> Tensor:
        out = torch.empty_like(y)
        for index, enc in self.parts:
            out[:, index] = self._grid(y[:, index], enc["scale"], *enc["range"])
        for index, f in self.fine:
            out[:, index] = f.take(out[:, index], self._grid(y[:, index], f.scale, f.low, f.high))
        return out


class PeakOnGrid(nn.Module):
    """A linear's peak product as the program's norm graph computes it (sidecar ``linears[name]["peak"]``):
    the peak channels' values clamped to the clip on its 16-bit grid, the residues on theirs, times W's
    columns of them at 8 bits per output channel (``quantize_weight``, as the QNN quantizer's
    symmetric per-channel weights), the product on its grid."""

    def __init__(self, peak: dict, weight: Tensor):
        super().__init__()
        self.register_buffer("channels", torch.tensor(peak["channels"], dtype=torch.long))
        w_q, w_scale = quantize_weight(weight.detach().float()[:, self.channels], "channel")
        self.register_buffer("weight", w_q.float() * w_scale[:, None])
        self.clip = float(peak["clip"])
        self.clamped = Encoding.of_range(-self.clip, self.clip, 16)
        self.residue, self.out = Encoding(**peak["residue"]), Encoding(**peak["out"])

    def forward(self, x: Tensor) -> Tensor:
        picked = x[:, self.channels].float()
        residue = self.residue.round(picked - self.clamped.round(picked.clamp(-self.clip, self.clip)))
        return self.out.round(residue @ self.weight.T)


class DynamicInt8Head(nn.Module):
    """The program's LM head: INT8 weights per output channel, each row's activations quantized
    over its own range at run time (XNNPACK's dynamic INT8 linear: 255 steps over [min(x, 0),
    max(x, 0)] with an integer zero point), the integer product exact in float64 (its terms and
    sums stay far below 2^53), on every CPU alike."""

    def __init__(self, weight: Tensor):
        super().__init__()
        w_q, w_scale = quantize_weight(weight.detach().float(), "channel")
        self.out_features = weight.shape[0]
        self.register_buffer("weight_t", w_q.double().t().contiguous())
        self.register_buffer("weight_scale", w_scale.double())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).double()
        low, high = rows.amin(1, keepdim=True).clamp(max=0), rows.amax(1, keepdim=True).clamp(min=0)
        scale = torch.where(high > low, (high - low) / 255, torch.ones_like(high))
        zero = torch.round(-low / scale).clamp(0, 255)
        codes = torch.clamp(torch.round(rows / scale) + zero, 0, 255) - zero
        out = (codes @ self.weight_t) * scale * self.weight_scale
        return out.float().reshape(*x.shape[:-1], self.out_features)


def norm_encodings(meta: dict) -> dict[tuple[int, str], NormEncodings]:
    """The norms the program runs on the NPU (block norms, and q/k norms in attention regions),
    (layer, name) -> their encodings as written."""
    entries = [e["norm"] for e in meta["subgraphs"] if e.get("form") == NORM_REGION]
    entries += [n for e in meta["subgraphs"] if e.get("form") == ATTENTION_REGION
                for n in e["attention"].get("norms", {}).values()]
    return {(n["layer"], n["name"]): NormEncodings(*(Encoding(**n[k]) for k in ("x", "weight", "out"))) for n in entries}


def attention_encodings(meta: dict) -> dict[int, AttentionEncodings]:
    """The attention the program runs on the NPU, layer -> its encodings as written."""
    return {e["attention"]["layer"]: AttentionEncodings(**{k: Encoding(**v) for k, v in e["attention"]["encodings"].items()})
            for e in meta["subgraphs"] if e.get("form") == ATTENTION_REGION}


def check_program(meta: dict, path) -> None:
    """Refuse a program whose NPU outputs carry no 8-bit encodings, in one line (16-bit ones beside
    them, ``ExportConfig.residual_bits``, are computed the same way)."""
    bits = sorted({lin["output"]["bits"] for lin in meta["linears"].values()})
    if meta["target"] not in TARGETS or 8 not in bits or 32 in bits:
        raise LlmNpuError(f"{path} has {'/'.join(map(str, bits))}-bit NPU outputs ({meta['target']}): the "
                          f"{MODE} mode needs a program with 8-bit outputs (llmnpu export --backend qnn, or "
                          f"--backend cpu-int8 --output-bits 8)")


def program_quant(meta: dict):
    """The QuantConfig to quantize the model with before ``apply_program_numerics``: the program's,
    every shadow path kept (the program's own pruned layers are then pruned by name, whatever this
    machine's automatic choice would be)."""
    from dataclasses import replace

    from ..quantize import QuantConfig

    config = QuantConfig.from_dict(meta["quant"])
    return replace(config, pruning_rate=0.0) if config.outliers == "shadow" else config


def apply_program_numerics(model: nn.Module, meta: dict, source: nn.Module) -> dict:
    """Make ``model`` (quantized by ``quantize_`` with ``program_quant(meta)`` and the program's
    calibration from ``source``, the float model) compute what the program ``meta`` (its sidecar)
    computes. Returns counts."""
    quant = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    missing = sorted(set(meta["linears"]) - set(quant))
    if missing:
        raise LlmNpuError(f"the program quantizes {missing[0]}, which this model does not: it was exported "
                          f"from another model")
    pruned, fine, peaks = set(meta["pruned_layers"]), 0, 0
    for name, lin in meta["linears"].items():
        q = quant[name]
        if name in pruned:
            q.pruned, q.shadow = True, None
        scale = q.full_scale if q.pruned else q.act_scale
        if abs(scale - lin["act_scale"]) > 1e-6 * lin["act_scale"]:
            raise LlmNpuError(f"{name}'s activation scale differs from the program's: it was exported with another "
                              f"calibration or quantization config; evaluate with the same ones or export again")
        q.output_stage = OutputEncodings(lin, q.out_features)
        if "peak" in lin:
            q.npu_shadow = PeakOnGrid(lin["peak"], source.get_submodule(name).weight)
            peaks += 1
        fine += len(lin["fine_outputs"])
    if meta["decode"]["mode"] == "int8":
        head, table = model.get_output_embeddings(), model.get_input_embeddings()
        model.set_output_embeddings(DynamicInt8Head(head.weight))
        # the float16 table, untied from the head, whose INT8 weight came from the float one above
        table.weight = nn.Parameter(table.weight.detach().to(TABLE_DTYPE).float(), requires_grad=False)
    return {"linears": len(meta["linears"]), "pruned": len(pruned), "fine_outputs": fine, "peak_products": peaks,
            "head": meta["decode"]["mode"]}
