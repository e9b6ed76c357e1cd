"""What an engine is: a typed, versioned config of the settings that decide its program and its
outputs, recorded in its prefix-cache and profile keys. How it runs (threads, caches, progress) is
not part of it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .. import backends
from ..chunk_step import DEFAULT_CHUNK
from ..errors import LlmNpuError
from ..kernels.attention import PRECISIONS
from ..kernels.npu_attention import KV_BITS
from ..partitioner.placement import AUTO, PAPER
from ..quantize import QuantConfig, resolve_quant
from .schedule import check_policy

TAIL_MIN = 16         # rows: a shorter tail program saves less than its build and graphs cost


@dataclass(frozen=True)
class EngineConfig:
    """Args (as for ``Prefiller``):
        chunk_len: tokens per chunk graph (the paper's default: 256).
        backend: an NPU backend whose engine runs here (``backends.names(engine=True)``).
        quant: ``"w8a8-shadow"``, ``"w8a8"``, ``"fp32"`` or a QuantConfig; held as a QuantConfig
            (None for the float reference).
        placement: what the NPU regions run beside the linears, where the backend allows it; ``"auto"``
            until the engine resolves it (the fastest by this machine's profile, ``runtime/engine.py``).
        npu_kv_bits: bits of the K/V window that attention reads where it runs in an NPU graph of
            a quantized engine (16, or 8: half the window's memory and reads).
        policy: the default scheduling policy (``schedule.POLICIES``).
        attention: precision of the float side's attention and LM head, ``"auto"``, ``"fp32"`` or ``"bf16"``.
        tail_len: rows of the tail program for a prompt's last few tokens: ``"auto"`` (a quarter chunk
            when that is at least ``TAIL_MIN`` rows), an int below ``chunk_len``, or None.
    """
    chunk_len: int = DEFAULT_CHUNK
    backend: str = backends.DEFAULT
    quant: QuantConfig | str | None = "w8a8-shadow"
    placement: str = PAPER
    npu_kv_bits: int = 16
    policy: str = "ooo"
    attention: str = "auto"
    tail_len: int | str | None = "auto"
    version: int = 1

    def __post_init__(self):
        if isinstance(self.chunk_len, bool) or not isinstance(self.chunk_len, int) or self.chunk_len < 1:
            raise LlmNpuError(f"chunk length must be a positive integer, got {self.chunk_len!r}")
        npu = backends.get(self.backend, engine=True)
        if self.placement != AUTO:
            object.__setattr__(self, "placement", backends.check_placement(npu, self.placement).name)
        if self.npu_kv_bits not in KV_BITS:
            raise LlmNpuError(f"the NPU's K/V window is kept at {' or '.join(map(str, KV_BITS))} bits, "
                              f"got {self.npu_kv_bits!r}")
        check_policy(self.policy)
        if self.attention not in PRECISIONS:
            raise LlmNpuError(f"unknown attention precision '{self.attention}': use one of {', '.join(PRECISIONS)}")
        object.__setattr__(self, "quant", resolve_quant(self.quant))     # a named mode held as its config
        self.tail_rows()

    def tail_rows(self) -> int | None:
        """The tail program's rows, or None for no tail program."""
        tail, chunk = self.tail_len, self.chunk_len
        if tail == "auto":
            return chunk // 4 if chunk // 4 >= TAIL_MIN else None
        if tail is None or tail == 0:
            return None
        if isinstance(tail, bool) or not isinstance(tail, int) or not 0 < tail < chunk:
            raise LlmNpuError(f"tail_len must be 'auto', None or an integer in 1..{chunk - 1} (below the chunk "
                              f"length), got {tail!r}")
        return tail

    def outputs_key(self) -> dict:
        """The fields that decide a prompt's outputs: all but the default policy (every policy gives
        the same bits), for the prefix cache's and the profile's keys."""
        return {k: v for k, v in self.to_dict().items() if k != "policy"}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["quant"] = self.quant.to_dict() if self.quant is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise LlmNpuError(f"EngineConfig: unknown fields {sorted(unknown)}")
        quant = d.get("quant")
        return cls(**{**d, "quant": QuantConfig.from_dict(quant) if isinstance(quant, dict) else quant})
