"""The program's own CPU operators (``runner/ops/``: ``llmnpu::chunk_attention.out``,
``llmnpu::shadow_hits.out``, ``llmnpu::shadow_gather.out``) for the Python runner. The native runner links them; here ``libllmnpu_ops.so``, built by ``make runner`` against the
same ExecuTorch library as the Python runtime, registers them with that runtime's kernel registry
when it is loaded."""
from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

from ..errors import LlmNpuError

LIBRARY = "libllmnpu_ops.so"
_REPO_BUILD = Path(__file__).resolve().parents[2] / "runner" / "build" / LIBRARY


@cache
def load() -> str:
    """Load the operators once per process (``$LLMNPU_OPS`` or the repository's build); returns the
    attention kernel's vector path on this CPU."""
    import executorch.runtime  # noqa: F401  (its runtime library first: ours registers into it)

    path = Path(os.environ.get("LLMNPU_OPS") or _REPO_BUILD)
    if not path.is_file():
        raise LlmNpuError(f"the program's CPU kernels are not built ({path} is missing): run `make runner` in "
                          f"the repository, or set LLMNPU_OPS to a built {LIBRARY}")
    lib = ctypes.CDLL(str(path))
    lib.llmnpu_ops_attention_isa.restype = ctypes.c_char_p
    return lib.llmnpu_ops_attention_isa().decode()
