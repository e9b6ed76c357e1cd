"""Calibration: run the float model over text and record the statistics of every linear input.

For the input of each linear inside the decoder blocks we keep the absolute maximum, high
percentiles of |x| (exact, from the top 1 % of values), per-channel absolute maxima (SmoothQuant)
and per-channel counts of values beyond each percentile threshold (hot channels). The result is a
versioned artefact tied to the model's fingerprint; later runs load it instead of recomputing.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import LlmNpuError
from ..models import decoder_layers
from ..paths import DamagedFile, cache_dir, exclusive, load_checked, save_checked
from .config import CalibConfig

CALIB_VERSION = 3     # of the cached calibration's layout; another is calibrated again (CHANGELOG.md: what changed)
KIND = "calibration"
log = logging.getLogger(__name__)


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
    """The calibration artefact. ``importance`` caches per-layer pruning rankings by key, ``pruning``
    the automatic pruning choices by key (``quantize/auto.py``), ``placement`` the host's automatic
    placement choices by key (``runtime/engine.py``: they follow the pruning made with this artefact)."""
    model_fingerprint: str
    config: CalibConfig
    text_sha: str
    layers: dict[str, LayerStats]
    probe_ids: Tensor                        # [n, L] token ids for output-effect profiling
    importance: dict[str, dict[str, float]] = field(default_factory=dict)
    # [n, L] windows of the calibration text that no calibration sample touches: the automatic pruning
    # rate is checked on them (quantize/auto.py)
    held_ids: Tensor | None = None
    pruning: dict[str, dict] = field(default_factory=dict)
    version: int = CALIB_VERSION
    placement: dict[str, dict] = field(default_factory=dict)
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

    def check_linears(self, linears: dict[str, nn.Linear]) -> None:
        """Statistics for every linear, with its input width (a fingerprint match implies it for a
        well-formed artefact; this names the damage when one is not)."""
        missing = sorted(set(linears) - set(self.layers))
        wrong = sorted(n for n, lin in linears.items() if n in self.layers
                       and self.layers[n].channel_absmax.numel() != lin.in_features)
        if missing or wrong:
            raise LlmNpuError(f"calibration artefact {self.path or ''} lacks statistics for {', '.join((missing + wrong)[:3])}"
                              f"{' ...' if len(missing) + len(wrong) > 3 else ''}: delete it and recalibrate")

    def save(self, path: Path | None = None) -> Path:
        path = Path(path or self.path)
        payload = {"version": self.version, "model_fingerprint": self.model_fingerprint,
                   "config": self.config.to_dict(), "text_sha": self.text_sha,
                   "layers": {n: s.to_dict() for n, s in self.layers.items()},
                   "probe_ids": self.probe_ids, "importance": self.importance, "held_ids": self.held_ids,
                   "pruning": self.pruning, "placement": self.placement}
        save_checked(payload, path, KIND)
        self.path = path
        return path

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        """The artefact at ``path``; a missing, damaged, altered or malformed file is a one-line error."""
        path = Path(path)
        if not path.is_file():
            raise LlmNpuError(f"calibration artefact not found: {path}: run `llmnpu calibrate` first")
        try:
            d = load_checked(path, KIND)
        except (OSError, DamagedFile) as e:
            raise LlmNpuError(f"calibration artefact {path} is corrupt ({e}): delete it and recalibrate") from None
        version = d.get("version") if isinstance(d, dict) else None
        if type(version) is not int or version != CALIB_VERSION:
            raise LlmNpuError(f"calibration artefact {path} has format version {version}, this release reads "
                              f"{CALIB_VERSION}: delete it and recalibrate")
        try:
            return cls._from_payload(d, path)
        # RuntimeError: a tensor where a number belongs (its truth value is ambiguous)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, LlmNpuError) as e:
            raise LlmNpuError(f"calibration artefact {path} is malformed ({type(e).__name__}: {e}): delete it and "
                              f"recalibrate") from None

    @classmethod
    def _from_payload(cls, d: dict, path: Path) -> "Calibration":
        config = CalibConfig.from_dict(_typed(d["config"], dict, "config"))
        wanted = set(config.percentiles)
        layers = {}
        for name, s in _typed(d["layers"], dict, "layers").items():
            stats = LayerStats(**_typed(s, dict, name))
            if _typed(stats.absmax, float, f"{name}.absmax") < 0 or _typed(stats.elements, int, f"{name}.elements") <= 0:
                raise ValueError(f"{name}: negative maximum or no elements")
            k = _typed(stats.channel_absmax, Tensor, f"{name}.channel_absmax").numel()
            if set(_typed(stats.percentiles, dict, f"{name}.percentiles")) != wanted or \
                    set(_typed(stats.channel_outliers, dict, f"{name}.channel_outliers")) != wanted:
                raise ValueError(f"{name}: percentiles are not the configured {sorted(wanted)}")
            for p, value in stats.percentiles.items():
                _typed(value, float, f"{name}.percentiles[{p}]")
            for p, counts in stats.channel_outliers.items():
                if not isinstance(counts, Tensor) or counts.shape != (k,):
                    raise TypeError(f"{name}.channel_outliers[{p}] is not a [{k}] tensor")
            layers[name] = stats
        probe = _typed(d["probe_ids"], Tensor, "probe_ids")
        if probe.dim() != 2 or probe.dtype != torch.int64:
            raise TypeError("probe_ids is not a [n, L] int64 tensor")
        importance = {key: {n: _typed(v, float, f"importance[{key}]") for n, v in _typed(table, dict, key).items()}
                      for key, table in _typed(d["importance"], dict, "importance").items()}
        held = d["held_ids"]
        if held is not None and (not isinstance(held, Tensor) or held.dim() != 2 or held.dtype != torch.int64):
            raise TypeError("held_ids is not a [n, L] int64 tensor")
        pruning = {key: _choice(choice, f"pruning[{key}]")
                   for key, choice in _typed(d.get("pruning", {}), dict, "pruning").items()}
        placement = {key: _placement_choice(choice, f"placement[{key}]")
                     for key, choice in _typed(d.get("placement", {}), dict, "placement").items()}
        return cls(_typed(d["model_fingerprint"], str, "model_fingerprint"), config,
                   _typed(d["text_sha"], str, "text_sha"), layers, probe, importance, held, pruning, d["version"],
                   placement=placement, path=path)


def _choice(choice, what: str) -> dict:
    """An automatic pruning choice: its target, the layers it prunes, and numbers."""
    _typed(choice, dict, what)
    for k, v in choice.items():
        if k == "target":
            _typed(v, str, f"{what}.target")
        elif k == "pruned":
            if not all(isinstance(n, str) for n in _typed(v, list, f"{what}.pruned")):
                raise TypeError(f"{what}.pruned is not a list of layer names")
        else:
            _typed(v, float, f"{what}.{k}")
    if "pruned" not in choice or "rate" not in choice:
        raise TypeError(f"{what} has no pruned layers or rate")
    return choice


def _placement_choice(choice, what: str) -> dict:
    """An automatic placement choice: the placement and each candidate's timed prefill seconds."""
    _typed(_typed(choice, dict, what).get("placement"), str, f"{what}.placement")
    for name, seconds in _typed(choice.get("prefill_s"), dict, f"{what}.prefill_s").items():
        _typed(seconds, float, f"{what}.prefill_s[{name}]")
    return choice


def _typed(value, kind, what: str):
    """``value`` when it is a ``kind`` (an int counts as a float, a bool as neither), else TypeError naming ``what``."""
    kinds, name = ((int, float), "number") if kind is float else (kind, kind.__name__)
    if not isinstance(value, kinds) or (isinstance(value, bool) and kind is not bool):
        raise TypeError(f"{what} is a {type(value).__name__}, not a {name}")
    return value


def default_calibration_path(fingerprint: str, text_sha: str, config: CalibConfig) -> Path:
    tag = hashlib.sha256(repr(sorted(config.to_dict().items())).encode()).hexdigest()[:8]
    return cache_dir() / "calibration" / f"{fingerprint}-{text_sha[:12]}-{tag}.pt"


def text_sha(ids: Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()


HELD_WINDOWS, HELD_TOKENS = 4, 256


def held_apart_windows(ids: Tensor, config: CalibConfig) -> Tensor | None:
    """Up to ``HELD_WINDOWS`` windows of ``HELD_TOKENS`` from the middle of the gaps between
    calibration samples (``calibration_samples``): text of the same kind that calibration never saw.
    None when the samples leave no such gap."""
    stride = (ids.numel() - config.tokens) // max(config.samples - 1, 1)
    gap = stride - config.tokens
    if config.samples < 2 or gap < HELD_TOKENS:
        return None
    starts = [i * stride + config.tokens + (gap - HELD_TOKENS) // 2 for i in range(config.samples - 1)]
    step = max(len(starts) // HELD_WINDOWS, 1)
    return torch.stack([ids[s: s + HELD_TOKENS] for s in starts[::step][:HELD_WINDOWS]])


def calibration_samples(ids: Tensor, config: CalibConfig) -> Tensor:
    """[samples, tokens] windows spread evenly over the token stream ``ids`` [T]."""
    need = config.samples * config.tokens
    if ids.numel() < need:
        raise LlmNpuError(f"calibration text has {ids.numel()} tokens, {config.samples} samples x "
                          f"{config.tokens} tokens need {need}: give a longer text or fewer/shorter samples")
    stride = (ids.numel() - config.tokens) // max(config.samples - 1, 1)
    return torch.stack([ids[i * stride: i * stride + config.tokens] for i in range(config.samples)])


class _Recorder:
    """Forward-pre-hooks that fold each linear input into its statistics in one pass. The largest
    |x| are kept with their channels, enough to read the lowest requested percentile exactly; every
    value beyond a higher percentile is then among them too, so the per-channel counts come from the
    kept values without running the text a second time."""

    def __init__(self, linears: dict[str, nn.Linear], total_tokens: int, config: CalibConfig):
        self.linears, self.config = linears, config
        self.total_tokens = total_tokens
        self.absmax = {n: torch.zeros(()) for n in linears}
        self.channel_absmax = {n: torch.zeros(m.in_features) for n, m in linears.items()}
        self.top = {n: torch.empty(0) for n in linears}
        self.top_channels = {n: torch.empty(0, dtype=torch.int64) for n in linears}
        self.elements = {n: 0 for n in linears}

    def _keep(self, name: str) -> int:
        total = self.total_tokens * self.linears[name].in_features
        return min(total, math.ceil(total * (1 - min(self.config.percentiles) / 100)) + 2)

    def hook(self, name: str):
        keep = self._keep(name)

        def hook(_mod, args):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).float().abs()
            self.absmax[name] = torch.maximum(self.absmax[name], a.max())
            torch.maximum(self.channel_absmax[name], a.amax(0), out=self.channel_absmax[name])
            self.elements[name] += a.numel()
            flat, top = a.flatten(), self.top[name]
            # once ``keep`` values are held, one below the smallest of them can never enter
            index = (flat >= top.min()).nonzero().squeeze(1) if top.numel() == keep else None
            values = flat if index is None else flat[index]
            channels = (torch.arange(flat.numel()) if index is None else index) % a.shape[1]
            values, channels = torch.cat([top, values]), torch.cat([self.top_channels[name], channels])
            if values.numel() > keep:
                values, order = values.topk(keep, sorted=False)
                channels = channels[order]
            self.top[name], self.top_channels[name] = values, channels
        return hook

    def stats(self) -> dict[str, LayerStats]:
        out = {}
        for n, lin in self.linears.items():
            top, order = self.top[n].sort(descending=True)
            channels, total = self.top_channels[n][order], self.elements[n]
            percentiles, counts = {}, {}
            for p in self.config.percentiles:
                t = top[min(int(total * (1 - p / 100)), top.numel() - 1)]
                percentiles[p] = float(t)
                counts[p] = torch.bincount(channels[top > t], minlength=lin.in_features)
            out[n] = LayerStats(absmax=float(self.absmax[n]), percentiles=percentiles,
                                channel_absmax=self.channel_absmax[n].clone(), channel_outliers=counts,
                                elements=total)
        return out


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
    bar = tqdm(total=len(samples), desc="calibrating", unit="sample", disable=not progress)
    hooks = [m.register_forward_pre_hook(rec.hook(n)) for n, m in linears.items()]
    try:
        for row in samples:
            _run_blocks(model, row[None])
            bar.update()
    finally:
        for h in hooks:
            h.remove()
    bar.close()
    # The probe: the first calibration sequences, n x L = probe_tokens (L <= tokens per sample).
    length = min(config.tokens, config.probe_tokens)
    probe = samples[: min(len(samples), math.ceil(config.probe_tokens / length)), :length].clone()
    return Calibration(fingerprint, config, text_sha(ids), rec.stats(), probe,
                       held_ids=held_apart_windows(ids, config))


def load_or_calibrate(model: nn.Module, ids: Tensor, fingerprint: str, config: CalibConfig = CalibConfig(),
                      path: Path | None = None, progress: bool = True) -> Calibration:
    """Reuse the artefact for (model, text, config) if it exists, else calibrate and save it. A
    damaged artefact in the cache is recalibrated (with a warning); one at a path you gave is an error."""
    cached = path is None
    path = Path(path) if path else default_calibration_path(fingerprint, text_sha(ids), config)
    # Two processes starting on one model (two commands, two test workers) calibrate it once: the
    # later one waits for the artefact and loads it.
    with exclusive(path) if cached else contextlib.nullcontext():
        if path.exists():
            try:
                calib = Calibration.load(path)
                calib.check_model(fingerprint)
                return calib
            except LlmNpuError as e:
                if not cached:
                    raise
                log.warning("%s: recalibrating", e)
        calib = calibrate(model, ids, fingerprint, config, progress)
        calib.save(path)
        return calib
