"""The decode method's K/V cache, as the program format states it and every runner holds it.

A static cache of ``context`` slots per layer that the ``decode`` method only reads: K as
``[1, KVH, d, context]`` (transposed, so ``q @ K`` needs no copy) and V as ``[1, KVH, context, d]``,
method inputs outside ExecuTorch's memory plan, so the runtime reads the runner's memory in place.
The runner writes a prefill's K/V into slots ``0..T-1`` once, then each step's new row at its
position (``lower/decode_method.py`` says why this layout).

This is the one K/V layout of the program format, read by both runners (Python and C++). The HF
door keeps transformers' own ``[1, KVH, T, d]`` caches (``runtime/hf_decoder.DecodeCache`` is a
``StaticCache``), because that is what ``generate``'s callers hold and pass back; prefill K/V reach
the program's layout through ``write_prefill`` only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

METHOD = "decode"


@dataclass
class KVCache:
    """The decode method's static cache: per layer K [1, KVH, d, T] (transposed) and V [1, KVH, T, d];
    ``length`` slots are filled."""
    k: list[Tensor]
    v: list[Tensor]
    length: int = 0


def empty_cache(kv, context: int) -> tuple[list[Tensor], list[Tensor]]:
    """The method's K/V inputs: per layer K [1, KVH, d, context] (transposed) and V [1, KVH, context, d]."""
    return ([torch.zeros(1, kv.kv_heads, kv.head_dim, context) for _ in range(kv.layers)],
            [torch.zeros(1, kv.kv_heads, context, kv.head_dim) for _ in range(kv.layers)])


def write_prefill(k_cache: list[Tensor], v_cache: list[Tensor], past_k: list[Tensor], past_v: list[Tensor]) -> int:
    """Write a prefill's per-layer K/V [1, KVH, T, d] into slots 0..T-1; returns T."""
    t = past_k[0].shape[2]
    for k_all, v_all, k, v in zip(k_cache, v_cache, past_k, past_v):
        k_all[..., :t] = k.transpose(2, 3)
        v_all[:, :, :t] = v
    return t


def write_slot(k_cache: list[Tensor], v_cache: list[Tensor], pos: int, k_new, v_new) -> None:
    """Write one step's new K/V (per layer [1, KVH, 1, d], the method's outputs) into slot ``pos``."""
    for k_all, v_all, k, v in zip(k_cache, v_cache, k_new, v_new):
        k_all[0, :, :, pos] = k[0, :, 0]
        v_all[0, :, pos] = v[0, :, 0]


def describe(mode: str, kv, context: int, hot_inputs: dict[str, list[int]]) -> dict:
    """The sidecar's ``decode`` entry: the method, the input channels its INT8 linears take through
    float rows, its inputs and outputs, and the K/V layout."""
    L = kv.layers
    return {"method": METHOD, "mode": mode, "backend": "xnnpack", "hot_inputs": hot_inputs,
            "inputs": ["input_ids [1, 1] int64", "cache_position [1] int64",
                       f"k_cache x {L}: [1, {kv.kv_heads}, {kv.head_dim}, {context}] float32 (K transposed)",
                       f"v_cache x {L}: [1, {kv.kv_heads}, {context}, {kv.head_dim}] float32"],
            "outputs": ["logits [1, vocab] float32", f"k_new x {L}: [1, {kv.kv_heads}, 1, {kv.head_dim}]",
                        f"v_new x {L}: [1, {kv.kv_heads}, 1, {kv.head_dim}]"],
            "kv_layout": "static cache of `context` slots per layer, read in place (not memory-planned); "
                         "slots >= cache_position are not read; the runner writes k_new/v_new at slot cache_position"}
