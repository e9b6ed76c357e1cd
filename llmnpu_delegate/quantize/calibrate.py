"""Calibration: run the float model over text and record the statistics of every linear input.

For the input of each linear inside the decoder blocks we keep the absolute maximum, high
percentiles of |x| (exact, from the top 1 % of values), per-channel absolute maxima (SmoothQuant)
and per-channel counts of values beyond each percentile threshold (hot channels). The result is a
versioned artefact tied to the model's fingerprint; later runs load it instead of recomputing.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import LlmNpuError
from ..models import decoder_layers
from ..paths import atomic_path, cache_dir
from .config import CalibConfig

CALIB_VERSION = 1


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear inside the decoder blocks (q/k/v/o, gate/up/down or the family's fused ones),
    by its qualified name. Embedding and lm_head are outside the blocks and stay float."""
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    return {f"{prefix}.{n}": m for n, m in layers.named_modules() if isinstance(m, nn.Linear)}


@dataclass
class LayerStats:
    absmax: float
    percentiles: dict[float, float]          # p -> value of |x| at percentile p
    channel_absmax: Tensor                   # [K]
    channel_outliers: dict[float, Tensor]    # p -> [K] count of |x| > percentiles[p]
    elements: int

    def outlier_fraction(self, p: float) -> float:
        return float(self.channel_outliers[p].sum()) / self.elements

    def to_dict(self) -> dict:
        return {"absmax": self.absmax, "percentiles": dict(self.percentiles),
                "channel_absmax": self.channel_absmax, "channel_outliers": dict(self.channel_outliers),
                "elements": self.elements}


@dataclass
class Calibration:
    """The calibration artefact. ``importance`` caches per-layer pruning rankings by key."""
    model_fingerprint: str
    config: CalibConfig
    text_sha: str
    layers: dict[str, LayerStats]
    probe_ids: Tensor                        # [n, L] token ids for output-effect profiling
    importance: dict[str, dict[str, float]] = field(default_factory=dict)
    version: int = CALIB_VERSION
    path: Path | None = None                 # where it was loaded from / saved to

    def threshold(self, name: str, percentile: float) -> float:
        stats = self.layers[name]
        if percentile not in stats.percentiles:
            raise LlmNpuError(f"calibration has percentiles {sorted(stats.percentiles)}, not {percentile}: "
                              f"recalibrate with --calib-percentiles including it")
        return stats.percentiles[percentile]

    def check_model(self, fingerprint: str) -> None:
        if fingerprint != self.model_fingerprint:
            raise LlmNpuError(f"calibration artefact {self.path or ''} was made for another model "
                              f"(fingerprint {self.model_fingerprint}, this model {fingerprint}): recalibrate")

    def save(self, path: Path | None = None) -> Path:
        path = Path(path or self.path)
        payload = {"version": self.version, "model_fingerprint": self.model_fingerprint,
                   "config": self.config.to_dict(), "text_sha": self.text_sha,
                   "layers": {n: s.to_dict() for n, s in self.layers.items()},
                   "probe_ids": self.probe_ids, "importance": self.importance}
        with atomic_path(path) as tmp:
            torch.save(payload, tmp)
        self.path = path
        return path

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        path = Path(path)
        if not path.is_file():
            raise LlmNpuError(f"calibration artefact not found: {path}: run `llmnpu calibrate` first")
        try:
            d = torch.load(path, weights_only=True)
            version = d.get("version")
        except Exception as e:
            raise LlmNpuError(f"calibration artefact {path} is corrupt ({type(e).__name__}): delete it and recalibrate") from None
        if version != CALIB_VERSION:
            raise LlmNpuError(f"calibration artefact {path} has format version {version}, this release reads "
                              f"{CALIB_VERSION}: delete it and recalibrate")
        layers = {n: LayerStats(**s) for n, s in d["layers"].items()}
        return cls(d["model_fingerprint"], CalibConfig.from_dict(d["config"]), d["text_sha"], layers,
                   d["probe_ids"], d["importance"], version, path)


def default_calibration_path(fingerprint: str, text_sha: str, config: CalibConfig) -> Path:
    tag = hashlib.sha256(repr(sorted(config.to_dict().items())).encode()).hexdigest()[:8]
    return cache_dir() / "calibration" / f"{fingerprint}-{text_sha[:12]}-{tag}.pt"


def text_sha(ids: Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()


def calibration_samples(ids: Tensor, config: CalibConfig) -> Tensor:
    """[samples, tokens] windows spread evenly over the token stream ``ids`` [T]."""
    need = config.samples * config.tokens
    if ids.numel() < need:
        raise LlmNpuError(f"calibration text has {ids.numel()} tokens, {config.samples} samples x "
                          f"{config.tokens} tokens need {need}: give a longer text or fewer/shorter samples")
    stride = (ids.numel() - config.tokens) // max(config.samples - 1, 1)
    return torch.stack([ids[i * stride: i * stride + config.tokens] for i in range(config.samples)])


class _Recorder:
    """Forward-pre-hooks that fold each linear input into running statistics (two passes)."""

    def __init__(self, linears: dict[str, nn.Linear], total_tokens: int, config: CalibConfig):
        self.linears, self.config = linears, config
        self.total_tokens = total_tokens
        self.absmax = {n: torch.zeros(()) for n in linears}
        self.channel_absmax = {n: torch.zeros(m.in_features) for n, m in linears.items()}
        self.top: dict[str, Tensor] = {n: torch.empty(0) for n in linears}
        self.thresholds: dict[str, Tensor] = {}
        self.counts = {n: torch.zeros(len(config.percentiles), m.in_features, dtype=torch.int64)
                       for n, m in linears.items()}
        self.elements = {n: 0 for n in linears}

    def _keep(self, name: str) -> int:
        # Enough of the largest |x| to read the lowest requested percentile exactly.
        total = self.total_tokens * self.linears[name].in_features
        return min(total, math.ceil(total * (1 - min(self.config.percentiles) / 100)) + 2)

    def pass1(self, name: str):
        def hook(_mod, args):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).float().abs()
            self.absmax[name] = torch.maximum(self.absmax[name], a.max())
            torch.maximum(self.channel_absmax[name], a.amax(0), out=self.channel_absmax[name])
            pool = torch.cat([self.top[name], a.flatten()])
            self.top[name] = pool.topk(min(self._keep(name), pool.numel()), sorted=False).values
            self.elements[name] += a.numel()
        return hook

    def pass2(self, name: str):
        thr = self.thresholds[name]  # [P]
        def hook(_mod, args):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).float().abs()
            for i, t in enumerate(thr):
                self.counts[name][i] += (a > t).sum(0)
        return hook

    def finish_pass1(self) -> None:
        for name in self.linears:
            top = self.top[name].sort(descending=True).values
            total = self.elements[name]
            vals = []
            for p in self.config.percentiles:
                rank = min(int(total * (1 - p / 100)), top.numel() - 1)
                vals.append(top[rank])
            self.thresholds[name] = torch.stack(vals)
            self.top[name] = torch.empty(0)

    def stats(self) -> dict[str, LayerStats]:
        ps = self.config.percentiles
        return {n: LayerStats(absmax=float(self.absmax[n]),
                              percentiles={p: float(t) for p, t in zip(ps, self.thresholds[n])},
                              channel_absmax=self.channel_absmax[n].clone(),
                              channel_outliers={p: self.counts[n][i].clone() for i, p in enumerate(ps)},
                              elements=self.elements[n])
                for n in self.linears}


def _run_blocks(model: nn.Module, ids: Tensor) -> None:
    # The decoder stack only: the hooks sit inside it, and lm_head's logits would be thrown away.
    base = getattr(model, "model")
    base(input_ids=ids, use_cache=False)


@torch.inference_mode()
def calibrate(model: nn.Module, ids: Tensor, fingerprint: str, config: CalibConfig = CalibConfig(),
              progress: bool = True) -> Calibration:
    """Calibrate ``model`` on the token stream ``ids`` [T]; nothing is saved (see ``load_or_calibrate``)."""
    samples = calibration_samples(ids, config)
    linears = quantizable_linears(model)
    rec = _Recorder(linears, samples.numel(), config)
    bar = tqdm(total=2 * len(samples), desc="calibrating", unit="sample", disable=not progress)
    for pass_no in (1, 2):
        hooks = [m.register_forward_pre_hook(rec.pass1(n) if pass_no == 1 else rec.pass2(n))
                 for n, m in linears.items()]
        try:
            for row in samples:
                _run_blocks(model, row[None])
                bar.update()
        finally:
            for h in hooks:
                h.remove()
        if pass_no == 1:
            rec.finish_pass1()
    bar.close()
    # The probe: the first calibration sequences, n x L = probe_tokens (L <= tokens per sample).
    length = min(config.tokens, config.probe_tokens)
    probe = samples[: min(len(samples), math.ceil(config.probe_tokens / length)), :length].clone()
    return Calibration(fingerprint, config, text_sha(ids), rec.stats(), probe)


def load_or_calibrate(model: nn.Module, ids: Tensor, fingerprint: str, config: CalibConfig = CalibConfig(),
                      path: Path | None = None, progress: bool = True) -> Calibration:
    """Reuse the artefact for (model, text, config) if it exists, else calibrate and save it."""
    path = Path(path) if path else default_calibration_path(fingerprint, text_sha(ids), config)
    if path.exists():
        calib = Calibration.load(path)
        calib.check_model(fingerprint)
        return calib
    calib = calibrate(model, ids, fingerprint, config, progress)
    calib.save(path)
    return calib
