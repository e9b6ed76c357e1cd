"""The reference runner: a whole chunked prefill from a ``.pte`` and its sidecar, nothing else.

The sidecar's subgraph table becomes a ``ChunkProgram`` whose steps call the ``.pte``'s methods
through ExecuTorch's runtime (QNN methods run on Qualcomm's HTP simulator on an x86 host, which
is for numerics only: never read its times as speed). The out-of-order executor schedules them
with the sidecar's profile, exactly as it schedules our engine's subgraphs. No model, weights or
tokenizer are loaded.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import Tensor

from ..errors import LlmNpuError
from ..partitioner.regions import Subgraph
from .executor import POLICIES, Executor, Workers
from .profile import Profile
from .program import ChunkProgram, Step, chunk_feeds


def load_sidecar(pte: str | Path) -> dict:
    """The sidecar of ``pte``, checked: right format and version, and written for this very file."""
    from ..lower.pte import FORMAT, VERSION, sidecar_path

    pte = Path(pte)
    if not pte.is_file():
        raise LlmNpuError(f"no such .pte file: {pte}")
    path = sidecar_path(pte)
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise LlmNpuError(f"{pte} has no sidecar {path.name} beside it: export writes both; copy them together") from None
    except ValueError as e:
        raise LlmNpuError(f"sidecar {path} is not valid JSON ({e}): export again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise LlmNpuError(f"{path} is not a version-{VERSION} llmnpu sidecar: export again with this version")
    digest = hashlib.sha256(pte.read_bytes()).hexdigest()
    if meta.get("pte_sha256") != digest:
        raise LlmNpuError(f"{path.name} was written for another {meta.get('pte')}: the .pte and sidecar do not match")
    return meta


def _npu_call(module, entry: dict, linears: dict):
    from ..lower.npu_subgraphs import RegionSpec

    names = entry["linears"]
    splits = {i: linears[n]["split_channels"] for i, n in enumerate(names) if linears[n]["split_channels"]}
    scales = [linears[names[group[0]]]["act_scale"] for group in entry["input_groups"]]
    spec = RegionSpec(entry["method"], names, entry["input_groups"], scales, splits)

    def run(x: Tensor) -> tuple[Tensor, ...]:
        rows = x.reshape(-1, x.shape[-1])
        outs = module.run_method(spec.method, spec.grid_inputs(rows))
        return tuple(o.view(*x.shape[:-1], o.shape[-1]) for o in spec.merge(tuple(o.clone() for o in outs)))
    return run


def _cpu_call(module, method: str):
    def run(*inputs) -> tuple:
        # outputs live in the method's planned memory, which its next call overwrites: copy them
        return tuple(o.clone() if isinstance(o, Tensor) else o for o in module.run_method(method, inputs))
    return run


class PteRunner:
    """``PteRunner("model.pte")(ids)``: last-token logits and the KV cache of a prompt, as a ``PrefillResult``."""

    def __init__(self, pte: str | Path, policy: str = "ooo", workers: Workers | None = None):
        from executorch.extension.pybindings.portable_lib import (
            _load_for_executorch_from_buffer,
        )

        if policy not in POLICIES:
            raise LlmNpuError(f"unknown policy '{policy}': use one of {', '.join(POLICIES)}")
        self.meta = meta = load_sidecar(pte)
        if meta["target"] == "qnn":
            from ..qnn.sdk import activate

            activate()            # the QNN libraries (and the shim) before the program loads
        self._buffer = Path(pte).read_bytes()     # the runtime reads the program in place: keep it alive
        self.module = _load_for_executorch_from_buffer(self._buffer)
        steps = []
        for e in meta["subgraphs"]:
            sub = Subgraph(e["index"], e["kind"], e["layer"], e["static"], e["inputs"], e["outputs"], e["linears"])
            fn = (_npu_call(self.module, e, meta["linears"]) if e["kind"] == "npu"
                  else _cpu_call(self.module, e["method"]))
            steps.append(Step(sub, fn))
        m = meta["model"]
        self.chunk_len, self.context, self.vocab = meta["chunk_len"], meta["context"], m["vocab_size"]
        from ..capture import KVShape

        self.kv = KVShape(m["layers"], m["kv_heads"], m["head_dim"])
        self.program = ChunkProgram(steps, meta["graph"]["outputs"], self.chunk_len, self.kv.layers)
        self.executor = Executor(self.program, workers)
        self.policy = policy
        p = meta.get("profile")
        self.profile = (Profile({int(k): v for k, v in p["static"].items()},
                                {int(k): v for k, v in p["dynamic"].items()}) if p else None)

    @torch.inference_mode()
    def __call__(self, input_ids, policy: str | None = None):
        from ..prefill import PrefillResult, check_prompt

        ids = check_prompt(input_ids, self.context, self.vocab)
        policy = policy or self.policy
        if policy not in POLICIES:
            raise LlmNpuError(f"unknown policy '{policy}': use one of {', '.join(POLICIES)}")
        feeds = chunk_feeds(ids, self.chunk_len, self.kv)
        costs = self.profile.costs(len(feeds)) if self.profile else None
        out, stats = self.executor.run(feeds, policy if costs or policy != "ooo" else "inorder", costs)
        self.last_run = stats
        total = ids.numel()
        return PrefillResult(out[self.program.out_logits].reshape(-1),
                             [out[k][:, :, :total] for k in self.program.out_k],
                             [out[v][:, :, :total] for v in self.program.out_v],
                             len(feeds), {"prefill_s": stats.wall_s})
