"""What ``llmnpu export`` writes: a typed, versioned config of the program's own settings, recorded
in the sidecar (``export``). How the export runs (worker processes, progress, the tokenizer copied
beside it) is not part of it: two exports with equal configs of one engine are the same program."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .. import backends
from ..backends.qnn import DEFAULT_SOC
from ..errors import LlmNpuError
from .cpu_subgraphs import SHADOW_FORMS
from .decode_method import MODES as DECODE_MODES
from .npu_subgraphs import check_output_bits

DEFAULT_CONTEXT = 1024
RESIDUAL_BITS = (8, 16)


@dataclass(frozen=True)
class ExportConfig:
    """Args:
        target: the NPU methods' backend (``backends.names()``): ``qnn`` for a phone, ``cpu-int8`` here.
        soc: the Snapdragon SoC a ``qnn`` program is compiled for.
        context: K/V slots of the decode method, at least a chunk; None: ``DEFAULT_CONTEXT`` or the
            model's own context if shorter.
        shadow: the shadow branches' form, ``sparse`` (hot-channel products, cold rows on disk; the
            paper's) or ``dense`` (the whole linear on the residue; the reference).
        decode: ``int8`` (dynamic INT8 linears, the default) or ``fp32`` (the reference).
        output_bits: the NPU methods' outputs, 8 (requantized) or 32 (float); None: the target's first.
        fine: 8-bit outputs that one encoding holds poorly come out a second time with a finer one.
        residual_bits: the outputs of the linears that write the residual stream (o_proj, down_proj):
            8, or 16 (``qnn``: their input at 16 bits on the NPU, at the matrix unit's 16-bit rate;
            ``npu_subgraphs.residual_writers``).
    """
    target: str = "qnn"
    soc: str = DEFAULT_SOC
    context: int | None = None
    shadow: str = "sparse"
    decode: str = "int8"
    output_bits: int | None = None
    fine: bool = True
    residual_bits: int = 8
    version: int = 1

    def __post_init__(self):
        backend = backends.get(self.target)         # names the known backends when it is not one
        backend.check_target(self.soc)
        if self.shadow not in SHADOW_FORMS:
            raise LlmNpuError(f"unknown shadow branch form '{self.shadow}': use one of {', '.join(SHADOW_FORMS)}")
        if self.decode not in DECODE_MODES:
            raise LlmNpuError(f"unknown decode mode '{self.decode}': use one of {', '.join(DECODE_MODES)}")
        if self.output_bits is not None:
            check_output_bits(self.output_bits, self.target)
        if self.residual_bits not in RESIDUAL_BITS:
            raise LlmNpuError(f"residual_bits must be one of {', '.join(map(str, RESIDUAL_BITS))}, got {self.residual_bits!r}")
        if self.residual_bits == 16 and (self.target != "qnn" or self.bits != 8):
            raise LlmNpuError(f"16-bit residual outputs are a qnn program's with 8-bit outputs elsewhere (this is "
                              f"{self.target}, {self.bits}-bit): use --residual-bits 8")
        if self.context is not None and (isinstance(self.context, bool) or not isinstance(self.context, int)):
            raise LlmNpuError(f"context must be an integer number of tokens, got {self.context!r}")

    @property
    def bits(self) -> int:
        """The NPU methods' output bits, the target's default resolved."""
        return backends.get(self.target).output_bits[0] if self.output_bits is None else self.output_bits

    def context_for(self, model_context: int) -> int:
        return self.context or min(DEFAULT_CONTEXT, model_context)

    to_dict = asdict

    @classmethod
    def from_dict(cls, d: dict) -> "ExportConfig":
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise LlmNpuError(f"ExportConfig: unknown fields {sorted(unknown)}")
        return cls(**d)
