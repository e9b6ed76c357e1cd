"""llmnpu_delegate: fast LLM prefill on phone NPUs for PyTorch (llm.npu, ASPLOS'25).

Pipeline: model (``models``) -> quantize (``quantize``: calibration, W8A8 with shadow outliers)
-> partition (``partitioner``: NPU regions, the ExecuTorch partitioner) -> lower (``backends``
for the engine, ``lower`` for the phone program) -> run (``runtime``: chunk program, out-of-order
executor, decode, ``.pte`` runner), with the kernels apart (``kernels``). The doors: ``llmnpu``
(``cli``), ``hf.LlmNpuForCausalLM``, ``torch.compile(backend="llmnpu")`` (``compile``),
``llmnpu export``. The README and docs/ say how to use each.
"""
from .errors import LlmNpuError  # noqa: F401
from .models import load_model  # noqa: F401

__version__ = "0.1.0"
