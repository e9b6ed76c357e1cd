"""The NPU backend interface and the registry that names backends.

A backend is one class, registered under one name, that answers for every stage that meets an NPU:

- what its NPU graphs can hold besides the INT8 linears: ``pieces``, one row per placement piece
  it runs (``partitioner/placement.py``) with the ops and precision it runs it at; a piece it
  lacks is named in ``missing`` with the reason. ``check_placement`` refuses a placement that
  needs a missing piece, before anything slow, and ``placements`` lists the presets it can run;
- the engine on this host: ``engine(...)`` returns the object that lowers the partition's NPU
  subgraphs to runnable regions (``lower_npu``) and binds shadow paths (``shadow_module``); a
  backend without a host engine (``runs_engine = False``: a real NPU's, such as QNN) refuses it;
- export: ``check_target(soc)`` before anything slow, ``quantizer(ours)`` wraps our encodings in
  the quantizer its delegate needs, ``lower(graphs, soc)`` lowers quantized NPU subgraphs (method
  name -> (graph, example inputs)), each to one delegate call of its method, whose outputs are
  requantized to 8 bits or left float (``output_bits``: ``lower/npu_subgraphs.py``); a backend that
  ``shares_contexts`` puts the graphs of one call in one context, which its runtime loads once for
  all their methods, so export lowers each block's NPU subgraphs together; ``join(delegates)`` edits, before the
  program is written, the compile specs of all its delegate calls (``(backend id, specs)`` pairs)
  where the calls of one program share something at run time;
- the runners: ``prepare_runtime()`` before a program of this backend is loaded in Python,
  ``native_env()`` the environment the C++ runner needs.

``get(name)`` and ``names()`` are the only way the engine, ``torch.compile``, export, the runners and
the CLI reach a backend, so a new one is a module that calls ``register`` and nothing else.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..errors import LlmNpuError
from ..partitioner.placement import PIECES, PRESETS, Placement, parse_placement, with_inline


@runtime_checkable
class NpuBackend(Protocol):
    name: str
    summary: str                      # one line for --help and docs
    runs_engine: bool                 # whether the engine runs its NPU regions on this host
    encodings: str                    # our encodings' flavour for its delegate: "qnn" | "xnnpack"
    uses_soc: bool                    # whether export targets a SoC (--soc)
    shares_contexts: bool             # whether the graphs lowered in one call share one context
    output_bits: tuple                # the NPU methods' output widths it can give, its default first
    pieces: dict                      # placement piece it runs on the NPU -> its ops and precision there
    missing: str                      # why the pieces it lacks stay on the CPU

    def engine(self, model, fingerprint: str, chunk_len: int, plans, weights: str = "channel", cache=None): ...

    def check_target(self, soc: str | None) -> None: ...

    def quantizer(self, ours): ...

    def lower(self, graphs: dict[str, tuple], soc: str | None): ...

    def join(self, delegates: list) -> None: ...

    def prepare_runtime(self) -> None: ...

    def native_env(self) -> dict: ...


DEFAULT = "cpu-int8"


def check_placement(backend: NpuBackend, placement: "Placement | str") -> Placement:
    """``placement`` as a ``Placement``, if ``backend`` runs every piece it puts on the NPU."""
    placement = parse_placement(placement)
    lacking = [p for p in PIECES if placement.on_npu(p) and p not in backend.pieces]
    if lacking:
        can = ", ".join(placements(backend))
        raise LlmNpuError(f"backend {backend.name} cannot run {' or '.join(lacking)} on its NPU ({backend.missing}): "
                          f"use placement {can}")
    return placement


def placements(backend: NpuBackend) -> list[str]:
    """The preset placements whose pieces ``backend`` all runs, the paper's first, each followed by
    its ``+inline`` form (shadow products in the task that merges them) where it has one."""
    return with_inline([name for name, pieces in PRESETS.items() if set(pieces) <= set(backend.pieces)])
_REGISTRY: dict[str, NpuBackend] = {}


def register(backend: type) -> type:
    """Class decorator: register an instance of ``backend`` under its ``name``."""
    instance = backend()
    if not isinstance(instance, NpuBackend):
        raise TypeError(f"{backend.__name__} does not implement NpuBackend")
    _REGISTRY[instance.name] = instance
    return backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names(engine: bool = False) -> tuple[str, ...]:
    """Registered backend names (``engine=True``: those whose engine runs on this host), default first."""
    return tuple(n for n, b in _REGISTRY.items() if b.runs_engine or not engine)


def get(name: str, engine: bool = False) -> NpuBackend:
    """The backend called ``name``; ``engine=True`` also requires that its engine runs on this host."""
    if name not in _REGISTRY:
        raise LlmNpuError(f"unknown backend '{name}': use one of {', '.join(_REGISTRY)}")
    backend = _REGISTRY[name]
    if engine and not backend.runs_engine:
        raise LlmNpuError(f"backend '{name}' has no engine on this host ({backend.summary}): prefill here with "
                          f"{' or '.join(names(engine=True))}, or export a program for it (llmnpu export --backend {name})")
    return backend
