"""NPU backends, one module each behind one interface (``registry.NpuBackend``), looked up by name.

``cpu-int8`` (the stand-in NPU on this CPU, exported to XNNPACK) is the default and the only one
whose engine runs here; ``qnn`` exports for Qualcomm's HTP. Importing this package registers both.
"""
from . import cpu_int8, qnn  # noqa: F401  (they register themselves)
from .registry import DEFAULT, NpuBackend, check_placement, get, names, placements, register  # noqa: F401
