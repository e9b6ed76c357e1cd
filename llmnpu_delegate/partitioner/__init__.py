"""FX graph analysis and NPU/CPU region tagging (ExecuTorch Partitioner).

Not built yet: this package is reserved for the partition stage (quantize -> **partition** ->
lower -> run). Nothing in the released commands imports it.
"""
