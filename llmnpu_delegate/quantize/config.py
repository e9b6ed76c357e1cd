"""Typed, versioned configs of the preparation stage. Both round-trip through plain dicts (JSON)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ..errors import LlmNpuError

OUTLIER_MODES = ("none", "smooth", "shadow")
WEIGHT_GRANULARITIES = ("channel", "tensor")
IMPORTANCE_MEASURES = ("output", "ratio")


def _from_dict(cls, d: dict):
    names = {f.name for f in fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise LlmNpuError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return cls(**kw)


@dataclass(frozen=True)
class CalibConfig:
    """How calibration samples the float model.

    Args:
        samples: number of calibration sequences.
        tokens: tokens per sequence.
        percentiles: percentiles of |x| recorded per linear input; the clipping threshold is one of them.
        probe_tokens: calibration tokens on which each layer's output effect is measured (pruning
            ranking): the first ceil(probe_tokens / tokens) samples, each cut to min(tokens, probe_tokens).
    """
    samples: int = 8
    tokens: int = 512
    percentiles: tuple[float, ...] = (99.0, 99.5, 99.9, 99.99)
    probe_tokens: int = 128
    version: int = 1

    def __post_init__(self):
        if self.samples < 1 or self.tokens < 2:
            raise LlmNpuError(f"calibration needs samples >= 1 and tokens >= 2, got {self.samples} x {self.tokens}")
        if not self.percentiles or not all(90.0 <= p < 100.0 for p in self.percentiles):
            raise LlmNpuError(f"calibration percentiles must lie in [90, 100), got {self.percentiles}")
        if not 1 <= self.probe_tokens:
            raise LlmNpuError("probe_tokens must be positive")

    to_dict = asdict

    @classmethod
    def from_dict(cls, d: dict) -> "CalibConfig":
        return _from_dict(cls, d)


@dataclass(frozen=True)
class QuantConfig:
    """W8A8 for the NPU: static per-tensor INT8 activations, symmetric INT8 weights.

    Args:
        outliers: "none" (scale from the absolute maximum), "smooth" (SmoothQuant migration, then
            absolute maximum) or "shadow" (clip at a percentile; the float shadow path adds the rest).
        weights: "channel" (one scale per output channel, default) or "tensor" (the paper's choice).
        clip_percentile: percentile of |x| used as the clipping threshold in "shadow" mode.
        pruning_rate: share of linear layers whose shadow path is removed ("shadow" mode); a
            pruned layer quantizes with its full-range scale, so nothing is silently clipped.
            "auto" (default): the paths whose time reaches the critical path of the prefill on
            ``pruning_target``, most time per unit of accuracy first, within ``pruning_budget``
            (``quantize/auto.py``).
        pruning_budget: for "auto", how much pruning may add to the quantized model's KL divergence
            from the float model on held-apart calibration text, as a share of that divergence with
            every shadow path (1.0: at most double it).
        pruning_target: for "auto", whose prefill the shadow paths are priced on: "host" (this
            machine's engine, profiled) or a phone SoC's device model (e.g. "SM8650"), for a
            program of the paper's placement or of the one named after a colon ("SM8750:block",
            ``partitioner/placement.py``): what a shadow path costs depends on where its merge runs.
        shadow_share: for "auto", how much longer the kept shadow paths may make the predicted
            prefill than none at all (0.01: 1 %).
        importance: how layers are ranked for pruning: "output" (measured effect of removing the
            layer's shadow path on the model's output distribution) or "ratio" (the paper's
            largest outlier / quantization scale).
        hot_coverage: the hot channels kept in RAM cover this share of calibration outliers.
        smooth_alpha: SmoothQuant migration strength.
    """
    outliers: str = "shadow"
    weights: str = "channel"
    clip_percentile: float = 99.5
    pruning_rate: float | str = "auto"
    pruning_budget: float = 1.0
    pruning_target: str = "host"
    shadow_share: float = 0.01
    importance: str = "output"
    hot_coverage: float = 0.8
    smooth_alpha: float = 0.5
    version: int = 1

    def __post_init__(self):
        if self.outliers not in OUTLIER_MODES:
            raise LlmNpuError(f"outliers must be one of {OUTLIER_MODES}, got '{self.outliers}'")
        if self.weights not in WEIGHT_GRANULARITIES:
            raise LlmNpuError(f"weights must be one of {WEIGHT_GRANULARITIES}, got '{self.weights}'")
        if self.importance not in IMPORTANCE_MEASURES:
            raise LlmNpuError(f"importance must be one of {IMPORTANCE_MEASURES}, got '{self.importance}'")
        if self.pruning_rate != "auto" and not (isinstance(self.pruning_rate, (int, float))
                                                and 0.0 <= self.pruning_rate <= 1.0):
            raise LlmNpuError(f"pruning_rate must be 'auto' or lie in [0, 1], got {self.pruning_rate!r}")
        if not (isinstance(self.pruning_budget, (int, float)) and 0.0 <= self.pruning_budget <= 100.0):
            raise LlmNpuError(f"pruning_budget must lie in [0, 100] (a share of the unpruned divergence), "
                              f"got {self.pruning_budget!r}")
        if not isinstance(self.pruning_target, str) or not self.pruning_target or "/" in self.pruning_target:
            raise LlmNpuError(f"pruning_target must be 'host' or a SoC name, got {self.pruning_target!r}")
        if not 0.0 <= self.shadow_share < 1.0:
            raise LlmNpuError(f"shadow_share must lie in [0, 1), got {self.shadow_share}")
        if not 0.0 <= self.hot_coverage <= 1.0:
            raise LlmNpuError(f"hot_coverage must lie in [0, 1], got {self.hot_coverage}")
        if not 0.0 < self.smooth_alpha < 1.0:
            raise LlmNpuError(f"smooth_alpha must lie in (0, 1), got {self.smooth_alpha}")

    @property
    def prunes(self) -> bool:
        return self.outliers == "shadow" and (self.pruning_rate == "auto" or self.pruning_rate > 0)

    to_dict = asdict

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        return _from_dict(cls, d)


# Named quantization modes (the engine's, the eval harness's and the CLI's names); a QuantConfig works too.
QUANT_MODES: dict[str, QuantConfig | None] = {
    "fp32": None,
    "w8a8": QuantConfig(outliers="none"),
    "w8a8-shadow": QuantConfig(outliers="shadow"),
}


def resolve_quant(quant) -> QuantConfig | None:
    """A named mode's config (None for the float reference), or ``quant`` itself if it is a QuantConfig."""
    if quant is None or isinstance(quant, QuantConfig):
        return quant
    if quant not in QUANT_MODES:
        raise LlmNpuError(f"unknown quantization '{quant}': use one of {', '.join(QUANT_MODES)} or a QuantConfig")
    return QUANT_MODES[quant]


def quant_config(quant: QuantConfig | str | None, pruning_rate: float | None = None,
                 clip_percentile: float | None = None) -> QuantConfig | None:
    """A named mode (``w8a8-shadow``, ``w8a8``, ``fp32``) or a QuantConfig, with the shadow knobs applied."""
    config = resolve_quant(quant)
    knobs = {k: v for k, v in (("pruning_rate", pruning_rate), ("clip_percentile", clip_percentile)) if v is not None}
    if not knobs:
        return config
    if config is None or config.outliers != "shadow":
        raise LlmNpuError(f"{', '.join(knobs)} only apply to the shadow outlier mode (quant='w8a8-shadow')")
    return replace(config, **knobs)
