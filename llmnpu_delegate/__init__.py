"""llmnpu_delegate: fast LLM prefill on phone NPUs for PyTorch (llm.npu, ASPLOS'25).

Pipeline: quantize -> partition -> lower -> run. This release provides model loading,
calibration and W8A8 quantization with shadow outlier execution (``quantize_``), the integer
kernels (``llmnpu_delegate.kernels``) and the accuracy harness (``llmnpu eval``).
"""
from .errors import LlmNpuError  # noqa: F401
from .models import load_model  # noqa: F401

__version__ = "0.1.0"
