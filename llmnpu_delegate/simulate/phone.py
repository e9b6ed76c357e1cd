"""A phone prefill, simulated: the real partition, the real shadow plan, the real scheduler, priced
by a device profile.

``Scenario`` is what a model and its quantization make: the partitioned chunk step and the outlier
share of each shadowed linear. The embedded model (or any model loaded with its weights) gets its
own calibrated plan; a shapes-only model (``random:<shape>``: the paper's 7B models do not fit in
RAM here) gets the embedded model's plan carried over by depth and role (layer l of L takes the
decision and outlier share of the embedded model's layer at the same relative depth, q/k/v from
q/k/v, and so on): random weights have no outliers of their own.

``simulate_prefill`` builds the task graph of a prompt with ``format.tasks`` and drives the very
``Scheduler`` the threaded executor uses through ``runtime.schedule.simulate``, each task taking the
cost model's time. Energy integrates each processor's busy and idle power over the timeline.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from torch import fx, nn

from ..chunk_step import DEFAULT_CHUNK, export_chunk_step, kv_shape, max_context
from ..errors import LlmNpuError
from ..evaluate import eval_windows, run_quantized
from ..families import role_of
from ..format.tasks import build_tasks
from ..models import DEFAULT_MODEL, load_model, model_skeleton
from ..partitioner.placement import PAPER, Placement, parse_placement
from ..partitioner.regions import Partition, partition_graph, shadow_paths
from ..prepare import default_calibration
from ..quantize import Calibration, QuantConfig, ShadowCost, auto, plan_linears, quant_config, quantizable_linears
from ..runtime.engine import PRUNING_PROMPT, choose_host_pruning
from ..runtime.program import ChunkProgram, Step
from ..runtime.schedule import POLICIES, PROCESSORS, RunStats, assign_costs, check_policy, simulate
from ..runtime.trace import metrics, step_label, write_timeline, write_trace
from ..text import read_text, tokenize
from . import cost
from .device import Device, load_device
from .programs import Program

QUANT_MODES = ("w8a8-shadow", "w8a8")   # the NPU runs INT8 graphs; float linears are not simulated


@dataclass
class Scenario:
    model: str
    partition: Partition
    program: ChunkProgram
    chunk: int
    context: int
    outlier_rate: dict[str, float]      # shadowed linear -> share of its input elements that are outliers
    plan_source: str                    # where the shadow decisions come from
    pruning_rate: float | None
    step: fx.GraphModule | None = None  # the exported chunk step the partition cut (to cut it again)
    linears: tuple = ()                 # its quantizable linears
    kv_layers: int = 0

    @property
    def shadowed(self) -> int:
        return len(self.outlier_rate)


def _role(name: str) -> str:
    """A linear's role in its block (``qkv``, ``o``, ``up``, ``down``), across the families' names."""
    return role_of(name) or name.rsplit(".", 1)[-1]


def _layer(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else 0


def carry_over(source: dict[str, float], source_layers: int, target: list[str], target_layers: int) -> dict[str, float]:
    """The shadow plan ``source`` (shadowed linear -> outlier share) of a ``source_layers``-block model,
    carried to the linears ``target`` of a ``target_layers``-block one by relative depth and role."""
    by_place: dict[tuple[int, str], list[float]] = {}
    for name, rate in source.items():
        by_place.setdefault((_layer(name), _role(name)), []).append(rate)
    out = {}
    for name in target:
        layer = round(_layer(name) * (source_layers - 1) / max(target_layers - 1, 1))
        rates = by_place.get((layer, _role(name)))
        if rates:
            out[name] = sum(rates) / len(rates)
    return out


_embedded: dict = {}


def embedded_plan(quant: QuantConfig, progress: bool) -> tuple[dict[str, float], float | None, int]:
    """The embedded model's shadow plan (``model_plan``) and its block count. Kept per quantization
    config for the process (a sweep asks for it many times)."""
    key = repr(quant)
    if key not in _embedded:
        lm = _embedded.get("model") or load_model(DEFAULT_MODEL)
        _embedded["model"] = lm
        _embedded[key] = (*model_plan(lm, quant, progress), lm.model.config.num_hidden_layers)
    return _embedded[key]


def model_plan(lm, quant: QuantConfig, progress: bool) -> tuple[dict[str, float], float | None]:
    """Shadowed linear -> calibrated outlier share, and the pruning rate that chose them (an
    automatic rate resolved to the one it picked for ``quant.pruning_target``)."""
    calib = default_calibration(lm, progress)
    choose_pruning(lm, calib, quant, progress)
    plans = plan_linears(lm.model, calib, quant, lm.fingerprint, progress)
    rates = {name: calib.layers[name].outlier_fraction(quant.clip_percentile) for name, p in plans.items() if p.shadow}
    return rates, auto.resolve(quant, calib).pruning_rate


def soc_shadow_prices(scn: Scenario, soc: str, prompt_len: int = PRUNING_PROMPT) -> ShadowCost:
    """What each shadow path of ``scn`` (planned with every path) costs the predicted ``ooo`` prefill of a
    ``prompt_len``-token prompt on ``soc``: the automatic pruning's prices for a phone."""
    device = load_device(soc)
    chunks = math.ceil(min(prompt_len, scn.context) / scn.chunk)
    seconds = {}
    for sub in scn.partition.subgraphs:
        for name in shadow_paths(sub.nodes):
            if name in scn.outlier_rate:
                without = {k: v for k, v in scn.outlier_rate.items() if k != name}
                seconds[name] = (cost.seconds(sub, 0, device, scn.outlier_rate) - cost.seconds(sub, 0, device, without))

    # merged on the NPU, a path splits no graph: its linear's output ends one already (``npu_regions``)
    merged_on_npu = scn.partition.placement.on_npu("merge")

    def makespan(kept: frozenset) -> float:
        # an in-graph peak product (piece ``peak``) is not the CPU's to prune: it is always kept
        rates = {k: v for k, v in scn.outlier_rate.items() if k in kept or k not in seconds}
        kept_scn = with_shadowed(scn, rates) if merged_on_npu else dataclasses.replace(scn, outlier_rate=rates)
        tasks = build_tasks(kept_scn.program, chunks)
        assign_costs(tasks, step_costs(kept_scn, device, chunks))
        return simulate(tasks, "ooo").wall_s

    return ShadowCost(soc, seconds, makespan)


def choose_pruning(lm, calib: Calibration, quant: QuantConfig | None, progress: bool = True) -> None:
    """Make the automatic pruning choice of ``quant`` for whichever target it names, unless it is made
    (cached in ``calib``). For a phone SoC: ``lm`` planned with every shadow path and partitioned at
    the default chunk length, its paths priced by the SoC's device model (``soc_shadow_prices``).
    For ``host``: the engine's own choice (``runtime.engine.choose_host_pruning``). A SoC target may
    name the placement the paths are priced under (``pruning_target``)."""
    if quant is None or not auto.needs_choice(calib, quant):
        return
    if quant.pruning_target == "host":
        return choose_host_pruning(lm, calib, quant, progress)
    soc, placement = split_target(quant.pruning_target)
    unpruned = dataclasses.replace(quant, pruning_rate=0.0)
    plans = plan_linears(lm.model, calib, unpruned, lm.fingerprint, progress)
    rates = {name: calib.layers[name].outlier_fraction(quant.clip_percentile) for name, p in plans.items() if p.shadow}
    scn = _scenario(lm.model, str(lm.fingerprint), min(DEFAULT_CHUNK, max_context(lm.model.config)), rates,
                    "unpruned", 0.0, placement)
    plan_linears(lm.model, calib, quant, lm.fingerprint, progress, soc_shadow_prices(scn, soc))


def pruning_target(soc: str, placement: "Placement | str" = PAPER) -> str:
    """The ``QuantConfig.pruning_target`` of a program for ``soc`` with ``placement``."""
    placement = parse_placement(placement)
    return soc if placement == parse_placement(PAPER) else f"{soc}:{placement.name}"


def split_target(target: str) -> tuple[str, Placement]:
    soc, _, placement = target.partition(":")
    load_device(soc)
    return soc, parse_placement(placement or PAPER)


def prepare(model: str, chunk: int, quant: str = "w8a8-shadow", pruning_rate: float | None = None,
            placement: "Placement | str" = PAPER, progress: bool = True, plan: dict[str, float] | None = None,
            soc: str = "SM8650") -> Scenario:
    """Partition ``model``'s chunk step with ``placement`` and attach its shadow plan (``plan``
    overrides it: tests). An automatic pruning is the one chosen for ``soc`` and that placement."""
    placement = parse_placement(placement)
    if quant not in QUANT_MODES:
        raise LlmNpuError(f"simulate runs INT8 NPU graphs: --quant must be one of {', '.join(QUANT_MODES)}, got '{quant}'")
    config = quant_config(quant, pruning_rate)
    if auto.is_auto(config):
        config = dataclasses.replace(config, pruning_target=pruning_target(soc, placement))
    lm = None
    if model.startswith("random:") or Path(model).is_dir():
        net: nn.Module = model_skeleton(model)
    else:
        lm = load_model(model)
        net = lm.model
    rate = config.pruning_rate if config.outliers == "shadow" else None
    if config.outliers != "shadow":
        rates, source = {}, "none (w8a8: no shadow paths)"
    elif plan is not None:
        rates, source = dict(plan), "given"
    elif lm is not None:
        (rates, rate), source = model_plan(lm, config, progress), f"{model}'s own calibration"
    else:
        base, rate, base_layers = embedded_plan(config, progress)
        rates = carry_over(base, base_layers, list(quantizable_linears(net)), net.config.num_hidden_layers)
        source = f"{DEFAULT_MODEL}'s calibration, carried over by depth and role"
    return _scenario(net, model, chunk, rates, source, rate, placement)


def _scenario(net: nn.Module, model: str, chunk: int, rates: dict[str, float], source: str,
              rate: float | None, placement: Placement) -> Scenario:
    """``net``'s chunk step partitioned with ``placement`` and the linears of ``rates`` shadowed."""
    step = export_chunk_step(net, chunk).module()
    scn = Scenario(model, None, None, chunk, max_context(net.config), rates, source, rate, step,
                   tuple(quantizable_linears(net)), kv_shape(net.config).layers)
    return with_shadowed(scn, rates, placement)


def with_shadowed(scn: Scenario, rates: dict[str, float], placement: Placement | None = None) -> Scenario:
    """``scn`` with the shadow paths of ``rates`` only, its step cut again (with ``placement``, or its
    own): where a shadow product merges on the NPU, a path ends one NPU graph and starts the next."""
    placement = placement or scn.partition.placement
    partition = partition_graph(scn.step, scn.linears, shadowed=list(rates), placement=placement, prefix="model.")
    rates = {k: v for k, v in rates.items() if k in partition.shadowed}
    program = ChunkProgram([Step(s, None) for s in partition.subgraphs], partition.graph_outputs, scn.chunk,
                           scn.kv_layers)
    return dataclasses.replace(scn, partition=partition, program=program, outlier_rate=rates)


def window(scn: Scenario, chunks: int, past: int = 0) -> int:
    """The fixed K/V window of a program exported for this prompt: its past and its chunks."""
    return min(past + chunks * scn.chunk, scn.context)


def step_costs(scn: Scenario, device: Device, chunks: int, past: int = 0, fine_share: float = 0.0,
               program: Program = cost.OURS) -> dict:
    """``Profile.costs``-shaped seconds: per step for static subgraphs, per (step, chunk) for dynamic ones
    (chunk i of a prompt after ``past`` tokens attends over ``past + i * chunk`` earlier keys on the
    CPU, over the fixed ``window`` on the NPU). ``fine_share``: of the NPU outputs computed twice
    (``cost.npu_seconds``)."""
    costs: dict = {}
    keys = window(scn, chunks, past)
    for j, step in enumerate(scn.program.steps):
        if step.static:
            costs[j] = cost.seconds(step.sub, 0, device, scn.outlier_rate, fine_share, program, keys)
        else:
            for i in range(chunks):
                costs[(j, i)] = cost.seconds(step.sub, past + i * scn.chunk, device, scn.outlier_rate, fine_share,
                                             program, keys)
    return costs


def lane_seconds(scn: Scenario, device: Device, chunks: int, past: int = 0, fine_share: float = 0.0,
                 program: Program = cost.OURS) -> dict:
    """What each processor's busy time is made of over the prompt's tasks (``format.tasks``: a chunk
    runs only the steps its successors need): the NPU's graph launches and its GEMMs with their
    traffic (``cost.NPU_PARTS``), the CPU's time per op kind (``cost.cpu_kind``)."""
    npu = dict.fromkeys(cost.NPU_PARTS, 0.0)
    cpu: dict[str, float] = {}
    keys = window(scn, chunks, past)
    for task in build_tasks(scn.program, chunks):
        sub = scn.program.steps[task.step].sub
        p = 0 if scn.program.steps[task.step].static else past + task.chunk * scn.chunk
        if sub.processor == "npu":
            for k, v in cost.npu_parts(sub, p, device, fine_share, program, keys).items():
                npu[k] += v
            continue
        for node in sub.nodes:
            if t := cost.cpu_node_seconds(node, p, device, scn.outlier_rate):
                cpu[cost.cpu_kind(node)] = cpu.get(cost.cpu_kind(node), 0.0) + t
    return {"npu": npu, "cpu": cpu}


def energy(stats: RunStats, device: Device) -> dict:
    """Joules per processor: busy power while it runs a task, idle power for the rest of the wall time."""
    m = metrics(stats)
    out = {}
    for p in PROCESSORS:
        busy = m[f"{p}_busy_s"]
        out[p] = device[f"{p}.power_busy_w"] * busy + device[f"{p}.power_idle_w"] * max(stats.wall_s - busy, 0.0)
    out["total"] = sum(out[p] for p in PROCESSORS)
    return out


def simulate_prefill(scn: Scenario, soc: str, prompt_len: int, policies=POLICIES,
                     trace_dir: Path | None = None, past: int = 0, fine_share: float = 0.0,
                     program: Program = cost.OURS, device: Device | None = None) -> dict:
    """Predicted prefill of a ``prompt_len``-token prompt on ``soc``, per policy; with ``past``, the
    prompt continues a conversation whose first ``past`` tokens' K/V are kept (a later turn: its
    chunks start at position ``past``, mid-chunk or not, and only the last one is padded).
    ``fine_share``: the share of NPU outputs computed a second time for a finer encoding (what
    ``llmnpu export`` reports as ``fine_npu_share``). ``program``: one of the paper's split (``ours``,
    or ``paper`` at the paper's own rates); ``device``: ``soc``'s profile with parameters changed (an
    assumption's range)."""
    if program.placement != "linears":
        raise LlmNpuError(f"program {program.name} runs everything on the NPU: predict it with whole_npu.predict")
    device = device or load_device(soc)
    if not 0.0 <= fine_share <= 1.0:
        raise LlmNpuError(f"the share of NPU outputs with a second encoding must be in [0, 1], got {fine_share}")
    if not isinstance(past, int) or past < 0:
        raise LlmNpuError(f"the past must be a whole number of tokens >= 0, got {past!r}")
    if not isinstance(prompt_len, int) or not 0 < prompt_len <= scn.context - past:
        after = f" after a past of {past}" if past else ""
        raise LlmNpuError(f"prompt length must be in 1..{scn.context - past} (the model's context of {scn.context}"
                          f"{after}), got {prompt_len}")
    if not policies:
        raise LlmNpuError(f"no scheduling policy given: use one or more of {', '.join(POLICIES)}")
    for p in policies:
        check_policy(p)
    chunks = math.ceil(prompt_len / scn.chunk)
    costs = step_costs(scn, device, chunks, past, fine_share, program)
    out = {"model": scn.model, "soc": soc, "device": device.name, "program": program.name,
           "prompt_len": prompt_len, "past": past,
           "chunk": scn.chunk, "fine_share": fine_share,
           "chunks": chunks, "pruning_rate": scn.pruning_rate, "shadowed_linears": scn.shadowed,
           "plan_source": scn.plan_source, "subgraphs": len(scn.program.steps),
           "lanes": lane_seconds(scn, device, chunks, past, fine_share, program), "policies": {}}
    names = {i: step_label(s.sub) for i, s in enumerate(scn.program.steps)}
    for policy in policies:
        tasks = build_tasks(scn.program, chunks)
        assign_costs(tasks, costs)
        stats = simulate(tasks, policy)
        m = metrics(stats)
        e = energy(stats, device)
        row = {"tok_s": prompt_len / stats.wall_s, "wall_s": stats.wall_s,
               "npu_busy_s": m["npu_busy_s"], "cpu_busy_s": m["cpu_busy_s"],
               "npu_bubble_rate": m["npu_bubble_rate"], "bound_s": m["bound_s"],
               "bound_tok_s": prompt_len / m["bound_s"], "energy_j": e["total"],
               "energy_npu_j": e["npu"], "energy_cpu_j": e["cpu"], "tokens_per_j": prompt_len / e["total"]}
        if trace_dir is not None:
            title = f"{scn.model} on {soc} (simulated), {prompt_len} tokens, chunk {scn.chunk}, {policy}"
            row["trace"] = str(write_trace(stats, Path(trace_dir) / f"{policy}.trace.json", names))
            row["png"] = str(write_timeline(stats, Path(trace_dir) / f"{policy}.png", title))
        out["policies"][policy] = row
    return out


def choose_placement(model: str, chunk: int, soc: str, prompt_len: int, candidates, quant: str = "w8a8-shadow",
                     pruning_rate: float | None = None, progress: bool = True, past: int = 0,
                     fine_share: float = 0.0, program: Program = cost.OURS) -> tuple[Scenario, list[dict]]:
    """The placement among ``candidates`` whose program has the shortest predicted ``ooo`` prefill of a
    ``prompt_len``-token prompt on ``soc``: each partitioned, its shadow paths pruned for itself (an
    automatic rate), and simulated as ``program`` (``ours``, or ``ours-r16`` for 16-bit residual
    writers). Returns the winner's scenario and one row per candidate, fastest first."""
    rows, scenarios = [], {}
    for placement in dict.fromkeys(parse_placement(c) for c in candidates):
        scn = prepare(model, chunk, quant, pruning_rate, placement, progress, soc=soc)
        r = simulate_prefill(scn, soc, prompt_len, ("ooo",), past=past, fine_share=fine_share,
                             program=program)["policies"]["ooo"]
        scenarios[placement.name] = scn
        rows.append({"placement": placement.name, "npu_graphs": sum(s.processor == "npu" for s in scn.partition.subgraphs),
                     "shadowed_linears": scn.shadowed, "pruning_rate": scn.pruning_rate, **r})
    if not rows:
        raise LlmNpuError("no placement to choose from: name one or more with --placement")
    rows.sort(key=lambda r: r["wall_s"])
    return scenarios[rows[0]["placement"]], rows


SWEEP_CHUNKS = (64, 128, 256, 512)


def sweep(model: str, soc: str, prompt_len: int, rates, chunks=SWEEP_CHUNKS, progress: bool = True,
          placement: "Placement | str" = PAPER) -> list[dict]:
    """Predicted ooo prefill speed for each chunk length and pruning rate under ``placement``, with the
    embedded model's measured perplexity at that pruning rate and placement (the paper's Figure 16
    form)."""
    placement = parse_placement(placement)
    lm = _embedded.get("model") or load_model(DEFAULT_MODEL)
    _embedded["model"] = lm
    windows = eval_windows(tokenize(lm, read_text(None, "eval")), 512, 2048)
    calib = default_calibration(lm, progress)
    rows = []
    for rate in rates:
        ppl = run_quantized(lm, windows, calib, quant_config("w8a8-shadow", rate), f"ppl at pruning {rate}",
                            progress, placed=(placement, 16))["ppl"]
        for chunk in chunks:
            scn = prepare(model, chunk, pruning_rate=rate, placement=placement, progress=progress, soc=soc)
            r = simulate_prefill(scn, soc, prompt_len, ("ooo",))["policies"]["ooo"]
            rows.append({"chunk": chunk, "pruning_rate": rate, "placement": placement.name, "tok_s": r["tok_s"],
                         "energy_j": r["energy_j"], "shadowed_linears": scn.shadowed, "embedded_ppl": ppl})
    return rows
