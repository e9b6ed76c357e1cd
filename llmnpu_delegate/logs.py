"""What our commands print besides their own output: other libraries' import-time notices are not it."""
from __future__ import annotations

import logging
import warnings


def quiet_third_party_logs() -> None:
    """Call before torchao and transformers are imported (a command's entry point)."""
    # torchao (pulled in by transformers) logs missing CUDA kernels and pytree notices on import.
    for name in ("torchao", "torch.utils._pytree", "transformers.modeling_utils",
                 "transformers.distributed.tensor_parallel"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # torch's own deprecation notice, once per graph copied during export
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)


def hide_progress_bars() -> None:
    """``--no-progress`` for other libraries' bars: transformers' switch, which our GGUF loading makes
    its reader follow too (``models._gguf_reader_bar``)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
