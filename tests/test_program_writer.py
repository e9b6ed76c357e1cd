"""``lower/program_writer.py``: a program emitted method by method and joined equals the same methods
through ExecuTorch's own multi-method ``to_executorch``, with shared bytes stored once."""
import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
from executorch.runtime import Runtime

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.lower.program_writer import ProgramWriter, emit_method

W = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
TABLE = torch.randn(100, 48, generator=torch.Generator().manual_seed(1))


class Delegated(torch.nn.Module):        # an XNNPACK method: its weight is named data
    def __init__(self, scale):
        super().__init__()
        self.w, self.scale = torch.nn.Parameter(W.clone()), scale

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w) * self.scale


class Portable(torch.nn.Module):         # a portable method: its table is a program constant
    def forward(self, ids):
        return torch.nn.functional.embedding(ids, TABLE.clone()).sum(-1)


def _edge(module, example, delegate: bool):
    ep = torch.export.export(module, example)
    return to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()] if delegate else [],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False)
                                       ).exported_program("forward")


METHODS = {"a": (Delegated(2.0), (torch.randn(3, 48),), True),
           "b": (Delegated(-1.0), (torch.randn(5, 48),), True),      # same weight as "a"
           "c": (Portable(), (torch.tensor([[1, 7, 99]]),), False),
           "d": (Portable(), (torch.tensor([[2, 3]]),), False)}         # same table as "c"


def test_joined_program_runs_like_one_to_executorch_and_stores_shared_bytes_once(tmp_path):
    from executorch.exir import EdgeProgramManager
    reference = EdgeProgramManager({n: _edge(m, ex, d) for n, (m, ex, d) in METHODS.items()},
                                   compile_config=EdgeCompileConfig(_check_ir_validity=False)
                                   ).to_executorch().buffer
    writer = ProgramWriter()
    for n, (m, ex, d) in METHODS.items():
        writer.add(emit_method(n, _edge(m, ex, d)))
    written = writer.write(tmp_path / "joined.pte")
    data = (tmp_path / "joined.pte").read_bytes()
    assert written["bytes"] == len(data) and [p.name for p in tmp_path.iterdir()] == ["joined.pte"]
    # each weight once: within alignment padding of the reference, and far less than two copies of each
    assert abs(len(data) - len(reference)) < 4096 and len(data) < W.numel() * 4 + TABLE.numel() * 4 + 16384
    runtime = Runtime.get()
    joined, ref = runtime.load_program(data), runtime.load_program(reference)
    assert joined.method_names == ref.method_names == set(METHODS)
    for n, (m, ex, _) in METHODS.items():
        got = joined.load_method(n).execute(list(ex))[0]
        assert torch.equal(got, ref.load_method(n).execute(list(ex))[0])
        torch.testing.assert_close(got, m(*ex), rtol=1e-5, atol=1e-5)


def test_renaming_and_refusals(tmp_path):
    writer = ProgramWriter()
    with pytest.raises(LlmNpuError, match="no methods to write"):
        writer.write(tmp_path / "empty.pte")
    m, ex, d = METHODS["c"]
    writer.add(emit_method("c", _edge(m, ex, d)), name="cpu_0")
    with pytest.raises(LlmNpuError, match="'cpu_0' added twice"):
        writer.add(emit_method("c", _edge(m, ex, d)), name="cpu_0")
    writer.write(tmp_path / "one.pte")
    program = Runtime.get().load_program((tmp_path / "one.pte").read_bytes())
    assert program.method_names == {"cpu_0"}
    torch.testing.assert_close(program.load_method("cpu_0").execute(list(ex))[0], m(*ex), rtol=1e-5, atol=1e-5)
