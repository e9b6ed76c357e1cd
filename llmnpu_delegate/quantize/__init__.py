"""Preparation stage: calibrate the float model, then ``quantize_`` it to W8A8 with shadow outliers."""
from .apply import LinearPlan, QuantReport, outlier_counters, plan_linears, pruned_set, quantize_  # noqa: F401
from .auto import ShadowCost  # noqa: F401
from .calibrate import (  # noqa: F401
    Calibration,
    LayerStats,
    calibrate,
    load_or_calibrate,
    quantizable_linears,
)
from .config import QUANT_MODES, CalibConfig, QuantConfig, quant_config, resolve_quant  # noqa: F401
from .linear import QuantLinear, quantize_weight  # noqa: F401
