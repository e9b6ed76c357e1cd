"""One of torch.export's op tables, computed once per set of registered operators instead of per call.

Every ``run_decompositions`` (ExecuTorch's ``to_edge_transform_and_lower`` calls it three or four
times per method) asks ``torch._export.utils._collect_all_valid_cia_ops`` for the composite
operators it may keep, and that function walks every operator namespace and, for each one, lists
the C++ dispatcher's composite registrations again: about 0.2 s per call, 17 % of the time that
lowering the embedded model's methods took (cProfile over 28 methods). torch does not cache it
because a custom-op library can register more operators at any time; here the answer is kept per
*set of registrations* (the dispatcher's composite registrations and torch.ops' namespaces), so a
new registration is seen at the next call. Only used while ``llmnpu export`` lowers; if a torch
release renames the private function, lowering runs as before (unpatched), only slower.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

# the modules that imported the function by name (``from torch._export.utils import ...``)
_USERS = ("torch.export.exported_program", "torch.export.decomp_utils")


def _registrations() -> tuple:
    return (tuple(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
            tuple(torch.ops._dir))


@contextmanager
def cached_cia_ops():
    import importlib

    modules = [importlib.import_module(name) for name in _USERS]
    original = getattr(modules[0], "_collect_all_valid_cia_ops", None)
    if original is None or not all(hasattr(m, "_collect_all_valid_cia_ops") for m in modules):
        yield
        return
    memo: dict = {}

    def collect():
        key = _registrations()
        if key not in memo:
            memo.clear()
            memo[key] = frozenset(original())
        return set(memo[key])       # callers may modify what they get

    for m in modules:
        m._collect_all_valid_cia_ops = collect
    try:
        yield
    finally:
        for m in modules:
            m._collect_all_valid_cia_ops = original
