"""The reference runner: a whole generation from a ``.pte`` and the files beside it, nothing else.

Prefill: the sidecar's subgraph table becomes a ``ChunkProgram`` whose steps call the ``.pte``'s
methods through ExecuTorch's runtime (QNN methods run on Qualcomm's HTP simulator on an x86 host,
which is for numerics only: never read its times as speed). The out-of-order executor schedules
them with the sidecar's profile, exactly as it schedules our engine's subgraphs. A shadow method
computes its hot channels' product; when a cold channel crossed its threshold (the method's
``hits``), the runner adds that channel's product with rows read from the cold rows file.

Where the NPU's memory cannot hold every context at once (on the HTP simulator, a chunk-1,024 QNN
program's do not fit together), the NPU methods are loaded when called, a block's context at a
time, and released when a method of another block is called (``_BlocksOnCall``).

Decode: the ``decode`` method on a static K/V cache that this runner owns (``lower/decode_method.py``
says why), filled once from the prefill; each step writes the new token's K/V in place.

No model, weights or calibration are loaded from anywhere else.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from .. import backends
from ..chunk_step import KVShape
from ..errors import LlmNpuError
from ..format.kv import KVCache, empty_cache, write_prefill, write_slot
from ..format.npu_io import FineOutput, RegionSpec, window_inputs
from ..format.rows import ColdRows
from ..format.sidecar import ATTENTION_REGION, NORM_REGION, load_sidecar
from ..kernels.npu_attention import Encoding
from ..partitioner.regions import Subgraph
from . import program_ops
from .chunk_runner import ChunkRunner
from .executor import Workers
from .prefix_cache import PrefixCache
from .profile import Profile
from .rates import decode_rate
from .program import ChunkProgram, Step
from .sampling import GREEDY, Sampling
from .schedule import PROCESSORS, check_policy

log = logging.getLogger(__name__)


class MethodLoadError(LlmNpuError):
    """The runtime refused to load ``method`` (its delegate's log says why)."""

    def __init__(self, message: str, method: str):
        super().__init__(message)
        self.method = method


def _load_method(program, pte: Path, name: str, target: str):
    """``program``'s method ``name``, or a one-line error: a delegate that refuses to initialise
    a method says why only in its own log."""
    try:
        return program.load_method(name)
    except RuntimeError as err:
        hint = ("; each QNN method holds an HTP context, and this one does not fit in the HTP's memory even alone: "
                "export with a smaller --chunk" if target == "qnn" else "")
        raise MethodLoadError(f"{pte}: method {name} did not load ({err}; the delegate's log above says "
                              f"why){hint}", name) from None


class _BlocksOnCall:
    """The NPU methods of a ``.pte`` whose HTP contexts do not fit together, loaded when called: from
    a program of their block's own, which stays loaded while the calls stay in that block (its methods
    run one after another) and is released when a method of another block is called (the runtime
    frees a context only with its program). Export lowers a block's methods into one context, which
    the program then holds alone; the native runner does the same (``runner/src/methods.cpp``)."""

    def __init__(self, runtime, pte: Path, target: str, subgraphs: list[dict]):
        self.runtime, self.pte, self.target = runtime, pte, target
        self.block_of = {e["method"]: e["method"] if e["layer"] is None else e["layer"] for e in subgraphs}
        self._held, self._program, self._methods = None, None, {}

    def check(self, names: list[str]) -> None:
        """Each block loads alone with all its methods (``names`` in program order: a block's are
        consecutive): a failure belongs at load, not in a prompt."""
        for name in names:
            self.method(name)
        self._release()

    def method(self, name: str):
        block = self.block_of[name]
        if block != self._held:
            self._release()
            self._program, self._held = self.runtime.load_program(self.pte), block
        if name not in self._methods:
            self._methods[name] = _load_method(self._program, self.pte, name, self.target)
        return self._methods[name]

    def _release(self) -> None:
        self._methods, self._program, self._held = {}, None, None


class _MethodOnCall:
    """Method ``name`` of the ``.pte`` run from its context's program (``_BlocksOnCall``)."""

    def __init__(self, blocks: _BlocksOnCall, name: str):
        self.blocks, self.name = blocks, name

    def execute(self, inputs) -> list:
        return self.blocks.method(self.name).execute(inputs)       # outputs are copies


def _check_arity(program, entry: dict) -> None:
    """The method exists and takes what the sidecar will give it (a malformed entry fails here, at
    load, and not inside a prompt)."""
    if entry["method"] not in program.method_names:
        raise ValueError(f"the program has no method {entry['method']}")
    meta = program.metadata(entry["method"])
    given = len(entry["input_groups"]) if _linears_only(entry) else len(entry["inputs"])
    if meta.num_inputs() != given:
        raise ValueError(f"method {entry['method']} takes {meta.num_inputs()} inputs, the sidecar gives {given}")
    if entry.get("form") in (NORM_REGION, ATTENTION_REGION):        # its merge checks its outputs
        return
    # a shadow method returns its channels' hits after its outputs
    if entry["kind"] != "shadow" and not _linears_only(entry) and meta.num_outputs() != len(entry["outputs"]):
        raise ValueError(f"method {entry['method']} returns {meta.num_outputs()} outputs, the sidecar names "
                         f"{len(entry['outputs'])}")


def _linears_only(entry: dict) -> bool:
    """An NPU method of linears only (input groups in, one output per linear); every other method takes
    and returns the subgraph's tensors by name (a CPU one, or an NPU one of ``form`` graph or norm-region)."""
    return entry["kind"] == "npu" and "form" not in entry


def _region_spec(entry: dict, linears: dict) -> RegionSpec:
    names = entry["linears"]
    splits = {i: linears[n]["split_channels"] for i, n in enumerate(names) if linears[n]["split_channels"]}
    scales = [linears[names[group[0]]]["act_scale"] for group in entry["input_groups"]]
    fine = [FineOutput(i, f["part"], f["scale"], *f["range"]) for i, n in enumerate(names)
            for f in linears[n]["fine_outputs"]]
    peaks = [i for i, n in enumerate(names) if "peak" in linears[n]]
    return RegionSpec(entry["method"], names, entry["input_groups"], scales, splits, fine, peaks)


def _norm_region_call(method, entry: dict, linears: dict):
    """A norm and its linears (``lower/norm_region.py``): the input on the norm's input grid in; the
    outputs no linear makes, then the linears' parts, merged, back in the subgraph's output order."""
    spec, grid = _region_spec(entry, linears), Encoding(**entry["norm"]["x"])
    others = [o for o in entry["outputs"] if o not in entry["linear_outputs"]]

    def run(x: Tensor) -> tuple[Tensor, ...]:
        outs = method.execute((grid.round(x.reshape(-1, x.shape[-1])),))
        by_name = dict(zip(others, outs))
        by_name.update(zip(entry["linear_outputs"], spec.merge(tuple(outs[len(others):]))))
        return tuple(by_name[o].view(*x.shape[:-1], by_name[o].shape[-1]) for o in entry["outputs"])
    return run


def _attention_region_call(method, entry: dict, linears: dict):
    """RoPE, attention and the linears it feeds (``lower/attention_region.py``): the step's inputs with
    the past K/V padded to the window and the mask made additive in; out the chunk's new K/V, written
    after the past, the outputs no linear makes and the linears' parts, merged, in the subgraph's
    output order."""
    att = entry["attention"]
    spec = _region_spec(entry, linears) if entry["linears"] else None
    past_of = dict(zip(att["present"], att["past"]))
    others = [o for o in entry["outputs"] if o not in entry["linear_outputs"] and o not in past_of]
    names, past = entry["inputs"], tuple(att["past"])

    def run(*inputs) -> tuple[Tensor, ...]:
        outs = method.execute(window_inputs(names, inputs, past, att["mask"], att["window"], att["mask_value"],
                                            att["heads"]))
        values = dict(zip(names, inputs))
        by_name = {name: torch.cat([values[past_of[name]], new], dim=2) for name, new in zip(att["present"], outs)}
        by_name.update(zip(others, outs[2:2 + len(others)]))
        if spec is not None:
            lead = (1, values[att["mask"]].shape[-2])
            by_name.update((name, y.view(*lead, y.shape[-1])) for name, y in
                           zip(entry["linear_outputs"], spec.merge(tuple(outs[2 + len(others):]))))
        return tuple(by_name[o] for o in entry["outputs"])
    return run


def _npu_call(method, entry: dict, linears: dict):
    spec = _region_spec(entry, linears)

    def run(x: Tensor) -> tuple[Tensor, ...]:
        rows = x.reshape(-1, x.shape[-1])
        outs = method.execute(spec.grid_inputs(rows))      # copied out of the lane's arena by execute
        return tuple(o.view(*x.shape[:-1], o.shape[-1]) for o in spec.merge(tuple(outs)))
    return run


def _cpu_call(method, entry: dict, cold: ColdRows):
    branches, n_out = entry.get("shadow", []), len(entry["outputs"])

    def run(*inputs) -> tuple:
        outs = list(method.execute(inputs))                 # copied out of the lane's arena by execute
        result = outs[:n_out]
        for b in branches:
            if b["hits"] is not None:
                extra = cold.product(b["linear"], inputs[b["input"]], outs[b["hits"]])
                if extra is not None:
                    result[b["output"]] = result[b["output"]] + extra
        return tuple(result)
    return run


@dataclass
class Generation:
    tokens: list[int]
    prompt_tokens: int
    chunks: int
    prefill_s: float
    ttft_s: float
    decode_s: float
    cold_rows: int
    policy: str
    stopped: str = "length"                        # "length" | "eos"
    cached_tokens: int = 0                         # prompt tokens whose K/V came from the prefix cache

    @property
    def decode_tok_s(self) -> float | None:
        return decode_rate(len(self.tokens), self.decode_s)


@functools.cache
def _probe_cores_quietly() -> None:
    """ExecuTorch's threadpool looks for Arm core types once per process, when a method first loads,
    and logs five lines wherever it finds none (any x86 CPU): made here with stderr closed, Python's
    (where ExecuTorch's Python bindings send its log) and the process's, so that they do not stand
    before a command's one-line error."""
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        except OSError:
            _threadpool_get_thread_count()
            return
        try:
            os.dup2(devnull, 2)
            _threadpool_get_thread_count()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)


class PteRunner(ChunkRunner):
    """``PteRunner("model.pte")(ids)``: last-token logits and the KV cache of a prompt, as a ``PrefillResult``.
    With a ``prefix_cache``, a prompt that starts like an earlier one prefills only the rest (as the
    engine's ``Prefiller``; entries are keyed by the program's checksums)."""

    learns_profile = False      # the program's profile is the sidecar's (times on a simulator mean nothing)
    contiguous_past = True      # ExecuTorch takes contiguous inputs only

    def __init__(self, pte: str | Path, policy: str = "ooo", workers: Workers | None = None,
                 prefix_cache: PrefixCache | None = None):
        check_policy(policy)
        self.meta = meta = load_sidecar(pte)
        try:
            program, kv, profile = self._build(Path(pte), meta)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            # the checksum passed: a sidecar of a well-formed but inconsistent export
            raise LlmNpuError(f"sidecar of {pte} is inconsistent ({type(e).__name__}: {e}): export the program "
                              f"again") from None
        # a lane's methods share one arena (below): no worker may run the other lane's while it runs
        workers = dataclasses.replace(workers or Workers.auto(), steal=False)
        super().__init__(program, kv, meta["context"], meta["model"]["vocab_size"], policy, workers,
                         profile=profile, prefix_cache=prefix_cache,
                         kv_key=f"pte:{meta['pte_sha256']}:{meta['sidecar_sha256']}")

    def _build(self, pte: Path, meta: dict) -> tuple[ChunkProgram, KVShape, Profile | None]:
        """The sidecar's subgraph table as a chunk program whose steps call the program's methods."""
        from executorch.runtime import Runtime

        _probe_cores_quietly()
        backends.get(meta["target"]).prepare_runtime()
        program_ops.load()   # the attention methods call our kernel
        shadow = meta["shadow"]
        self.cold = ColdRows(Path(pte).parent / shadow["rows_file"] if "rows_file" in shadow else None, shadow, Path(pte))
        self.pte = Path(pte)
        # One program per worker, each mapping the file (the runtime reads the methods in place): the
        # host methods of a program share one planned arena, sized to the largest of them (ExecuTorch's
        # ``Program.load_method``), instead of one arena per method. Safe because under every policy the
        # executor gives each processor one worker that runs one task at a time (the out-of-order
        # policies reorder tasks, never overlap two of one lane), and ``execute`` copies the outputs out
        # of the arena before it returns. Decode gets a program of its own, as in the native runner
        # (sharing the CPU worker's arena slowed its step there).
        runtime = Runtime.get()
        try:
            steps, refused = self._steps(runtime, meta, npu_on_call=False), None
        except MethodLoadError as err:
            if meta["target"] != "qnn":
                raise
            steps, refused = None, err.method       # the error's frames, which hold the methods, go with it
        if steps is None:
            self.lanes = None       # the lane programs, and with them every context loaded so far
            log.warning("the NPU's memory does not hold all of %s's contexts at once (%s did not load beside the "
                        "others): its NPU methods load when called, which is slower", self.pte.name, refused)
            steps = self._steps(runtime, meta, npu_on_call=True)
        self._decode = _load_method(runtime.load_program(self.pte), self.pte, meta["decode"]["method"], meta["target"])
        m = meta["model"]
        kv = KVShape(m["layers"], m["kv_heads"], m["head_dim"])
        program = ChunkProgram(steps, meta["graph"]["outputs"], meta["chunk_len"], kv.layers)
        return program, kv, Profile.from_dict(meta["profile"], program) if meta["profile"] else None

    def _steps(self, runtime, meta: dict, npu_on_call: bool) -> list:
        """One step per subgraph of the sidecar's table, each calling its method of its lane's program
        (``npu_on_call``: the NPU lane's methods loaded for each call instead)."""
        self.lanes = {p: runtime.load_program(self.pte) for p in PROCESSORS}
        self.npu_on_call = npu_on_call
        if npu_on_call:
            blocks = _BlocksOnCall(runtime, self.pte, meta["target"], meta["subgraphs"])
            blocks.check([e["method"] for e in meta["subgraphs"] if e["processor"] == "npu"])
        steps = []
        for e in meta["subgraphs"]:
            program = self.lanes[e["processor"]]
            _check_arity(program, e)
            if npu_on_call and e["processor"] == "npu":
                method = _MethodOnCall(blocks, e["method"])
            else:
                method = _load_method(program, self.pte, e["method"], meta["target"])
            sub = Subgraph(e["index"], e["kind"], e["layer"], e["static"], e["inputs"], e["outputs"], e["linears"])
            fn = (_norm_region_call(method, e, meta["linears"]) if e.get("form") == NORM_REGION
                  else _attention_region_call(method, e, meta["linears"]) if e.get("form") == ATTENTION_REGION
                  else _npu_call(method, e, meta["linears"]) if _linears_only(e) else _cpu_call(method, e, self.cold))
            steps.append(Step(sub, fn))
        return steps

    def row_stores(self) -> list:
        return list(self.cold.stores.values())

    # ------------------------------------------------------------------ decode
    def start_decode(self, prefill) -> KVCache:
        """The decode cache, filled with a prefill's K/V (``PrefillResult``)."""
        k, v = empty_cache(self.kv, self.context)
        return KVCache(k, v, write_prefill(k, v, prefill.past_k, prefill.past_v))

    @torch.inference_mode()
    def decode(self, cache: KVCache, token: int) -> Tensor:
        """Logits [vocab] of the token after ``token``, which goes into slot ``cache.length``."""
        pos = cache.length
        if pos >= self.context:
            raise LlmNpuError(f"decode past the program's context of {self.context} tokens: export with a larger "
                              f"--context or generate fewer tokens")
        outs = self._decode.execute((torch.tensor([[token]]), torch.tensor([pos]), *cache.k, *cache.v))
        layers = self.kv.layers
        write_slot(cache.k, cache.v, pos, outs[1:1 + layers], outs[1 + layers:1 + 2 * layers])
        cache.length = pos + 1
        return outs[0].reshape(-1)

    def generate(self, input_ids, max_new_tokens: int, sampling: Sampling = GREEDY, eos_ids=(),
                 on_token: Callable[[int], None] | None = None, policy: str | None = None) -> Generation:
        """Prefill ``input_ids``, then decode up to ``max_new_tokens`` (stopping after an ``eos_ids`` token)."""
        if max_new_tokens < 1:
            raise LlmNpuError(f"max new tokens must be at least 1, got {max_new_tokens}")
        ids = self.check_prompt(input_ids)
        policy = check_policy(policy or self.policy)
        if ids.numel() + max_new_tokens - 1 > self.context:
            raise LlmNpuError(f"prompt of {ids.numel()} tokens + {max_new_tokens} new ones needs "
                              f"{ids.numel() + max_new_tokens - 1} K/V slots, past the program's context of "
                              f"{self.context}: generate fewer tokens or export with a larger --context")
        gen = sampling.generator()
        fetched = self.cold.fetched
        start = time.perf_counter()
        pre = self.prefill_checked(ids, policy)
        prefill_s = time.perf_counter() - start
        token = sampling.next_token(pre.logits, gen)
        first = time.perf_counter()
        tokens, last = [token], first
        if on_token:
            on_token(token)
        cache = self.start_decode(pre)
        while len(tokens) < max_new_tokens and token not in eos_ids:
            token = sampling.next_token(self.decode(cache, token), gen)
            tokens.append(token)
            last = time.perf_counter()
            if on_token:
                on_token(token)
        return Generation(tokens, ids.numel(), pre.chunks, prefill_s, first - start, last - first,
                          self.cold.fetched - fetched, self.last_run.policy, "eos" if token in eos_ids else "length",
                          pre.reused)
