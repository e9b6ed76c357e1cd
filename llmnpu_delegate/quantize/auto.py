"""``pruning_rate="auto"``: prune the shadow paths that cost prefill time, as far as accuracy allows.

A shadow path is worth pruning only where its work reaches the critical path of the prefill: on the
NPU pipeline it mostly hides behind the NPU's graphs. So the choice is made with a schedule: a
``ShadowCost`` predicts the prefill's time for any set of kept shadow paths (from this machine's
engine profile, ``runtime/engine.py``, or a phone SoC's device model, ``simulate/phone.py``). If keeping
every path lengthens the predicted prefill by at most ``QuantConfig.shadow_share`` over keeping
none, nothing is pruned and no importance profile is needed. Otherwise paths go in order of time
saved per unit of accuracy lost (``seconds / importance``), until the kept ones add at most that
share, or until the accuracy budget stops it: on the calibration text's held-apart windows
(``Calibration.held_ids``: never seen by calibration, never the evaluation text) the quantized
model's mean KL divergence from the float model may grow by at most ``budget`` times its divergence
with every path (1.0: at most double it). The divergence, not the loss on the text's own next
tokens: on a few hundred tokens that loss moves by noise as large as the effect (pruning "improved"
it while the divergence tripled). Both limits are found by bisection along that order (the time
assumed not to grow and the divergence not to fall as more paths go). The choice, with its
predictions and divergences, is cached in the calibration artefact under the target it was made for.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import LlmNpuError
from ..kernels import int8_path, native_ops
from ..kernels.cpu import detect
from .calibrate import Calibration
from .config import QuantConfig
from .importance import importance_key

_TINY = 1e-9        # importance floor: a path whose removal measures no loss goes first


@dataclass
class ShadowCost:
    """What the shadow paths cost one target's prefill of a reference prompt.

    ``seconds``: each shadowed linear's path, seconds per chunk on its processor. ``makespan``:
    predicted prefill seconds with the paths named kept (every other one pruned)."""
    target: str
    seconds: dict[str, float]
    makespan: Callable[[frozenset], float]


# The phone model's device profiles, read as bytes (not imported: simulate/ is a later stage). A SoC's
# choice is priced by them, so it is kept under their digest and made again when they change.
_DEVICES = Path(__file__).resolve().parents[1] / "simulate" / "devices"


PHONE_PRICING = "pieces1"   # the phone model's pricing rules (simulate/cost.py): a change makes SoC choices anew


@lru_cache(maxsize=1)
def _devices_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_DEVICES.glob("*.json")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def target_key(config: QuantConfig) -> str:
    """Where a choice holds: a SoC by name and the profiles that price it; the host by its CPU and
    kernels (an engine profile is theirs)."""
    if config.pruning_target != "host":
        return f"{config.pruning_target}@{_devices_digest()}/{PHONE_PRICING}"
    return f"host:{detect().model}:{int8_path.current()}:{native_ops.library_digest()}"


def auto_key(config: QuantConfig) -> str:
    ranking = importance_key(config) if config.importance == "output" else f"ratio/p{config.clip_percentile}"
    return f"auto2/{ranking}/budget{config.pruning_budget}/share{config.shadow_share}/{target_key(config)}"


def is_auto(config: QuantConfig) -> bool:
    return config.outliers == "shadow" and config.pruning_rate == "auto"


def chosen(calib: Calibration, config: QuantConfig) -> dict | None:
    """The cached choice for ``config`` ({"rate", "pruned", the predictions and losses}), if made."""
    return calib.pruning.get(auto_key(config))


def needs_choice(calib: Calibration, config: QuantConfig) -> bool:
    return is_auto(config) and chosen(calib, config) is None


def must_prune(cost: ShadowCost, config: QuantConfig) -> bool:
    """Whether keeping every shadow path costs more than the allowed share of the predicted prefill."""
    return cost.makespan(frozenset(cost.seconds)) > (1 + config.shadow_share) * cost.makespan(frozenset())


@torch.inference_mode()
def mean_loss(model: nn.Module, ids: Tensor) -> float:
    """Mean next-token cross entropy of ``model`` over the windows ``ids`` [n, L]."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


@torch.inference_mode()
def log_probs(model: nn.Module, ids: Tensor) -> list[Tensor]:
    """Per window of ``ids`` [n, L], the model's next-token log-probabilities [L, V]."""
    return [model(input_ids=row[None], use_cache=False).logits[0].float().log_softmax(-1) for row in ids]


@torch.inference_mode()
def divergence(model: nn.Module, ids: Tensor, reference: list[Tensor]) -> float:
    """Mean KL(reference || model) per token over the windows ``ids``."""
    total = sum(float(F.kl_div(lp, ref, log_target=True, reduction="sum"))
                for lp, ref in zip(log_probs(model, ids), reference))
    return total / ids.numel()


def _bisect(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The smallest p in (lo, hi] with ok(p), given not ok(lo) and ok(hi) (ok assumed monotone)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def choose(model: nn.Module, layers: dict, calib: Calibration, config: QuantConfig,
           importance: Callable[[], dict[str, float]], reference: Callable[[], list[Tensor]],
           cost: ShadowCost) -> dict:
    """The shadow paths to prune in ``model``, whose linears are the quantized ``layers`` (QuantLinear,
    every shadow path built). ``importance`` (per layer) and ``reference`` (the float model's
    ``log_probs`` of the held-apart windows) are called only if something must go. Leaves every
    layer unpruned."""
    names = sorted(n for n in cost.seconds if n in layers)
    everything, nothing = cost.makespan(frozenset(names)), cost.makespan(frozenset())
    allowed = (1 + config.shadow_share) * nothing
    out = {"target": cost.target, "rate": 0.0, "pruned": [], "makespan_all_s": everything,
           "makespan_none_s": nothing, "makespan_s": everything, "evaluations": 0.0}
    if everything <= allowed:
        return out
    if calib.held_ids is None:
        raise LlmNpuError("pruning_rate='auto' needs held-apart calibration text, and this calibration has none "
                          "(its text is too short for the gaps between samples): give a longer calibration text "
                          "or a pruning rate in [0, 1]")
    imp = importance()
    ref = reference()
    order = sorted(names, key=lambda n: (-cost.seconds[n] / max(imp[n], _TINY), n))
    kls: dict[int, float] = {}

    def kl(p: int) -> float:
        if p not in kls:
            pruned = set(order[:p])
            for name, q in layers.items():
                q.pruned = name in pruned
            kls[p] = divergence(model, calib.held_ids, ref)
        return kls[p]

    try:
        p = _bisect(lambda k: cost.makespan(frozenset(order[k:])) <= allowed, 0, len(order))
        limit = kl(0) * (1 + config.pruning_budget)
        if kl(p) > limit:     # accuracy stops first: the most paths within the budget
            p = _bisect(lambda k: kl(k) > limit, 0, p) - 1
        if p and cost.makespan(frozenset(order[p:])) >= everything:
            p = 0             # what the budget lets go buys no time: keep every path
    finally:
        for q in layers.values():
            q.pruned = False
    out.update(rate=p / len(order), pruned=order[:p], makespan_s=cost.makespan(frozenset(order[p:])),
               kl_all=kls[0], kl=kls[p], evaluations=float(len(kls)))
    return out


def pruned_layers(calib: Calibration, config: QuantConfig) -> set[str]:
    """The layers an "auto" config prunes, from its cached choice."""
    choice = chosen(calib, config)
    if choice is None:
        raise LlmNpuError(f"the automatic pruning for {config.pruning_target} is not chosen yet: it is chosen with "
                          f"the engine on this machine (Prefiller, or runtime.engine.choose_host_pruning) or, for a phone SoC, "
                          f"with its device model (llmnpu simulate / llmnpu export --soc); or give a pruning rate "
                          f"in [0, 1]")
    return set(choice["pruned"])


def resolve(config: QuantConfig, calib: Calibration) -> QuantConfig:
    """``config`` with an "auto" pruning rate replaced by the share of paths it chose to prune."""
    if not is_auto(config):
        return config
    pruned_layers(calib, config)
    return dataclasses.replace(config, pruning_rate=chosen(calib, config)["rate"])
