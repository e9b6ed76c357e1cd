"""Four costs of torch.export and ExecuTorch that lowering many small methods pays again and again,
paid once.

All are patches of their internals held only while ``llmnpu export`` lowers (``lowering_shortcuts``),
each exact by construction: the program is the same bytes with and without them (``cmp``). If a torch
release renames what they patch, lowering runs as before, only slower.

- **The composite-operator table.** Every ``run_decompositions`` (ExecuTorch's
  ``to_edge_transform_and_lower`` calls it three or four times per method) asks
  ``torch._export.utils._collect_all_valid_cia_ops`` for the composite operators it may keep, and
  that function walks every operator namespace and lists the C++ dispatcher's composite
  registrations again for each: about 0.2 s per call. torch does not cache it because a custom-op
  library can register more operators at any time; here the answer is kept per *set of
  registrations* (the dispatcher's composite registrations and torch.ops' namespaces), so a new
  registration is seen at the next call. The answers live for the process: forked workers inherit
  what the parent computed.
- **Provenance chains.** Every pass that rewrites a node records where it came from
  (``node.meta["from_node"]``, a chain of ``torch.fx.traceback.NodeSource``), and each new record
  deep-copies the whole chain before it, so a node's bookkeeping grows with every pass and costs the
  square of the passes to copy (about a tenth of lowering the embedded model). A record is never
  changed after it is made (torch builds new ones, it never edits one), so a copy may share it.
- **Registering an operator's Python kernels.** Each ``run_decompositions`` registers, and then
  removes, Python kernels for every composite operator it keeps or decomposes (about 12,000
  ``OpOverload.py_impl(key)(fn)`` calls), and each ``py_impl`` call spends most of its time building
  the typing annotations of the closure it returns (``Callable[_P, _T]``, a generic alias made anew
  every call). For a dispatch key the registration is three lines (torch's own ``py_impl`` branch for
  it: refuse a second kernel for the key, store it, clear the operator's dispatch cache), done here
  without the closure; every other kind of key goes to torch's ``py_impl``.
- **XNNPACK's partitioner looking for its caller.** ``XnnpackPartitioner.partition`` warns when it is
  called from the deprecated ``to_backend`` flow, and finds out with ``inspect.stack()``, which reads
  the source line of every frame on the stack (about 0.1 s per call). The same test on the frames'
  code objects (function name, file name) reads no file.
"""
from __future__ import annotations

import functools
import importlib
import sys
from contextlib import ExitStack, contextmanager

import torch

# the modules that imported the function by name (``from torch._export.utils import ...``)
_USERS = ("torch.export.exported_program", "torch.export.decomp_utils")
_CIA_ANSWERS: dict = {}         # set of registrations -> the composite operators torch may keep


def _registrations() -> tuple:
    return (tuple(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
            tuple(torch.ops._dir))


@contextmanager
def cached_cia_ops():
    modules = [importlib.import_module(name) for name in _USERS]
    original = getattr(modules[0], "_collect_all_valid_cia_ops", None)
    if original is None or not all(hasattr(m, "_collect_all_valid_cia_ops") for m in modules):
        yield
        return

    def collect():
        key = _registrations()
        if key not in _CIA_ANSWERS:
            if len(_CIA_ANSWERS) > 8:       # registrations only grow: older answers are not asked again
                _CIA_ANSWERS.clear()
            _CIA_ANSWERS[key] = frozenset(original())
        return set(_CIA_ANSWERS[key])       # callers may modify what they get

    for m in modules:
        m._collect_all_valid_cia_ops = collect
    try:
        collect()       # computed here, before any worker is forked
        yield
    finally:
        for m in modules:
            m._collect_all_valid_cia_ops = original


def _shared(self, memo):
    return self


@contextmanager
def shared_provenance():
    try:
        from torch.fx.traceback import NodeSource
    except ImportError:
        yield
        return
    before = NodeSource.__dict__.get("__deepcopy__")
    NodeSource.__deepcopy__ = _shared
    try:
        yield
    finally:
        if before is None:
            del NodeSource.__deepcopy__
        else:
            NodeSource.__deepcopy__ = before


def _register_kernel(op, key, fn):
    if key in op.py_kernels:
        raise RuntimeError(f"Trying to override a python impl for {key} on operator {op.name()}")
    op.py_kernels[key] = fn
    op._dispatch_cache.clear()
    return fn


@contextmanager
def direct_kernel_registration():
    from torch._C import DispatchKey
    from torch._ops import OpOverload, OperatorBase

    original = OpOverload.py_impl
    if "py_impl" in OpOverload.__dict__ or original is not OperatorBase.py_impl:
        yield       # not the torch this was written against: leave it alone
        return

    def py_impl(self, k):
        if isinstance(k, DispatchKey) and k != DispatchKey.Python:
            return functools.partial(_register_kernel, self, k)
        return original(self, k)

    OpOverload.py_impl = py_impl
    try:
        yield
    finally:
        del OpOverload.py_impl


def _called_from_to_backend(self) -> bool:
    """``XnnpackPartitioner._check_if_called_from_to_backend``'s test on the same frames."""
    codes, frame = [], sys._getframe(1)
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    if any(c.co_name == "to_edge_transform_and_lower" for c in codes):
        return False
    return any(c.co_name == "to_backend" and "program/_program.py" in c.co_filename for c in codes)


@contextmanager
def frames_without_sources():
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    except ImportError:
        yield
        return
    original = XnnpackPartitioner.__dict__.get("_check_if_called_from_to_backend")
    if original is None:
        yield
        return
    XnnpackPartitioner._check_if_called_from_to_backend = _called_from_to_backend
    try:
        yield
    finally:
        XnnpackPartitioner._check_if_called_from_to_backend = original


@contextmanager
def lowering_shortcuts():
    """All four shortcuts, for as long as the export lowers (in this process and the workers it forks)."""
    with ExitStack() as stack:
        stack.enter_context(cached_cia_ops())
        stack.enter_context(shared_provenance())
        stack.enter_context(direct_kernel_registration())
        stack.enter_context(frames_without_sources())
        yield
