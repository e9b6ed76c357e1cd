"""The engine: a model's chunk program built here, from the float model, and served by ``ChunkRunner``.

``Prefiller`` prepares once (``prepare.py``: calibration plan, ``torch.export`` of one chunk step,
partition; then the compilation of the static NPU subgraphs through the graph cache) and then serves
prompts of any length: the last chunk is padded at its end, which needs no extra mask (a padded
position comes after every real one, so causal masking already hides it) and its K/V are cut off
afterwards. A last part of at most a quarter chunk runs on a tail program of that many rows instead
(the step captured at that length, with the same NPU regions): a later turn of a conversation is
mostly such a part. The (chunk, subgraph) tasks run on two workers under a scheduling policy
(``schedule.py``); every policy gives the same outputs, bit for bit.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import logging
import math
import statistics
import threading
import time
import weakref

import torch
from torch import Tensor, nn
from tqdm import tqdm

from .. import backends
from .. import kernels as K
from ..backends.graph_cache import GraphCache, entry_key
from ..chunk_step import DEFAULT_CHUNK, max_context, weights_state
from ..chunk_step import kv_shape as kv_shape_of
from ..errors import LlmNpuError
from ..format.tasks import build_tasks
from ..kernels import int8_path, native_ops
from ..kernels.attention import resolve_precision
from ..models import LoadedModel
from ..models import fingerprint as model_fingerprint
from ..models import keep_first_blocks, load_model
from ..kernels.npu_attention import AttentionEncodings
from ..lower.npu_graph import NpuEncodings
from ..partitioner.placement import AUTO, PAPER, Placement, parse_placement
from ..partitioner.regions import shadow_paths
from ..prepare import (attention_ranges_of, default_calibration, has_npu_norms, norm_encodings_of, partition_step,
                       plan_and_partition)
from ..quantize import Calibration, QuantConfig, ShadowCost, auto, plan_linears, resolve_quant
from .allocator import give_back, tune_malloc
from .chunk_runner import ChunkRunner
from .engine_config import EngineConfig
from .executor import Workers
from .prefix_cache import PrefixCache
from .profile import Profile
from .program import ChunkProgram, program_digest, same_subgraphs
from .prompt import PrefillResult, chunk_feeds
from .schedule import COST_POLICIES, assign_costs, simulate

log = logging.getLogger(__name__)

PROFILE_RUNS = 3      # in-order runs of a two-chunk prompt that time the subgraphs for ooo / cp
PRUNING_PROMPT = 1024  # tokens of the prompt whose predicted prefill an automatic pruning weighs
# A placement beyond the paper's is chosen on the host only if its timed prefill is this much shorter:
# timings on a shared machine move by about 15 %, and the paper's split is what every program writes
PLACEMENT_MARGIN = 0.10


class Prefiller(ChunkRunner):
    """A prepared chunked-prefill engine for one model, chunk length, backend and quantization.

    Args:
        model: a ``LoadedModel`` (``load_model(...)``) or a transformers causal LM.
        chunk_len: tokens per chunk graph (the paper's default: 256).
        backend: an NPU backend whose engine runs here (``backends.names(engine=True)``): ``"cpu-int8"``,
            the INT8 stand-in NPU.
        quant: ``"w8a8-shadow"`` (default), ``"w8a8"``, ``"fp32"`` (the float reference) or a QuantConfig.
        calibration: a Calibration; by default the cached one on the shipped calibration text.
        placement: what the NPU regions run beside the linears (``partitioner/placement.py``):
            ``"paper"`` (default: linears only), ``"norms"``, ``"attention-half"``, ``"block"``,
            pieces joined by '+', or ``"auto"``: the fastest on this machine, timed once
            (``host_placement_choice``, cached with the calibration). On ``cpu-int8`` the pieces
            run on the NPU lane's thread with the CPU's kernels, attention and the block norms
            (quantized modes) as an NPU graph computes them (``kernels/npu_attention.py``,
            ``kernels/npu_norm.py``).
        npu_kv_bits: bits of that attention's K/V window (16 or 8).
        cache: the graph cache (default: on disk under the cache folder).
        policy: default scheduling policy, ``"ooo"`` | ``"cp"`` | ``"overlap"`` | ``"inorder"``.
        workers: threads and cores of the two workers (default: half the cores each).
        attention: precision of the float side's attention and LM head, ``"auto"`` (bf16 operands
            with fp32 accumulation and softmax, and the head's weights in bf16, for the quantized
            modes where the native kernels run; fp32 for the float reference), ``"fp32"`` or ``"bf16"``.
        prefix_cache: a ``PrefixCache``: a prompt that starts like an earlier one (under this engine's
            ``kv_key``) prefills only the tokens after the cached part, and every prompt is kept.
        tail_len: rows of a second, shorter chunk program for a prompt's last few tokens (a later
            turn's 50 new tokens run as 64 rows, not as a padded chunk of 256): ``"auto"``
            (a quarter of ``chunk_len``, when that is at least ``TAIL_MIN`` rows), an int below
            ``chunk_len``, or None (every chunk padded to ``chunk_len``).
    """

    def __init__(self, model: LoadedModel | nn.Module, chunk_len: int = DEFAULT_CHUNK, backend: str = backends.DEFAULT,
                 quant: QuantConfig | str | None = "w8a8-shadow", calibration: Calibration | None = None,
                 placement: str = PAPER, cache: GraphCache | None = None, progress: bool = True,
                 policy: str = "ooo", workers: Workers | None = None, attention: str = "auto",
                 prefix_cache: PrefixCache | None = None, tail_len: int | str | None = "auto",
                 npu_kv_bits: int = 16):
        self._prepare(model, EngineConfig(chunk_len, backend, quant, placement, npu_kv_bits, policy, attention,
                                          tail_len),
                      calibration, cache, workers, prefix_cache, progress)

    @classmethod
    def from_config(cls, model: LoadedModel | nn.Module, config: EngineConfig, calibration: Calibration | None = None,
                    cache: GraphCache | None = None, workers: Workers | None = None,
                    prefix_cache: PrefixCache | None = None, progress: bool = True) -> "Prefiller":
        """The engine ``config`` describes; the other arguments as for the constructor."""
        engine = cls.__new__(cls)
        engine._prepare(model, config, calibration, cache, workers, prefix_cache, progress)
        return engine

    def _prepare(self, model, config: EngineConfig, calibration, cache, workers, prefix_cache, progress) -> None:
        lm = model if isinstance(model, LoadedModel) else None
        self.model = lm.model if lm else model
        self.fingerprint = lm.fingerprint if lm else model_fingerprint(self.model)
        model_config = self.model.config
        context = max_context(model_config)
        chunk_len = config.chunk_len
        if chunk_len > context:
            raise LlmNpuError(f"chunk length must be an integer in 1..{context} (the model's context), "
                              f"got {chunk_len!r}")
        npu = backends.get(config.backend, engine=True)
        self.backend_name, self.quant = config.backend, config.quant
        self.attention = resolve_precision(config.attention, self.quant is not None)
        self.timings: dict[str, float] = {}
        tune_malloc()

        if self.quant is not None and calibration is None:
            calibration = default_calibration(lm, progress)
        self.calibration = calibration          # the export's INT8 decode reads its outlier statistics too
        choose_host_pruning(model, calibration, self.quant, progress, config.attention)
        self.placement_choice = host_placement_choice(model, calibration, config, progress)
        if self.placement_choice is not None:
            config = dataclasses.replace(config, placement=self.placement_choice["placement"])
        self.config, placement = config, config.placement
        self.plans, self.partition = plan_and_partition(self.model, lm, self.fingerprint, chunk_len, self.quant,
                                                        calibration, placement, progress, self.timings)

        t = time.perf_counter()
        self.cache = cache if cache is not None else GraphCache()
        weights = self.quant.weights if self.quant else "channel"
        self.backend = npu.engine(self.model, self.fingerprint, chunk_len, self.plans, weights, self.cache)
        kv = kv_shape_of(model_config)
        program = ChunkProgram.build(self.partition, self.backend, chunk_len, kv.layers, progress, self.attention,
                                     self._npu_encodings(lm, config))
        self.timings["compile_s"] = time.perf_counter() - t
        tail_len = config.tail_rows()
        tail = self._build_tail(program, tail_len, placement) if tail_len else None
        super().__init__(program, kv, context, model_config.vocab_size, config.policy, workers, tail,
                         prefix_cache=prefix_cache)
        if self.plans is not None:
            # Compile the activation quantizer (its torch form, used without the native kernels)
            # here, not inside the first timed task.
            with torch.inference_mode():
                K.quantize_u8(torch.zeros(chunk_len, model_config.hidden_size), 1.0)
        self.profile = Profile.load(self._profile_path(), self.program)
        self.kv_key = self._kv_key()
        self._warm_up(profile=config.policy in COST_POLICIES and self.profile is None)

    def _warm_up(self, profile: bool) -> None:
        """Run a prompt in order before any real one: kernels make their first-call setup here (it
        tripled the first prompt's time). With ``profile``, every subgraph is then timed on a
        two-chunk prompt, so that the first real prompt already runs out of order; timing the first
        run instead would record that setup as the costs of the tasks that paid it. The profile takes
        each task's median of ``PROFILE_RUNS`` runs: one run on a busy machine skewed every later
        schedule of the model (the profile is stored)."""
        t = time.perf_counter()
        ids = self._profile_ids()
        with torch.inference_mode():
            self.executor.run(self.feeds(ids[:self.chunk_len]), "inorder")
            if self.tail is not None:
                self.executor.run(chunk_feeds(ids[:self.tail_len], self.chunk_len, self.kv, None, self.tail_len),
                                  "inorder")
            if profile:
                records = []
                for _ in range(PROFILE_RUNS):
                    records += self.executor.run(self.feeds(ids), "inorder")[1].records
                self.profile = Profile.from_records(records, self.program, self.chunk_len)
                self.profiled(self.profile)
        self.timings["warmup_s"] = time.perf_counter() - t

    def _profile_ids(self) -> Tensor:
        """Two chunks of real text when the calibration holds them apart (outliers follow the text),
        else random ids."""
        n = min(2 * self.chunk_len, self.context)
        held = self.calibration.held_ids if self.calibration is not None else None
        probe = held.flatten() if held is not None else None
        if probe is not None and probe.numel() >= n:
            return probe[:n]
        return torch.randint(0, self.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))

    def shadow_prices(self, prompt_len: int = PRUNING_PROMPT) -> ShadowCost:
        """What each shadow path costs this engine's prefill of a ``prompt_len``-token prompt, for the
        automatic pruning: every subgraph and shadow path timed in order (``PROFILE_RUNS`` runs of two
        chunks), and the prefill predicted by the ``ooo`` scheduler (stealing as the workers do)
        without the pruned paths: their time leaves the subgraph that holds them, and a subgraph
        left with no path does not run.
        Each task also pays the executor's own handling, measured in the same runs (wall time not
        spent inside a task); a task that does not run saves it."""
        shadows = self.program.shadow
        for m in shadows.values():
            m.calls, m.seconds = 0, 0.0
        feeds, records, handling = self.feeds(self._profile_ids()), [], []
        with torch.inference_mode():
            for _ in range(PROFILE_RUNS):
                stats = self.executor.run(feeds, "inorder")[1]
                records += stats.records
                inside = sum(r.end - r.start for r in stats.records)
                handling.append(max(stats.wall_s - inside, 0.0) / max(len(stats.records), 1))
        per_task = statistics.median(handling)
        base = Profile.from_records(records, self.program, self.chunk_len)
        seconds = {name: m.seconds / max(m.calls, 1) for name, m in shadows.items()}
        paths = {j: set(shadow_paths(step.sub.nodes)) for j, step in enumerate(self.program.steps)}
        chunks = math.ceil(min(prompt_len, self.context) / self.chunk_len)
        costs = base.costs(chunks)

        def makespan(kept: frozenset) -> float:
            c = {}
            for key, t in costs.items():
                step = key[0] if isinstance(key, tuple) else key
                if paths[step] and not paths[step] & kept:
                    c[key] = 0.0            # a shadow subgraph with every path pruned is not run
                else:
                    c[key] = max(t - sum(seconds[n] for n in paths[step] - kept), 0.0) + per_task
            tasks = build_tasks(self.program, chunks)
            assign_costs(tasks, c)
            return simulate(tasks, "ooo", self.executor.workers.steal).wall_s

        return ShadowCost("host", seconds, makespan)

    def timed_prefill(self, prompt_len: int = PRUNING_PROMPT) -> float:
        """Wall seconds of this engine's ``ooo`` prefill of a ``prompt_len``-token prompt (held-apart
        calibration text where it holds enough, else random ids): the median of ``PROFILE_RUNS`` runs
        after one that warms up. Measured, not predicted from timed subgraphs: the scheduler's
        model of the lanes leaves out the idle worker's help, which moved the verdict."""
        return timed_together([self], prompt_len)[0]

    def _timing_ids(self, prompt_len: int) -> Tensor:
        n = min(prompt_len, self.context)
        held = self.calibration.held_ids if self.calibration is not None else None
        if held is not None and held.numel() >= n:
            return held.flatten()[:n]
        return torch.randint(0, self.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))

    def _npu_encodings(self, lm: LoadedModel | None, config: EngineConfig) -> NpuEncodings | None:
        """The encodings attention and the block norms run at where the placement puts them on the NPU
        (None: the float engine, or neither on the NPU)."""
        placement = parse_placement(config.placement)
        pieces = [p for p in ("attention", "norms") if placement.on_npu(p)]
        if self.quant is None or not pieces:
            return None
        if lm is None:
            raise LlmNpuError(f"{' and '.join(pieces)} on the NPU need encodings calibrated on the shipped text: pass "
                              f"a LoadedModel (load_model(...)), or keep {'them' if len(pieces) > 1 else 'it'} on the CPU")
        attention = norms = None
        if placement.on_npu("attention"):
            ranges = attention_ranges_of(lm, config.chunk_len)
            attention = {layer: AttentionEncodings.of_ranges(r, config.npu_kv_bits) for layer, r in ranges.items()}
        if placement.on_npu("norms"):
            norms = norm_encodings_of(lm, config.chunk_len)
        return NpuEncodings(attention, norms)

    def _build_tail(self, program: ChunkProgram, tail_len: int, placement: str) -> ChunkProgram | None:
        """The tail program: the chunk step captured and partitioned at ``tail_len`` rows, run with
        this engine's NPU regions and shadow paths. None, with a warning, if the step is cut
        otherwise at that length (then short last chunks run padded, as without a tail)."""
        t = time.perf_counter()
        partition = partition_step(self.model, tail_len, self.plans, placement)
        if not same_subgraphs(self.partition, partition):
            log.warning("the chunk step of %d rows is partitioned unlike that of %d: no tail program, "
                        "short last chunks run padded to %d rows", tail_len, program.chunk_len, program.chunk_len)
            return None
        tail = program.tail(partition, self.backend, tail_len)
        self.timings["tail_s"] = time.perf_counter() - t
        return tail

    def release_runtime(self) -> None:
        """Let go of what running prompts needs: the compiled steps with their INT8 weights, shadow
        rows and mapped rows files, and the graph cache's copies in memory. For a caller that reads
        only the plans, partition, subgraphs and float model from here on (``llmnpu export`` once it
        has run its examples). The engine runs no prompt after."""
        for step in self.program.steps + (self.tail.steps if self.tail else []):
            step.fn = None
        self.program.shadow = {}
        self.cache.forget()
        self.released = True
        gc.collect()
        give_back()

    def profiled(self, profile: Profile) -> None:
        profile.save(self._profile_path())

    def _plan_fields(self) -> list:
        return sorted((n, p.act_scale, p.shadow) for n, p in (self.plans or {}).items())

    def _kv_key(self) -> str:
        """What a prompt's K/V depend on: an entry of the prefix cache made under another key (model,
        quantization plan, program, attention precision) is never used here."""
        return "prefill:" + entry_key({"kv": 2, "engine": self.config.outputs_key(), "model": self.fingerprint,
                                       "plan": self._plan_fields(), "program": program_digest(self.program),
                                       "tail": program_digest(self.tail) if self.tail else None,
                                       "attention": self.attention})

    def _profile_path(self):
        key = entry_key({"profile": 4, "engine": self.config.outputs_key(), "model": self.fingerprint,
                         "plan": self._plan_fields(),
                         "threads": self.executor.workers.threads,
                         "program": program_digest(self.program), "kernels": native_ops.library_digest(),
                         "int8_kernel": int8_path.current(), "attention": self.attention})
        return self.cache.root / f"profile-{key}.json"

    # ------------------------------------------------------------------ accounting
    @property
    def compilations(self) -> int:
        return self.cache.stats.compilations

    def counters(self) -> dict:
        return self.cache.stats.to_dict()


def choose_host_pruning(model: LoadedModel | nn.Module, calibration: Calibration, quant: QuantConfig | None,
                        progress: bool = True, attention: str = "auto") -> None:
    """Make the automatic pruning choice of ``quant`` for this machine's engine, unless it is made
    (it is cached in ``calibration``): the engine is built with every shadow path, its paths are
    priced by ``Prefiller.shadow_prices`` at the default chunk length (and the caller's ``attention``),
    and ``quantize/auto.py`` chooses. A phone SoC's choice comes from its device model instead
    (``simulate/phone.py``)."""
    if quant is None or not auto.needs_choice(calibration, quant):
        return
    if quant.pruning_target != "host":
        auto.pruned_layers(calibration, quant)      # says where that choice is made
    base = model.model if isinstance(model, LoadedModel) else model
    fingerprint = model.fingerprint if isinstance(model, LoadedModel) else model_fingerprint(base)
    chunk = min(DEFAULT_CHUNK, max_context(base.config))
    unpruned = Prefiller(model, chunk, quant=dataclasses.replace(quant, pruning_rate=0.0), calibration=calibration,
                         progress=progress, attention=attention, tail_len=None)
    cost = unpruned.shadow_prices()
    unpruned.release_runtime()
    plan_linears(base, calibration, quant, fingerprint, progress, cost)


def timed_together(engines: list["Prefiller"], prompt_len: int = PRUNING_PROMPT) -> list[float]:
    """``Prefiller.timed_prefill`` of each of ``engines``, their runs taken in turn (one of each, then
    again): a machine whose speed drifts while they are timed moves them all alike."""
    walls: list[list[float]] = [[] for _ in engines]
    ids = [e._timing_ids(prompt_len) for e in engines]
    with torch.inference_mode():
        for _ in range(PROFILE_RUNS + 1):
            for e, x, w in zip(engines, ids, walls):
                e(x, policy="ooo")
                w.append(e.last_run.wall_s)
    return [statistics.median(w[1:]) for w in walls]


def fastest_placement(seconds: dict[str, float], margin: float = PLACEMENT_MARGIN) -> str:
    """The placement with the shortest prefill; the paper's unless the fastest is more than
    ``margin`` shorter (a gain inside the timings' noise is no reason to leave it). A placement and
    its ``+inline`` form compute the same bits on the same lanes, one with fewer tasks and passes:
    the faster of the two stands for both, without a margin."""
    best, paper = _contenders(seconds)
    if paper is not None and seconds[best] > (1 - margin) * seconds[paper]:
        return paper
    return best


def _contenders(seconds: dict[str, float]) -> tuple[str, str | None]:
    """The fastest placement, and the paper's faster form (None when it was not timed)."""
    stands: dict[Placement, str] = {}
    for name, t in seconds.items():
        base = parse_placement(name).base
        if base not in stands or t < seconds[stands[base]]:
            stands[base] = name
    return min(stands.values(), key=seconds.get), stands.get(parse_placement(PAPER))


def placement_key(config: EngineConfig, calibration: Calibration) -> str:
    """Where a host's placement choice holds: the engine's settings that change its subgraphs' costs
    (the pruning as resolved), on this CPU with these kernels."""
    quant = auto.resolve(config.quant, calibration)
    settings = (config.backend, config.chunk_len, sorted(quant.to_dict().items()), config.npu_kv_bits,
                config.attention)
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:12]
    return f"placement2/{digest}/{auto.target_key(dataclasses.replace(quant, pruning_target='host'))}"


def host_placement_choice(model: LoadedModel | nn.Module, calibration: Calibration | None, config: EngineConfig,
                          progress: bool = True, measure=None) -> dict | None:
    """The host's choice for an ``"auto"`` placement (None for a named one): {"placement", "prefill_s"}.

    Every preset the backend runs is built as an engine and its ``ooo`` prefill of a
    ``PRUNING_PROMPT``-token prompt timed (``timed_together``: a placement with its ``+inline``
    form; then the fastest with the paper's faster form, again); the fastest wins
    (``fastest_placement``). The choice is cached in the calibration
    artefact: it is made once per model, settings and machine. The float reference has nothing to place: the paper's split.
    ``measure`` (engine -> seconds) replaces the timing, for tests."""
    if config.placement != AUTO:
        return None
    # peak changes what is computed (a static set of channels' products): a choice by speed keeps the numbers
    candidates = [c for c in backends.placements(backends.get(config.backend, engine=True))
                  if not parse_placement(c).on_npu("peak")]
    if not has_npu_norms(model.model if isinstance(model, LoadedModel) else model):
        candidates = [c for c in candidates if not parse_placement(c).on_npu("norms")]
    if config.quant is None or calibration is None or candidates == [PAPER]:
        return {"placement": PAPER, "prefill_s": {}}
    key = placement_key(config, calibration)
    if key not in calibration.placement:
        seconds = {}
        # a placement and its +inline form are timed in turn: the choice between them is the closest
        groups: dict[Placement, list[str]] = {}
        for name in candidates:
            groups.setdefault(parse_placement(name).base, []).append(name)
        def time_in_turn(names: list[str]) -> None:
            # no tail program: the timed prompt is whole chunks
            trials = [Prefiller.from_config(model, dataclasses.replace(config, placement=name, policy="ooo",
                                                                       tail_len=None), calibration, progress=False)
                      for name in names]
            timed = [measure(t) for t in trials] if measure else timed_together(trials)
            seconds.update(zip(names, timed))
            for t in trials:
                t.release_runtime()

        with tqdm(total=len(candidates) + 2, desc="choosing the placement (once)", unit="placement",
                  disable=not progress) as bar:
            for names in groups.values():
                time_in_turn(names)
                bar.update(len(names))
            # the final: the fastest against the paper's faster form, timed again in turn. The margin
            # between these two decides, and pairs timed minutes apart on a shared machine can differ
            # by more than it.
            best, paper = _contenders(seconds)
            if paper is not None and best != paper:
                time_in_turn([paper, best])
            bar.update(2)
        calibration.placement[key] = {"placement": fastest_placement(seconds), "prefill_s": seconds}
        if calibration.path is not None:
            calibration.save()
    return calibration.placement[key]


_prepared: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
_prepared_lock = threading.Lock()


def prefill(model: LoadedModel | nn.Module, input_ids, chunk_len: int = DEFAULT_CHUNK, backend: str = backends.DEFAULT,
            quant: QuantConfig | str | None = "w8a8-shadow", calibration: Calibration | None = None,
            progress: bool = True) -> PrefillResult:
    """Chunked prefill of one prompt: last-token logits and the KV cache.

    The prepared engine is kept for the model (per chunk length, backend and quantization), so later
    prompts of any length reuse every compiled graph. Editing the model's weights gives a new engine.
    Thread-safe: concurrent first calls prepare one engine.
    """
    base = model.model if isinstance(model, LoadedModel) else model
    state = weights_state(base)
    key = (chunk_len, backend, repr(resolve_quant(quant)), id(calibration), state)
    with _prepared_lock:
        engines = _prepared.setdefault(base, {})
        if key not in engines:
            stale = [k for k in engines if k[-1] != state]
            for k in stale:
                del engines[k]
            if stale and isinstance(model, LoadedModel):      # edited since its fingerprint was taken
                model = dataclasses.replace(model, fingerprint=model_fingerprint(base))
            engines[key] = Prefiller(model, chunk_len, backend, quant, calibration, progress=progress)
        engine = engines[key]
    return engine(input_ids)


def export_engine(spec: str, chunk_len: int, quant, blocks: int | None = None, progress: bool = True,
                  choose=choose_host_pruning, placement: str = PAPER):
    """The cpu-int8 engine that ``llmnpu export`` lowers (and ``validate`` compares with): the model
    ``spec`` with its default calibration, optionally cut to its first ``blocks`` decoder blocks
    (planned on the whole model first, so pruning ranks every layer as in the full model). ``choose``
    makes an automatic pruning choice (``simulate.phone.choose_pruning`` for any target, a phone SoC's included)."""
    if quant is None:
        raise LlmNpuError("export writes INT8 NPU subgraphs: use quant w8a8-shadow or w8a8, not fp32")
    lm = load_model(spec)
    calib = default_calibration(lm, progress)
    choose(lm, calib, quant, progress)
    if blocks is not None:
        plan_linears(lm.model, calib, quant, lm.fingerprint, progress)
        keep_first_blocks(lm, blocks)
    # fp32 attention: the program's CPU methods attend in fp32 (decomposed SDPA), and validate compares
    return lm, Prefiller(lm, chunk_len, quant=quant, calibration=calib, progress=progress, attention="fp32",
                         tail_len=None, placement=placement)
