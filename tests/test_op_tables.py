"""lower/op_tables.py: torch.export's table of composite operators, cached per set of registrations."""
import torch
import torch.export.decomp_utils
import torch.export.exported_program as exported_program
from torch._export import utils as export_utils

from llmnpu_delegate.lower.op_tables import cached_cia_ops


def test_cached_table_is_torchs_and_sees_a_new_registration(monkeypatch):
    plain = export_utils._collect_all_valid_cia_ops()
    calls = []

    def counted():
        calls.append(1)
        return export_utils._collect_all_valid_cia_ops()

    for module in (exported_program, torch.export.decomp_utils):
        monkeypatch.setattr(module, "_collect_all_valid_cia_ops", counted)
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
