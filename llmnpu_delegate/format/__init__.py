"""The program format: what ``llmnpu export`` writes beside a ``.pte`` and every runner reads.

One neutral place, below both its writer (``lower/``) and its readers (``runtime/``, the C++ runner
in ``runner/``): the sidecar's schema and checks (``sidecar``), the task dependency table
(``tasks``), the cold rows file (``rows``), the decode K/V cache layout (``kv``) and the NPU
methods' input groups and split outputs (``regions``). It imports only the kernels and the base.
"""
