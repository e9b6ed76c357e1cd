"""torch.compile door: ``torch.compile(model, backend="llmnpu", options=compile_options(lm))``.

Dynamo hands each captured graph to ``llmnpu_backend``, which runs the same partitioner as the
chunked prefill on it: NPU regions (the decoder linears, grouped by shared input) execute on the
INT8 engine with the calibrated per-tensor activation scales, shadow subgraphs add the outlier
products, everything else runs as the float graph Dynamo captured. There is no chunking here: a
Dynamo graph takes whatever sequence length it was traced for, so the regions run once per call.

Graphs without quantizable linears, and graphs the partitioner cannot handle, run eagerly (the
latter with a warning). A partitioned graph that fails at run time raises by default
(``fallback="error"``): its results would otherwise carry no NPU quantization under an NPU label.
With ``fallback="eager"`` it warns once and runs the float graph from then on. ``options["counters"]``
(a ``CompileCounters``) tells the caller how many graphs and calls ran on the NPU path and eagerly.

The backend is registered under "llmnpu" through the ``torch_dynamo_backends`` entry point of the
installed package, so ``backend="llmnpu"`` needs no import of ours first (``register()`` does it by
hand for a source tree that was not pip-installed).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx, nn

from . import backends
from .errors import LlmNpuError
from .models import LoadedModel, fingerprint as model_fingerprint
from .partitioner.placement import PAPER
from .partitioner.regions import is_linear, linear_names, partition_graph
from .prepare import default_calibration
from .quantize import Calibration, QuantConfig, plan_linears, quant_config, quantizable_linears
from .quantize.apply import LinearPlan
from .runtime.engine import choose_host_pruning
from .runtime.program import build_steps

NAME = "llmnpu"
_KNOWN_OPTIONS = {"linears", "plans", "fingerprint", "weights", "placement", "fallback", "counters", "backend"}
FALLBACKS = ("error", "eager")


@dataclass
class CompileCounters:
    """What the backend did with the graphs Dynamo gave it, and with their calls."""
    npu_graphs: int = 0       # partitioned: NPU regions on the INT8 engine
    eager_graphs: int = 0     # run as captured: nothing to quantize, unsupported, or failed (fallback="eager")
    npu_calls: int = 0
    eager_calls: int = 0      # calls of partitioned graphs that ran eagerly after a failure

    def to_dict(self) -> dict:
        return dict(vars(self))


def compile_options(model: LoadedModel | nn.Module, quant: QuantConfig | str | None = "w8a8-shadow",
                    calibration: Calibration | None = None, pruning_rate: float | None = None,
                    clip_percentile: float | None = None, progress: bool = True, fallback: str = "error",
                    backend: str = backends.DEFAULT) -> dict:
    """The ``options`` of ``torch.compile(..., backend="llmnpu")``: the quantization plan of ``model``
    (calibrated on the shipped text unless ``calibration`` is given; cached on disk).

    ``quant="fp32"`` gives the float reference: the same partition, NPU regions as float linears.
    ``fallback``: what a partitioned graph that fails at run time does, ``"error"`` (raise) or
    ``"eager"`` (warn once, then run the float graph). ``options["counters"]`` counts both paths.
    ``backend``: the NPU backend whose engine runs the regions (``backends.names(engine=True)``).
    """
    backends.get(backend, engine=True)
    lm = model if isinstance(model, LoadedModel) else None
    module = lm.model if lm else model
    fp = lm.fingerprint if lm else model_fingerprint(module)
    _check_fallback(fallback)
    config = quant_config(quant, pruning_rate, clip_percentile)
    linears = sorted(quantizable_linears(module))
    common = {"linears": linears, "fingerprint": fp, "fallback": fallback, "counters": CompileCounters(),
              "backend": backend}
    if config is None:
        return {**common, "plans": None, "weights": "channel"}
    calib = calibration if calibration is not None else default_calibration(lm, progress)
    choose_host_pruning(model, calib, config, progress)
    plans = plan_linears(module, calib, config, fp, progress)
    return {**common, "plans": plans, "weights": config.weights}


def _check_fallback(fallback) -> None:
    if fallback not in FALLBACKS:
        raise LlmNpuError(f"unknown llmnpu fallback {fallback!r}: use 'error' (a failing graph raises) or "
                          f"'eager' (it runs unquantized, with a warning)")


def _param_fqn(placeholder_target: str) -> str | None:
    """``L_self_modules_model_modules_layers_modules_0_..._parameters_weight_`` -> ``model.layers.0....weight``
    (how Dynamo names a module's lifted parameters)."""
    m = re.search(r"_(modules|parameters|buffers)_", placeholder_target)
    if m is None:
        return None
    body = placeholder_target[m.start() + 1:].rstrip("_")
    parts = re.split(r"(?:^|_)(?:modules|parameters|buffers)_", body)
    return ".".join(p for p in parts if p)


def _linear_shells(gm: fx.GraphModule, args: Sequence, names: dict[str, str]) -> dict[str, nn.Linear]:
    """nn.Linear views over the weights among a call's ``args`` (Dynamo passes parameters as inputs)."""
    value_of = {n.name: v for n, v in zip(gm.graph.find_nodes(op="placeholder"), args)}
    shells: dict[str, nn.Linear] = {}
    for node in gm.graph.nodes:
        if not is_linear(node):
            continue
        w = node.args[1]
        fqn = names.get(w.name) if isinstance(w, fx.Node) else None
        if fqn is None or not fqn.endswith(".weight"):
            continue
        weight = value_of[w.name]
        bias_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        lin = nn.Linear(1, 1, bias=False, device="meta")
        lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
        lin.bias = (nn.Parameter(value_of[bias_node.name].detach(), requires_grad=False)
                    if isinstance(bias_node, fx.Node) else None)
        lin.out_features, lin.in_features = weight.shape
        shells[fqn[: -len(".weight")]] = lin
    return shells


class _PartitionedGraph:
    """Runs a partitioned Dynamo graph: its subgraphs in order, NPU ones on the INT8 engine.

    Lowering waits for the first call: Dynamo passes the parameters as graph inputs, and only a
    call has their real values (a recompilation's example inputs may be fake tensors)."""

    def __init__(self, gm: fx.GraphModule, partition, names: dict[str, str], options: dict,
                 counters: CompileCounters):
        self.gm, self.partition, self.names, self.options = gm, partition, names, options
        self.counters = counters
        self.out_spec = gm.graph.find_nodes(op="output")[0].args[0]
        self.steps = None
        self.eager = False

    def _lower(self, args) -> None:
        shells = _linear_shells(self.gm, args, self.names)
        o = self.options
        backend = backends.get(o.get("backend", backends.DEFAULT), engine=True).engine(
            shells, o["fingerprint"], 0, o["plans"], o.get("weights", "channel"))
        self.steps, self.shadow, _ = build_steps(self.partition, backend)

    def _run(self, *args):
        if self.steps is None:
            self._lower(args)
        values = dict(zip(self.partition.graph_inputs, args))
        for step in self.steps:
            values.update(step.run(values))
        return fx.node.map_arg(self.out_spec, lambda n: values[n.name])

    def __call__(self, *args):
        if not self.eager:
            try:
                with torch.no_grad():
                    out = self._run(*args)
                self.counters.npu_calls += 1
                return out
            except Exception as e:  # noqa: BLE001 - the fallback option decides
                if self.options.get("fallback", "error") == "error":
                    raise LlmNpuError(f"llmnpu: a partitioned graph failed at run time ({type(e).__name__}: {e}); "
                                      f"compile_options(..., fallback='eager') runs such graphs unquantized "
                                      f"instead") from e
                warnings.warn(f"llmnpu: a compiled graph failed ({type(e).__name__}: {e}); it runs eagerly "
                              f"(unquantized) from now on", stacklevel=2)
                self.eager = True
                self.counters.npu_graphs -= 1
                self.counters.eager_graphs += 1
        self.counters.eager_calls += 1
        return self.gm.forward(*args)


def llmnpu_backend(gm: fx.GraphModule, example_inputs: Sequence, options: dict | None = None):
    """The Dynamo backend (see the module docstring); ``options`` from ``compile_options``."""
    options = dict(options or {})
    unknown = set(options) - _KNOWN_OPTIONS
    if unknown:
        raise LlmNpuError(f"unknown llmnpu compile options {sorted(unknown)}: use "
                          f"options=llmnpu_delegate.compile.compile_options(model) (keys {sorted(_KNOWN_OPTIONS)})")
    if not {"linears", "plans", "fingerprint"} <= set(options):
        raise LlmNpuError("torch.compile(backend='llmnpu') needs the model's quantization plan: pass "
                          "options=llmnpu_delegate.compile.compile_options(model) (or quant='fp32' there)")
    _check_fallback(options.get("fallback", "error"))
    placement = backends.check_placement(backends.get(options.get("backend", backends.DEFAULT), engine=True),
                                         options.get("placement", PAPER))
    counters = options.get("counters")
    if not isinstance(counters, CompileCounters):
        counters = CompileCounters()
    plans: dict[str, LinearPlan] | None = options["plans"]
    names = {n.name: fqn for n in gm.graph.find_nodes(op="placeholder")
             if (fqn := _param_fqn(str(n.target))) is not None}
    found = set(linear_names(gm, options["linears"], "", names).values())
    if not found:
        counters.eager_graphs += 1
        return gm.forward                 # nothing for the NPU in this graph
    try:
        partition = partition_graph(gm, found, shadowed=[n for n, p in (plans or {}).items() if p.shadow],
                                    placement=placement, param_of_placeholder=names)
        if not partition.by_kind("npu"):
            raise LlmNpuError("no NPU region was formed")
    except Exception as e:  # noqa: BLE001 - an unsupported graph runs eagerly, never crashes
        warnings.warn(f"llmnpu: this graph is not supported ({type(e).__name__}: {e}); it runs eagerly",
                      stacklevel=2)
        counters.eager_graphs += 1
        return gm.forward
    counters.npu_graphs += 1
    return _PartitionedGraph(gm, partition, names, options, counters)


def register() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if NAME not in _COMPILER_FNS:
        register_backend(llmnpu_backend, name=NAME)
