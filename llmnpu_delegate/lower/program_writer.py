"""One ``.pte`` built method by method, so that the export holds one lowered method at a time.

``EdgeProgramManager(all methods).to_executorch()`` needs every lowered method alive until the end,
and a delegate's lowered module keeps the float program it came from (``to_executorch`` re-runs it):
the export's memory grew with every method (4.4 GiB for the embedded model, 15 GiB for a 0.5B one).
Here each method goes through its own ``to_executorch`` as soon as it is lowered, and only its
emitted form is kept: the execution plan, its constants and delegate payloads, its named data
(XNNPACK's weights), which together are about the bytes of the finished file. The methods are
then joined into one ``Program`` the way ExecuTorch's emitter joins the methods of one call:
constants and delegate payloads stored once by content, the program-level indices that point at
them renumbered; named data is keyed by content already (``NamedDataStore`` merges by key).

Emission and serialization are ExecuTorch's own (``to_executorch``, ``serialize_pte_binary``);
this module only merges their per-method output, so the file is one ordinary program.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import LlmNpuError
from ..paths import atomic_path


@dataclass
class EmittedMethod:
    """One method in ExecuTorch's emitted form, with the program-level data its plan points at
    (indices into ``constants`` and ``delegates``; index 0 of ``constants`` is the reserved empty
    buffer). Plain dataclasses and bytes: it pickles, so a worker process can send it back."""
    plan: object                # executorch.exir.schema.ExecutionPlan
    constants: list
    delegates: list
    named_data: object          # NamedDataStoreOutput
    version: int


def emit_method(name: str, edge_program, planning=None) -> EmittedMethod:
    """``edge_program`` (edge dialect, delegates lowered) through ``to_executorch`` as method ``name``;
    ``planning``: its memory-planning pass (ExecuTorch's default if None)."""
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir.program import EdgeProgramManager
    from executorch.exir.program._program import collect_named_data_store_from_exported_program
    from executorch.exir.schema import Tensor

    named = NamedDataStore()
    collect_named_data_store_from_exported_program(edge_program, named)
    config = ExecutorchBackendConfig(memory_planning_pass={name: planning}) if planning is not None else None
    edge = EdgeProgramManager({name: edge_program}, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    program = edge.to_executorch(config).executorch_program
    (plan,) = program.execution_plan
    for value in plan.values:
        if isinstance(value.val, Tensor) and value.val.extra_tensor_info is not None:
            # mutable buffers and external constants live in program-level segments this merge
            # does not renumber; no method of ours has them (K/V are method inputs)
            raise LlmNpuError(f"method '{name}' has a tensor with extra storage info ({value.val.extra_tensor_info}); "
                              f"the program writer does not merge those")
    _release(edge_program)
    return EmittedMethod(plan, program.constant_buffer, program.backend_delegate_data,
                         named.get_named_data_store_output(), program.version)


def _release(edge_program) -> None:
    """Let go of the emitted program. Process-wide caches hold the lowered modules they saw, and with
    each the float program it keeps: ExecuTorch's unbounded ``lru_cache`` on ``is_same_node`` (its keys
    are graph nodes), torch's fake-tensor dispatch cache (its keys hold a delegate call's arguments),
    and the ``lru_cache`` on ``ShapeEnv._inner_evaluate_expr`` (up to 256 shape environments with their
    own dispatch caches). They are cleared, and the delegates emptied of their payload, named data and
    float program, in case anything else still holds one. Without this, an export kept every method it
    had lowered (found with ``gc.get_referrers`` from a ``LoweredBackendModule``)."""
    from executorch.exir.backend.utils import is_same_node
    from executorch.exir.lowered_backend_module import LoweredBackendModule
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    is_same_node.cache_clear()
    FakeTensorMode.cache_clear()
    ShapeEnv._inner_evaluate_expr.cache_clear()
    for module in edge_program.graph_module.modules():
        if isinstance(module, LoweredBackendModule):
            module._original_exported_program = None
            module._processed_bytes = b""
            module._named_data_store_output = None


class ProgramWriter:
    """Joins emitted methods, in the order they are added, into one program; ``write`` serializes it."""

    def __init__(self):
        from executorch.exir._serialize._named_data_store import NamedDataStore
        from executorch.exir.schema import Buffer

        self._plans = []
        self._constants, self._constant_at = [Buffer(storage=b"")], {}
        self._delegates, self._delegate_at = [], {}
        self._named = NamedDataStore()
        self._version = None

    @property
    def methods(self) -> list[str]:
        return [p.name for p in self._plans]

    @property
    def delegates(self) -> list:
        """``(backend id, compile specs)`` of every delegate call of the methods added so far; the
        specs are the program's own, edited in place before ``write``."""
        return [(d.id, d.compile_specs) for plan in self._plans for d in plan.delegates]

    def payloads(self, methods) -> int:
        """How many distinct delegate payloads the delegate calls of ``methods`` carry (on QNN, the
        HTP contexts: methods lowered together share one)."""
        methods = set(methods)
        return len({d.processed.index for plan in self._plans if plan.name in methods for d in plan.delegates})

    def add(self, method: EmittedMethod, name: str | None = None) -> None:
        """Take ``method`` into the program (as ``name`` if given: identical programs are emitted once
        and named after the first subgraph that uses them)."""
        from executorch.exir.schema import DataLocation, Tensor

        plan = method.plan
        if name is not None:
            plan.name = name
        if plan.name in self.methods:
            raise LlmNpuError(f"method '{plan.name}' added twice to one program")
        constants = {i: _intern(self._constants, self._constant_at, buf, buf.storage)
                     for i, buf in enumerate(method.constants) if i}
        delegates = {i: _intern(self._delegates, self._delegate_at, d, d.data)
                     for i, d in enumerate(method.delegates)}
        for value in plan.values:
            if isinstance(value.val, Tensor) and value.val.data_buffer_idx:
                value.val.data_buffer_idx = constants[value.val.data_buffer_idx]
        for d in plan.delegates:
            if d.processed.location == DataLocation.INLINE:
                d.processed.index = delegates[d.processed.index]
        self._named.merge_named_data_store(method.named_data)
        self._version = method.version
        self._plans.append(plan)

    def write(self, path: str | Path) -> dict:
        """Serialize the methods added so far as one ``.pte`` at ``path`` (temporary name, renamed);
        returns its size, SHA-256 and where each named data entry lies in it (``named_data``: key ->
        (byte offset, size))."""
        from executorch.exir import ExecutorchBackendConfig
        from executorch.exir._serialize._program import PTEFile, serialize_pte_binary
        from executorch.exir.schema import Program, SubsegmentOffsets

        if not self._plans:
            raise LlmNpuError("no methods to write: add at least one before writing the program")
        program = Program(version=self._version, execution_plan=self._plans, constant_buffer=self._constants,
                          backend_delegate_data=self._delegates, segments=[],
                          constant_segment=SubsegmentOffsets(segment_index=0, offsets=[]))
        c = ExecutorchBackendConfig()
        cord = serialize_pte_binary(
            pte_file=PTEFile(program=program, mutable_data=None,
                             named_data=self._named.get_named_data_store_output()),
            extract_delegate_segments=c.extract_delegate_segments, segment_alignment=c.segment_alignment,
            constant_tensor_alignment=c.constant_tensor_alignment, delegate_alignment=c.delegate_alignment)
        path = Path(path)
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                cord.write_to_file(f)
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
                size += len(block)
        return {"bytes": size, "sha256": digest.hexdigest(), "named_data": named_data_offsets(path)}


def _program_table(path: Path):
    """The ``.pte`` at ``path``'s extended header and program table (its segments are not read), or
    None for a file without that header."""
    from executorch.exir._serialize._program import _flatbuffer_to_program, _get_extended_header

    with open(path, "rb") as f:
        header = _get_extended_header(f.read(64))
        if header is None or not header.is_valid():
            return None
        f.seek(0)
        return header, _flatbuffer_to_program(f.read(header.program_size))


def named_data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Key -> (byte offset in the file, size) of each named data entry of the ``.pte`` at ``path``."""
    table = _program_table(path)
    if table is None:
        return {}
    header, program = table
    segments = program.segments
    return {d.key: (header.segment_base_offset + segments[d.segment_index].offset, segments[d.segment_index].size)
            for d in program.named_data}


def delegate_specs(path: Path) -> list[tuple[str, str, list]]:
    """``(method, backend id, compile specs)`` of every delegate call of the ``.pte`` at ``path``."""
    table = _program_table(path)
    if table is None:
        raise LlmNpuError(f"{path} is not an ExecuTorch program: export it again")
    return [(plan.name, d.id, d.compile_specs) for plan in table[1].execution_plan for d in plan.delegates]


def method_payloads(path: Path) -> dict[str, tuple[int, ...]]:
    """Method -> the delegate payloads its calls carry, by index, for the ``.pte`` at ``path``: methods
    with the same payloads share their delegate's state at run time (on QNN, one context)."""
    table = _program_table(path)
    if table is None:
        raise LlmNpuError(f"{path} is not an ExecuTorch program: export it again")
    return {plan.name: tuple(d.processed.index for d in plan.delegates) for plan in table[1].execution_plan}


def _intern(table: list, at: dict, item, data: bytes) -> int:
    """Index of ``item`` in ``table``, appended unless an item with the same bytes is there."""
    key = hashlib.sha256(data).digest()
    if key not in at:
        at[key] = len(table)
        table.append(item)
    return at[key]
