"""Deprecated: the engine is ``llmnpu_delegate.runtime.engine`` now, its preparation
``llmnpu_delegate.prepare``, the quantization modes ``llmnpu_delegate.quantize``. These re-exports go in 0.3."""
from .chunk_step import DEFAULT_CHUNK  # noqa: F401
from .prepare import default_calibration, partition_step, plan_and_partition  # noqa: F401
from .quantize import QUANT_MODES, quant_config, resolve_quant  # noqa: F401
from .runtime.engine import Prefiller, export_engine, prefill  # noqa: F401
from .runtime.engine import choose_host_pruning as choose_pruning  # noqa: F401
from .runtime.prompt import PrefillResult  # noqa: F401
