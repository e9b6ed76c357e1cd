"""``llmnpu export``: a prepared engine's chunk program as one ``.pte`` and a sidecar JSON.

The ``.pte`` holds one method per subgraph of the partitioned chunk step:

- ``npu_<i>``: a static NPU subgraph (``npu_subgraphs.py``), lowered once and shared by every chunk:
  an HTP context binary (``qnn``) or XNNPACK INT8 kernels (``cpu-int8``), with our encodings; under a
  placement that puts more than the linears on the NPU, cpu-int8 writes the whole region
  (``graph_methods.py``);
- ``cpu_<i>``: a float CPU subgraph (``cpu_subgraphs.py``) on XNNPACK's float kernels (portable
  ones for the ops XNNPACK does not take): embedding, norms,
  RoPE, attention with its K/V (past length symbolic up to the artefact's context), the shadow
  outlier branches (sparse: the hot channels' rows only), lm_head. Subgraphs that compute the same
  program (``shared_methods.py``: attention, RoPE and activations repeat in every layer) share the
  method of the first of them;
- ``decode``: one token at any position (``decode_method.py``), on XNNPACK, INT8 or fp32.

Beside the ``.pte`` (``model.pte`` -> ``model.json``, ``model.rows.bin``, ``model.tokenizer/``):

- the sidecar holds what a runner needs besides the methods: the chunk length and context, the
  subgraph table in program order (method, inputs, outputs by name, processor, layer, shadow
  branches), the graph's input and output names, every NPU linear's activation scale, output
  scale(s) and split output channels, outlier threshold, hot and cold channels, the pruned layers,
  the subgraph profile for out-of-order scheduling, the decode method and its K/V layout, the
  tokenizer and its special ids;
- the cold rows file: the float rows of W^T of the shadowed linears' cold channels, read on demand
  when a cold channel crosses its threshold (the paper keeps them on disk likewise);
- the tokenizer files, so that a runner needs nothing else.

Everything is written to temporary names and renamed.
"""
from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from .. import backends
from ..errors import LlmNpuError
from ..format import kv as kv_format
from ..format.rows import PROGRAM_ROW_DTYPE, in_program, write_cold_rows
from ..format.npu_io import window_inputs
from ..format.sidecar import (
    ATTENTION_REGION,
    FORMAT,
    FORMS,
    GRAPH,
    NORM_REGION,
    VERSION,
    rows_path,
    sidecar_digest,
    sidecar_path,
    tokenizer_path,
)
from ..format.tasks import dependency_table
from ..partitioner.placement import parse_placement
from ..partitioner.regions import is_linear
from ..paths import atomic_path
from ..quantize.decode_outliers import hot_inputs
from . import decode_method as decode_step
from .attention_method import mask_value
from .attention_region import attention_region_shape, attention_rows, convert_attention_region
from .cpu_subgraphs import cold_channels, export_cpu_subgraph, program_hot_channels
from .embedding_head import quantize_dynamic
from .export_config import ExportConfig
from .graph_methods import check_program_placement, graph_method
from .lowering_pool import Claims, Spool, default_workers, run_jobs
from .lowering_shortcuts import lowering_shortcuts
from .npu_graph import holds_more_than_linears
from .norm_region import convert_norm_region, linear_inputs, norm_region_shape, region_peaks
from .npu_subgraphs import (
    Converted,
    convert_region,
    fine_outputs,
    lower_converted,
    output_groups,
    part_channels,
    region_spec,
    residual_writers,
)
from .program_writer import ProgramWriter, emit_method
from .shadow_branches import rows_in_program
from .shared_methods import program_key
from .xnnpack_forms import for_xnnpack

# The progress bar counts the export in units of one subgraph's lowering, so that its estimate of the
# time left covers the decode step too: it costs about this many per decoder block (``stage_seconds``
# of the embedded model's export: 1.9 s a subgraph, 211 s for the 30-block decode step)
DECODE_UNITS_PER_LAYER = 3.8


def method_name(sub) -> str:
    return f"{'npu' if sub.kind == 'npu' else 'cpu'}_{sub.index}"


def _examples(engine, ids: Tensor, row_steps: set[int], call_steps: set[int] = frozenset()
              ) -> tuple[dict[int, Tensor | list], dict[int, list]]:
    """The input rows of every chunk of the NPU subgraphs ``row_steps`` (integer regions: for their
    output encodings), every chunk's inputs of ``call_steps`` (attention regions: for RoPE's and
    their linears' encodings), and the shapes of every other subgraph's inputs at the third chunk (a
    past of two chunks: export must not specialise it).

    A CPU subgraph is traced, not calibrated (its INT8 head quantizes activations per token as it
    runs), so only the shapes of its inputs are kept (``_Like``), not a large model's gigabyte of
    values; the job makes zeros of them."""
    rows: dict[int, list[Tensor]] = {}
    calls: dict[int, list] = {}
    inputs = {}
    with torch.inference_mode():
        for chunk, i, args, _ in engine.program.run_in_order(engine.feeds(ids)):
            sub = engine.program.steps[i].sub
            if i in row_steps:
                rows.setdefault(i, []).append(args[0].reshape(-1, args[0].shape[-1]))
            elif i in call_steps:
                calls.setdefault(i, []).append([a.clone() if isinstance(a, Tensor) else a for a in args])
            elif chunk == 2:
                inputs[i] = [_Like(tuple(a.shape), a.dtype) if isinstance(a, Tensor) else a for a in args]
    # The engine's sparse shadow product is a scalar zero when no element crossed the threshold;
    # the .pte's dense one always has the linear's shape: trace with that shape.
    nodes = {n.name: n for n in engine.partition.graph_module.graph.nodes}
    for i, args in inputs.items():
        for j, (name, a) in enumerate(zip(engine.program.steps[i].sub.inputs, args)):
            val = nodes[name].meta.get("val")
            if isinstance(a, _Like) and isinstance(val, Tensor) and len(a.shape) != val.dim():
                args[j] = _Like(tuple(map(int, val.shape)), a.dtype)
    # ordinary tensors, not inference-mode ones: pt2e calibration needs them
    return {**{i: torch.cat(r).clone() for i, r in rows.items()}, **calls}, inputs


@dataclass(frozen=True)
class _Like:
    """An example input by its shape, made as zeros (contiguous: ExecuTorch refuses a zero stride)."""
    shape: tuple
    dtype: torch.dtype

    def make(self) -> Tensor:
        return torch.zeros(self.shape, dtype=self.dtype)


def _made(args: list) -> tuple:
    return tuple(a.make() if isinstance(a, _Like) else a for a in args)


def _encodings_by_linear(spec, encodings) -> dict[str, dict]:
    """Per linear: its output encoding (bits; scale and representable range of an integer one), each
    split channel group's own, and the second encodings of its parts that have one."""
    def fields(e):
        return {"bits": 32} if e is None else {"bits": e.bits, "scale": e.scale, "range": [e.low, e.high]}

    out = {name: {"output": fields(encodings[i]), "split_channels": [], "split_outputs": [], "fine_outputs": []}
           for i, name in enumerate(spec.names)}
    k = len(spec.names)
    for i in sorted(spec.splits):
        groups = spec.splits[i]
        out[spec.names[i]].update(split_channels=groups, split_outputs=[fields(e) for e in encodings[k:k + len(groups)]])
        k += len(groups)
    for f, e in zip(spec.fine, encodings[k:]):
        if abs(e.scale - f.scale) > 1e-6 * f.scale:
            raise LlmNpuError(f"{spec.method}: the fine output encoding of {spec.names[f.linear]} was not kept")
        out[spec.names[f.linear]]["fine_outputs"].append({"part": f.part, **fields(e)})
    return out


def _fine_share(engine, npu_outputs: dict) -> float:
    """The NPU multiply-adds the second encodings add, as a share of the program's."""
    total = extra = 0
    for name, o in npu_outputs.items():
        lin = engine.backend.linear(name)
        total += lin.out_features * lin.in_features
        extra += sum(len(part_channels(lin.out_features, o["split_channels"], f["part"])) for f in o["fine_outputs"]) \
            * lin.in_features
    return extra / total if total else 0.0


def export_pte(engine, out: str | Path, calib_ids: Tensor, config: ExportConfig = ExportConfig(),
               model: dict | None = None, tokenizer=None, workers: int | None = None, progress: bool = True,
               release_engine: bool = False) -> dict:
    """Write ``engine``'s chunk program and decode step as ``out`` (.pte) with the files beside it, as
    ``config`` says (target, SoC, context, shadow branch form, decode, NPU output bits); returns a summary.

    ``calib_ids``: calibration tokens (three chunks are used: they set the NPU outputs' encodings).
    ``model``: how to rebuild the engine (spec, blocks), recorded for ``validate``. ``tokenizer``:
    written beside the program. ``workers``: processes lowering methods side by side (default: one
    per core; ``lowering_pool.py``). ``stage_seconds`` in the summary add up the workers' time,
    ``seconds`` is the wall time. ``release_engine``: the caller runs no prompt on ``engine``
    afterwards, so its runtime is let go once the examples are taken (``Prefiller.release_runtime``):
    the workers share less memory.
    """
    from tqdm.auto import tqdm

    target, soc, shadow, decode = config.target, config.soc, config.shadow, config.decode
    context, output_bits = config.context_for(engine.context), config.bits
    _check_export_args(engine, context, calib_ids, target, output_bits)
    row_steps, call_steps = _integer_regions(engine, target)
    workers = default_workers() if workers is None else workers
    if not isinstance(workers, int) or workers < 1:
        raise LlmNpuError(f"workers must be a positive number of processes, got {workers!r}")
    c = engine.chunk_len
    t0 = time.perf_counter()
    rows, examples = _examples(engine, calib_ids[: 3 * c], row_steps, call_steps)
    # the calibration covers the whole model; the engine may hold its first blocks only (--blocks)
    hot = ({n: ch for n, ch in hot_inputs(engine.calibration, engine.quant.clip_percentile).items()
            if n in engine.plans} if decode == "int8" else {})
    if release_engine:
        engine.release_runtime()
    # the workers' results and the emitted methods wait on the program's own disk, not in a temporary
    # folder that may be RAM
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    claims, spool = Claims(), Spool(out.parent)
    state = _Export(engine, rows, examples, max(math.ceil(context / c) * c - c, 2 * c), target, soc, shadow, decode,
                    context, calib_ids, hot, claims, spool, output_bits, config.fine and output_bits == 8,
                    residual_writers(engine.plans) if config.residual_bits == 16 else frozenset())
    stages = dict.fromkeys(("examples", "npu_methods", "cpu_methods", "decode", "to_executorch", "write"), 0.0)
    stages["examples"] = time.perf_counter() - t0
    steps = engine.program.steps
    decode_units = math.ceil(DECODE_UNITS_PER_LAYER * engine.kv.layers)
    bar = tqdm(total=len(steps) + decode_units, desc=f"exporting ({target}, {workers} worker{'s' * (workers > 1)})",
               unit="unit", disable=not progress)
    results = {}
    # side by side, the decode step first: the longest job, so that the other workers' many short ones
    # fill around it; alone, last, so that the progress bar moves from the start
    units = _lowering_units(engine, target)
    jobs = [DECODE_JOB, *units] if workers > 1 else [*units, DECODE_JOB]
    with claims, spool, lowering_shortcuts():
        # each NPU subgraph's calibration rows wait on disk for its job: held here, they would sit in
        # the parent beside every worker (0.8 GiB for Qwen1.5-1.8B); run_jobs trims the freed heap
        state.rows = {i: spool.put(r, f"rows-{i}") for i, r in state.rows.items()}
        del rows
        for done in run_jobs(_lower_job, state, jobs, workers, spool=out.parent, weight=_job_weight):
            for r in done:
                results[r["job"]] = r
                for k, v in r["stages"].items():
                    stages[k] += v
                bar.update(decode_units if r["job"] == DECODE_JOB else 1)
                bar.set_postfix_str(f"{r['name']} done")
        # one method per distinct program, named after the first subgraph computing it; it runs on one
        # lane, and a lane runs one method at a time, so the subgraphs that share it never run at once
        writer, npu_outputs, table, method_of = ProgramWriter(), {}, [], {}
        for i, step in enumerate(steps):
            sub, r = step.sub, results[i]
            entry = {"index": sub.index, "method": method_name(sub), "kind": sub.kind, "processor": sub.processor,
                     "layer": sub.layer, "static": sub.static, "inputs": sub.inputs, "outputs": sub.outputs,
                     "linears": sub.linears, **r["entry"]}
            if r["key"] is not None:
                entry["method"] = method_of.setdefault(r["key"], entry["method"])
            npu_outputs.update(r["npu_outputs"])
            table.append(entry)
        for i in range(len(steps)):
            if results[i]["method"] is not None:
                writer.add(spool.take(results.pop(i)["method"]), name=table[i]["method"])
        writer.add(spool.take(results.pop(DECODE_JOB)["method"]))
        backends.get(target).join(writer.delegates)
    bar.set_postfix_str(f"writing {len(writer.methods)} methods")
    with _timed(stages, "write"):
        tok_meta = _write_tokenizer(tokenizer, tokenizer_path(out)) if tokenizer is not None else None
        written = writer.write(out)
        shadow_meta = {"form": "dense"}
        if shadow == "sparse":      # the rows the program holds are not written again (``shadow_branches.rows_in_program``)
            blocks = _cold_blocks(engine)
            shadow_meta = write_cold_rows(blocks, rows_path(out), PROGRAM_ROW_DTYPE,
                                          rows_in_program(blocks, written["named_data"]))
        if "rows_file" not in shadow_meta:
            rows_path(out).unlink(missing_ok=True)      # an earlier export's, which nothing would read
        meta = _sidecar(engine, target, soc, context, table, npu_outputs, model, out, written)
        meta.update(export=config.to_dict(), shadow=shadow_meta, tokenizer=tok_meta,
                    decode=kv_format.describe(decode, engine.kv, context, hot))
        meta["sidecar_sha256"] = sidecar_digest(meta)
        with atomic_path(sidecar_path(out)) as tmp:
            tmp.write_text(json.dumps(meta, indent=1))
    bar.close()
    return {"pte": str(out), "sidecar": str(sidecar_path(out)), "pte_bytes": written["bytes"],
            "sidecar_bytes": sidecar_path(out).stat().st_size, "target": target,
            "soc": soc if backends.get(target).uses_soc else None,
            "npu_methods": sum(e["kind"] == "npu" for e in table),
            "npu_contexts": writer.payloads(e["method"] for e in table if e["kind"] == "npu"),
            "npu_graphs": sum(e.get("form") in FORMS for e in table),
            "npu_forms": {f: sum(e.get("form") == f for e in table) for f in FORMS},
            "cpu_methods": len({e["method"] for e in table if e["kind"] != "npu"}),
            "cpu_subgraphs": sum(e["kind"] != "npu" for e in table),
            "decode": decode, "decode_hot_linears": len(hot), "chunk_len": c, "context": context,
            "output_bits": output_bits, "placement": engine.config.placement,
            "fine_outputs": sum(len(o["fine_outputs"]) for o in npu_outputs.values()),
            "peak_products": sum("peak" in o for o in npu_outputs.values()),
            "fine_npu_share": round(_fine_share(engine, npu_outputs), 4),
            "wide_linears": len(state.wide),
            "shadow": shadow_branch_work(engine, shadow), "rows_bytes": shadow_meta.get("bytes", 0),
            "rows_in_program": sum(in_program(lin) for lin in shadow_meta.get("linears", {}).values()),
            "rows_linears": len(shadow_meta.get("linears", {})),     # the decode's shadow paths too
            "tokenizer": tok_meta["folder"] if tok_meta else None, "workers": workers,
            "seconds": round(time.perf_counter() - t0, 1),
            "stage_seconds": {k: round(v, 1) for k, v in stages.items()}}


DECODE_JOB = -1


def _lowering_units(engine, target: str) -> list:
    """The program's steps as lowering jobs: a step's index, or on a backend that shares contexts
    (``shares_contexts``: QNN) the NPU steps of one decoder block as a tuple, lowered in one call into
    one context, which the runtime then loads once for all of them (ExecuTorch's Qualcomm llama
    holds its graphs in one context likewise). One context per block, not one for the whole program:
    the blocks still lower side by side, and a context's graphs are the ones that run together."""
    units, blocks = [], {}
    shared = backends.get(target).shares_contexts
    for i, step in enumerate(engine.program.steps):
        sub = step.sub
        if shared and sub.kind == "npu" and sub.layer is not None:
            if sub.layer not in blocks:
                blocks[sub.layer] = []
                units.append(blocks[sub.layer])
            blocks[sub.layer].append(i)
        else:
            units.append(i)
    return [tuple(u) if isinstance(u, list) else u for u in units]


def _job_weight(job) -> int:
    """A job's share of a worker's batch (``run_jobs``): one per method it lowers."""
    return len(job) if isinstance(job, tuple) else 1


@dataclass
class _Export:
    """What every lowering job reads (in forked workers: the parent's copy, never written)."""
    engine: object
    rows: dict              # NPU subgraph -> its calibration rows' file in the spool
    examples: dict
    max_past: int
    target: str
    soc: str
    shadow: str
    decode: str
    context: int
    calib_ids: Tensor
    hot: dict
    claims: Claims          # program keys already being lowered (shared by the workers)
    spool: Spool            # where each emitted method waits for the program to be written
    output_bits: int        # the NPU methods' outputs: 8 or 32 (float), ``npu_subgraphs.py``
    fine: bool              # 8-bit outputs held poorly by one encoding get a second one
    wide: frozenset         # linears whose input and output are 16-bit (``ExportConfig.residual_bits``)


def _lower_job(x: _Export, job) -> list[dict]:
    """Lower and emit the methods of one job (``_lowering_units``): the decode step, one subgraph of
    the program, or one block's NPU subgraphs lowered together (one context). Returns a result per
    subgraph."""
    if job == DECODE_JOB:
        return [_lower_decode(x)]
    steps = job if isinstance(job, tuple) else (job,)
    done = [_lower_step(x, i) for i in steps]
    converted = [lowered for _, lowered in done if isinstance(lowered, Converted)]
    if converted:
        with _timed(done[0][0]["stages"], "npu_methods"):
            edge = lower_converted(converted, x.target, x.soc)
        done = [(out, edge.exported_program(out["name"]) if isinstance(lowered, Converted) else lowered)
                for out, lowered in done]
    for out, lowered in done:
        if lowered is not None:
            with _timed(out["stages"], "to_executorch"):
                out["method"] = x.spool.put(emit_method(out["name"], lowered), out["name"])
    return [out for out, _ in done]


def _lower_decode(x: _Export) -> dict:
    from executorch.exir.passes import MemoryPlanningPass

    stages: dict[str, float] = {}
    out = {"job": DECODE_JOB, "name": kv_format.METHOD, "stages": stages, "entry": {}, "npu_outputs": {},
           "key": None, "method": None}
    with _timed(stages, "decode"):
        # float-output NPU methods pad their linears; the decode's INT8 linears match them byte for byte
        pad = ([n for step in x.engine.program.steps if step.sub.kind == "npu" for n in step.sub.linears]
               if x.output_bits == 32 else [])
        lowered = decode_step.export_decode(x.engine.model, x.engine.kv, x.context, x.decode, x.calib_ids,
                                            x.hot, pad, _shadowed(x.engine)).exported_program("forward")
    with _timed(stages, "to_executorch"):
        # the decode step's K/V caches stay in the runner's memory: no copy into planned buffers per step
        out["method"] = x.spool.put(emit_method(kv_format.METHOD, lowered, MemoryPlanningPass(alloc_graph_input=False)),
                                    kv_format.METHOD)
    return out


def _lower_step(x: _Export, job: int) -> tuple[dict, object]:
    """Subgraph ``job``'s result and its method: lowered (an edge program), ready to lower with the
    others of its job (``Converted``), or None for a CPU subgraph whose program another job has
    claimed (``shared_methods.py``)."""
    stages: dict[str, float] = {}
    out = {"job": job, "stages": stages, "entry": {}, "npu_outputs": {}, "key": None, "method": None}
    sub = x.engine.program.steps[job].sub
    out["name"] = name = method_name(sub)
    with _timed(stages, "npu_methods" if sub.kind == "npu" else "cpu_methods"):
        if job in x.rows and holds_more_than_linears(sub) and attention_region_shape(x.engine.partition, sub):
            lowered = _convert_attention_region(x.engine, sub, name, Spool.take(x.rows[job]),
                                                x.max_past + x.engine.chunk_len, out["entry"], out["npu_outputs"],
                                                x.fine, x.wide)
        elif job in x.rows and holds_more_than_linears(sub):
            lowered = _convert_norm_region(x.engine, sub, name, Spool.take(x.rows[job]), out["entry"],
                                           out["npu_outputs"], x.fine)
        elif sub.kind == "npu" and holds_more_than_linears(sub):
            lowered = graph_method(x.engine, sub, _made(x.examples[job]), x.max_past)
            out["entry"]["form"] = GRAPH
            out["npu_outputs"] = {n: {"output": {"bits": 32}, "split_channels": [], "split_outputs": [],
                                      "fine_outputs": []} for n in sub.linears}
        elif sub.kind == "npu":
            rows = Spool.take(x.rows[job])
            lowered = _convert_npu(x.engine, sub, name, rows, x.target, out["entry"], out["npu_outputs"],
                                   x.output_bits, x.fine, x.wide)
        else:
            example = _made(x.examples[job])
            ep, branches = export_cpu_subgraph(x.engine.partition, sub, x.engine.plans, "model.", example,
                                               x.max_past, x.shadow, half_table=x.decode == "int8")
            if branches:
                out["entry"]["shadow"] = branches
            out["key"] = (sub.processor, program_key(ep))
            lowered = (_lower_cpu(ep, sub, example, int8_head=x.decode == "int8")
                       if x.claims.first(out["key"]) else None)
    return out, lowered


@contextmanager
def _timed(stages: dict, key: str):
    t = time.perf_counter()
    yield
    stages[key] = stages.get(key, 0.0) + time.perf_counter() - t


def _check_export_args(engine, context: int, calib_ids: Tensor, target: str, output_bits: int) -> None:
    """What the config cannot check alone: it against the engine, and the calibration's length."""
    if engine.plans is None:
        raise LlmNpuError("export writes INT8 NPU subgraphs: prepare the engine with a quantized mode "
                          "(w8a8-shadow or w8a8), not fp32")
    check_program_placement(parse_placement(engine.config.placement), target, output_bits)
    if not isinstance(context, int) or not engine.chunk_len <= context <= engine.context:
        raise LlmNpuError(f"context must be an integer in {engine.chunk_len}..{engine.context} "
                          f"(chunk length .. the model's context), got {context!r}")
    need = 3 * engine.chunk_len
    if calib_ids.numel() < need:
        raise LlmNpuError(f"export needs at least {need} calibration tokens (three chunks), got {calib_ids.numel()}")


def _integer_regions(engine, target: str) -> tuple[set[int], set[int]]:
    """The steps whose input rows export keeps (linears-only NPU subgraphs, and on QNN the regions of
    a norm and its linears), and those whose every input it keeps (on QNN, RoPE -> attention ->
    linears). A QNN region that is neither is refused in one line."""
    rows, calls = set(), set()
    for i, step in enumerate(engine.program.steps):
        sub = step.sub
        if sub.kind != "npu":
            continue
        if not holds_more_than_linears(sub):
            rows.add(i)
        elif target == "qnn":
            if norm_region_shape(engine.partition, sub) is not None:
                rows.add(i)
            elif attention_region_shape(engine.partition, sub) is not None:
                calls.add(i)
            else:
                raise LlmNpuError(f"placement {engine.config.placement}: NPU subgraph {sub.index} (layer {sub.layer}) is "
                                  f"neither a block norm feeding linears nor (q/k norms ->) RoPE -> attention -> "
                                  f"linears, the regions a QNN program writes (a softcapped attention is not): "
                                  f"export --placement paper")
    return rows, calls


def _output_parts(engine, name: str, sub, linears: list, rows, flavour: str, output_bits: int, fine: bool,
                  wide: frozenset[str] = frozenset()):
    """The region's ``RegionSpec``: split channel groups and second encodings chosen on what each
    linear reads (``rows[j]``, a list or a dict by linear index). Per-tensor weight scales would
    change if a linear were cut in two: split only per-channel ones; float outputs have no encoding
    to split; 16-bit ones (``wide``) need no second."""
    splits = ({j: output_groups(lin, rows[j]) for j, lin in enumerate(linears)}
              if engine.backend.weights == "channel" and output_bits == 8 else {})
    twins = ({j: fine_outputs(lin, rows[j], splits.get(j, []), flavour) for j, lin in enumerate(linears)
              if sub.linears[j] not in wide} if fine and output_bits == 8 else {})
    return region_spec(name, sub.linears, engine.plans, splits, twins, flavour)


def _convert_norm_region(engine, sub, name: str, rows: Tensor, entry: dict, npu_outputs: dict, fine: bool):
    """A norm and the linears it feeds as one HTP method (``norm_region.py``), ready to lower; records
    its form, norm input encoding and linears' outputs in ``entry`` and their encodings in ``npu_outputs``."""
    shape = norm_region_shape(engine.partition, sub)
    enc = engine.program.npu.norms[shape.norm]
    rows = enc.x.round(rows)
    linears = [engine.backend.linear(n) for n in sub.linears]
    reads = linear_inputs(rows, shape, enc, region_spec(name, sub.linears, engine.plans))
    peaks = region_peaks(shape, enc, sub.linears, linears, engine.plans)
    spec = replace(_output_parts(engine, name, sub, linears, reads, "qnn", 8, fine), peaks=sorted(peaks))
    converted, encodings = convert_norm_region(shape, enc, linears, spec, engine.plans, engine.backend.weights, rows,
                                               engine.chunk_len, peaks)
    npu_outputs.update(_encodings_by_linear(spec, encodings))
    for i, peak in peaks.items():
        npu_outputs[sub.linears[i]]["peak"] = _peak_entry(peak)
    entry.update(form=NORM_REGION, input_groups=spec.groups, linear_outputs=shape.linear_outputs,
                 norm=_norm_entry(shape.norm, enc))
    return converted


def _peak_entry(peak) -> dict:
    """A linear's peak product as the sidecar records it: the method returns it after the linears'
    parts and a runner adds it (``RegionSpec.peaks``); the channels, clip and grids are what the
    ``qnn`` mode computes it with."""
    def grid(e):
        return {"scale": e.scale, "zero": e.zero, "bits": e.bits}
    return {"channels": peak.channels.tolist(), "clip": peak.clip, "residue": grid(peak.residue), "out": grid(peak.out)}


def _norm_entry(key: tuple[int, str], enc) -> dict:
    """A norm the program runs on the NPU as the sidecar records it (``program_numerics.norm_encodings``
    reads it back)."""
    return {"layer": key[0], "name": key[1], **{k: {"scale": e.scale, "zero": e.zero, "bits": e.bits}
                                                 for k, e in (("x", enc.x), ("weight", enc.weight), ("out", enc.out))}}


def _convert_attention_region(engine, sub, name: str, calls: list, window: int, entry: dict, npu_outputs: dict,
                              fine: bool, wide: frozenset[str]):
    """RoPE, attention and the linears it feeds as one HTP method (``attention_region.py``),
    calibrated on the export's chunks, ready to lower; records its form, window, mask and encodings and its linears'
    outputs in ``entry`` and their encodings in ``npu_outputs``."""
    shape = attention_region_shape(engine.partition, sub)
    enc = engine.program.npu.attention[shape.layer]
    norms = {role: engine.program.npu.norms[key] for role, key in shape.norms.items()}
    heads = engine.model.config.num_attention_heads
    masked = mask_value(enc)
    calib = [window_inputs(sub.inputs, args, shape.past, shape.mask, window, masked, heads) for args in calls]
    linears = [engine.backend.linear(n) for n in sub.linears]
    spec = None
    if linears:
        reads = region_spec(name, sub.linears, engine.plans).linear_reads(
            attention_rows(engine.partition, sub, shape, enc, calib))
        spec = _output_parts(engine, name, sub, linears, reads, "qnn", 8, fine, wide)
        entry["input_groups"] = spec.groups
    converted, encodings = convert_attention_region(name, engine.partition, sub, shape, enc, norms, linears, spec,
                                                    engine.plans, engine.backend.weights, calib, wide)
    if spec is not None:
        npu_outputs.update(_encodings_by_linear(spec, encodings))
    codes = {k: {"scale": e.scale, "zero": e.zero, "bits": e.bits, "signed": e.signed}
             for k, e in (("q", enc.q), ("k", enc.k), ("v", enc.v), ("scores", enc.scores), ("out", enc.out))}
    entry.update(form=ATTENTION_REGION, linear_outputs=shape.linear_outputs,
                 attention={"layer": shape.layer, "past": list(shape.past), "present": list(shape.present),
                            "mask": shape.mask, "window": window, "mask_value": masked, "heads": heads,
                            "encodings": codes,
                            "norms": {role: _norm_entry(key, norms[role]) for role, key in shape.norms.items()}})
    return converted


def _convert_npu(engine, sub, name: str, rows: Tensor, target: str, entry: dict, npu_outputs: dict,
                 output_bits: int, fine: bool, wide: frozenset[str]):
    """An NPU region as the target's method, ready to lower; records its input groups in ``entry`` and its outputs'
    encodings in ``npu_outputs``."""
    linears = [engine.backend.linear(n) for n in sub.linears]
    spec = _output_parts(engine, name, sub, linears, [rows] * len(linears), backends.get(target).encodings,
                         output_bits, fine, wide)
    converted, encodings = convert_region(spec, linears, engine.plans, engine.backend.weights, rows,
                                          engine.chunk_len, target, output_bits, wide)
    npu_outputs.update(_encodings_by_linear(spec, encodings))
    entry["input_groups"] = spec.groups
    return converted


def _lower_cpu(ep, sub, example: tuple, int8_head: bool):
    """A CPU subgraph's exported program as a float method (XNNPACK where it helps); the LM head as
    the decode's dynamic INT8 linear if ``int8_head`` (``embedding_head.py``)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    # XNNPACK's float kernels where it takes the ops (attention with its symbolic past too: 2.2x
    # faster than the portable kernels at a past of 512 on Qwen2-0.5B shapes), portable ones
    # elsewhere. A float LM head stays off XNNPACK, which would pack its own float32 copy of a weight
    # tied to the embedding table (+108 MiB on the embedded model); ``aten.linear`` is kept whole
    # there: decomposed, it becomes permute_copy + mm, a transposed copy of the whole weight at
    # every call (162 ms vs 11 ms for the embedded model's lm_head)
    if _holds_model_linear(sub) and int8_head:
        ep = quantize_dynamic(ep.module(), [example])
    elif _holds_model_linear(sub):
        edge = to_edge_transform_and_lower(ep, partitioner=[], compile_config=EdgeCompileConfig(
            _check_ir_validity=False, preserve_ops=[torch.ops.aten.linear.default]))
        return edge.exported_program("forward")
    for_xnnpack(ep.graph_module)
    return to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).exported_program("forward")


def _holds_model_linear(sub) -> bool:
    return sub.kind == "cpu" and any(is_linear(n) for n in sub.nodes)


def _shadowed(engine) -> list[str]:
    return [n for n, p in engine.plans.items() if p.shadow]


def _cold_blocks(engine) -> dict:
    """Per shadowed linear: its weight, the input channels whose rows stay out of the program, its clip."""
    blocks = {}
    for name in _shadowed(engine):
        w = engine.backend.linear(name).weight
        blocks[name] = (w, cold_channels(engine.plans[name], w.shape[1]), engine.plans[name].clip)
    return blocks


def _write_tokenizer(tokenizer, folder: Path) -> dict:
    with atomic_path(folder) as tmp:
        tokenizer.save_pretrained(tmp)
    eos = tokenizer.eos_token_id
    return {"folder": folder.name, "files": sorted(p.name for p in folder.iterdir()),
            "bos_id": tokenizer.bos_token_id, "eos_ids": [eos] if isinstance(eos, int) else list(eos or []),
            "chat_template": getattr(tokenizer, "chat_template", None)}


def shadow_branch_work(engine, form: str) -> dict:
    """Float work and float weight bytes of the shadow branches per chunk: ``dense`` (the whole linear
    on the residue) and the program's own ``form``. Cold products (data-dependent, from the rows file)
    are not counted here: the runner counts them (``PteRunner.cold_rows``); nor are the peak products
    an NPU graph computes (placement piece ``peak``)."""
    m, dense_flops, sparse_flops, dense_bytes, sparse_bytes = engine.chunk_len, 0, 0, 0, 0
    on_cpu = [n for s in engine.partition.by_kind("shadow") for n in s.linears]
    for name in on_cpu:
        n, k = engine.backend.linear(name).weight.shape
        h = program_hot_channels(engine.plans[name]).numel()
        dense_flops += 2 * m * k * n
        sparse_flops += 2 * m * h * n
        dense_bytes += 4 * n * k
        sparse_bytes += 4 * n * h
    return {"form": form, "linears": len(on_cpu),
            "flops_per_chunk": {"dense": dense_flops, "sparse": sparse_flops},
            "program_weight_bytes": {"dense": dense_bytes, "sparse": sparse_bytes}}


def _sidecar(engine, target, soc, context, table, npu_outputs, model, out: Path, pte: dict) -> dict:
    plans, quant = engine.plans, engine.quant
    linears = {}
    for name, outputs in npu_outputs.items():
        p = plans[name]
        linears[name] = {"act_scale": p.act_scale, **outputs, "shadow": p.shadow, "clip": p.clip,
                         "hot_channels": p.hot.tolist() if p.hot is not None else []}
    pruned = sorted(n for n in npu_outputs if quant.outliers == "shadow" and not plans[n].shadow)
    partition, kv = engine.partition, engine.kv
    profile = engine.profile
    return {
        "format": FORMAT, "version": VERSION,
        "pte": out.name, "pte_sha256": pte["sha256"], "pte_bytes": pte["bytes"],
        "target": target, "soc": soc if backends.get(target).uses_soc else None,
        "model": {**(model or {}), "fingerprint": engine.fingerprint, "layers": kv.layers, "kv_heads": kv.kv_heads,
                  "head_dim": kv.head_dim, "vocab_size": engine.model.config.vocab_size},
        "chunk_len": engine.chunk_len, "context": context,
        "quant": quant.to_dict(), "placement": engine.config.placement,
        "graph": {"inputs": partition.graph_inputs, "outputs": partition.graph_outputs},
        "subgraphs": table,
        "tasks": dependency_table(engine.program),
        "linears": linears,
        "pruned_layers": pruned,
        # seconds per subgraph measured on the host's cpu-int8 engine: relative costs for the scheduler
        "profile": {"static": profile.static, "dynamic": profile.dynamic} if profile else None,
    }
