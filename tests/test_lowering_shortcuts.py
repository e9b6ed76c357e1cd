"""lower/lowering_shortcuts.py: torch.export's composite-operator table cached per set of registrations;
provenance records shared, not copied, while lowering."""
import copy

import pytest
import torch
import torch.export.decomp_utils
import torch.export.exported_program as exported_program
from torch._export import utils as export_utils
from torch.fx.traceback import NodeSource

from llmnpu_delegate.lower import lowering_shortcuts as shortcuts
from llmnpu_delegate.lower.lowering_shortcuts import (cached_cia_ops, direct_kernel_registration,
                                                    frames_without_sources, lowering_shortcuts, shared_provenance)


def test_cached_table_is_torchs_and_sees_a_new_registration(monkeypatch):
    plain = export_utils._collect_all_valid_cia_ops()
    calls = []

    def counted():
        calls.append(1)
        return export_utils._collect_all_valid_cia_ops()

    for module in (exported_program, torch.export.decomp_utils):
        monkeypatch.setattr(module, "_collect_all_valid_cia_ops", counted)
    monkeypatch.setattr(shortcuts, "_CIA_ANSWERS", {})
    with cached_cia_ops():
        first = exported_program._collect_all_valid_cia_ops()
        again = torch.export.decomp_utils._collect_all_valid_cia_ops()
        assert first == plain and again == plain
        assert len(calls) == 1          # computed once for both callers
        again.clear()           # a caller's copy: the cached answer stays whole
        assert exported_program._collect_all_valid_cia_ops() == plain
        # an operator registered meanwhile (as a custom-op library may at any time) is in the next answer
        lib = torch.library.Library("llmnpu_op_tables_test", "DEF")
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
        op = torch.ops.llmnpu_op_tables_test.twice.default
        assert op in exported_program._collect_all_valid_cia_ops()
        assert len(calls) == 2          # the new registration made it compute again
        assert op in export_utils._collect_all_valid_cia_ops()
    assert exported_program._collect_all_valid_cia_ops is counted     # put back as it was
    # the answers outlive one export's context (the next job, a forked worker): not computed again
    with cached_cia_ops():
        assert op in exported_program._collect_all_valid_cia_ops()
    assert len(calls) == 2


def _chain():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(torch.relu, (x,))
    node.meta["from_node"] = [NodeSource(None, "earlier")]
    return node


def test_provenance_is_shared_inside_and_copied_outside():
    node = _chain()
    with shared_provenance():
        inside = NodeSource(node, "a_pass")
        assert inside.from_node[0] is node.meta["from_node"][0]     # shared, not copied
        assert inside.to_dict()["from_node"] == [node.meta["from_node"][0].to_dict()]
        kept = copy.deepcopy([inside])
        assert kept[0] is inside
    outside = NodeSource(node, "a_pass")
    assert outside.from_node[0] is not node.meta["from_node"][0]    # torch's own deep copy again
    assert outside.to_dict() == inside.to_dict()
    assert "__deepcopy__" not in NodeSource.__dict__


def test_kernels_registered_directly_as_torch_registers_them():
    from torch._C import DispatchKey
    from torch._ops import OpOverload, OperatorBase

    op = torch.ops.aten.hardswish.default
    saved = op.py_kernels.copy()

    def kernel(*args):
        return None

    try:
        with direct_kernel_registration():
            assert OpOverload.py_impl is not OperatorBase.py_impl
            op._dispatch_cache[DispatchKey.AutogradCPU] = "stale"
            assert op.py_impl(DispatchKey.AutogradCPU)(kernel) is kernel
            assert op.py_kernels[DispatchKey.AutogradCPU] is kernel
            assert DispatchKey.AutogradCPU not in op._dispatch_cache         # torch clears it too
            with pytest.raises(RuntimeError, match="override a python impl"):
                op.py_impl(DispatchKey.AutogradCPU)(kernel)
            with pytest.raises(AssertionError, match="register a mode"):       # torch's own refusal
                op.py_impl(DispatchKey.Python)(kernel)
        assert "py_impl" not in OpOverload.__dict__
    finally:
        op.py_kernels.clear()
        op.py_kernels.update(saved)
        op._dispatch_cache.clear()


def test_partitioner_finds_its_caller_as_xnnpack_does():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    part = XnnpackPartitioner()
    original = XnnpackPartitioner._check_if_called_from_to_backend

    def to_edge_transform_and_lower():
        return part._check_if_called_from_to_backend()

    def to_backend():       # not in exir's program/_program.py: not the deprecated flow
        return part._check_if_called_from_to_backend()

    plain = (part._check_if_called_from_to_backend(), to_edge_transform_and_lower(), to_backend())
    with frames_without_sources():
        assert XnnpackPartitioner._check_if_called_from_to_backend is not original
        fast = (part._check_if_called_from_to_backend(), to_edge_transform_and_lower(), to_backend())
    assert fast == plain == (False, False, False)
    assert XnnpackPartitioner._check_if_called_from_to_backend is original
    # the deprecated flow itself: ExecuTorch's to_backend calling the partitioner is seen as such
    from executorch.exir import to_edge

    class Small(torch.nn.Module):
        def forward(self, x):
            return x + 1

    seen = []

    class Probe(XnnpackPartitioner):
        def partition(self, ep):
            seen.append(self._check_if_called_from_to_backend())
            return super().partition(ep)

    edge = to_edge(torch.export.export(Small(), (torch.ones(2),)))
    edge.to_backend(Probe())
    with frames_without_sources():
        edge.to_backend(Probe())
    assert seen == [True, True]


def test_lowering_under_the_shortcuts_gives_the_same_program():
    from executorch.exir import to_edge_transform_and_lower
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            return torch.nn.functional.silu(self.lin(x)).softmax(-1)

    torch.manual_seed(0)
    model, example = Small().eval(), (torch.randn(2, 8),)

    def emitted():
        ep = torch.export.export(model, example)
        return to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer

    plain = emitted()
    with lowering_shortcuts():
        fast = emitted()
    assert fast == plain
