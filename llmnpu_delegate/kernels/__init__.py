"""Integer and outlier kernels, registered as ``torch.library`` custom ops (namespace ``llmnpu``).

Importing this package registers the ops; call them through ``torch.ops.llmnpu.<name>`` or the
Python wrappers re-exported here. Every op has a fake (meta) implementation so graphs that use
it survive ``torch.export``.
"""
from .attention import causal_mask, chunk_attention  # noqa: F401
from .ops import (  # noqa: F401
    QMAX,
    W8A8Linears,
    dequantize,
    dynamic_linear,
    dynamic_linear_reference,
    int8_linear,
    outlier_compensate,
    outlier_extract,
    outlier_product,
    outlier_product_in_order,
    prepack_dynamic,
    quantize,
    quantize_u8,
    w8a8_linear,
    w8a8_linears,
)
