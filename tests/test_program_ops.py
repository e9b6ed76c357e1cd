"""The program's own attention kernel (runner/ops/, `llmnpu::chunk_attention.out`) inside ExecuTorch,
on each of its vector paths, against a float64 reference of the same attention.

Each path runs in a process of its own (the kernel picks its path once per process): this CPU's
best, then capped at AVX2 and at the baseline with LLMNPU_OPS_ISA. The whole-program checks (both
runners' bits, the Arm64 build's tokens) are in tests/test_native.py.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.kernels import chunk_attention  # noqa: F401  (registers the op and its out variant)
from llmnpu_delegate.runtime import program_ops

# heads, kv heads, queries, past, head size, mask
CASES = [
    (9, 3, 64, 0, 64, "causal"),          # the embedded model's heads, a first chunk
    (9, 3, 64, 150, 64, "causal"),        # the same after a past that ends mid-strip
    (9, 3, 64, 150, 64, "additive"),      # the mask as 0 / -inf floats
    (9, 3, 64, 150, 64, "window-hole"),   # a sliding window with one hidden key: not one run of keys
    (9, 3, 64, 150, 64, "blind-rows"),    # some queries see no key: their output is zero
    (8, 2, 40, 9, 128, "causal"),         # a wider head
    (4, 2, 33, 0, 16, "causal"),          # the tests' tiny models' head size
    (14, 2, 1, 70, 64, "causal"),         # one query (seven heads per K/V head)
    (4, 4, 17, 3, 48, "window-hole"),     # no grouping, a head size that is not a strip's multiple
]


def _mask(kind: str, c: int, past: int) -> torch.Tensor:
    length = past + c
    keys, pos = torch.arange(length)[None, :], torch.arange(past, length)[:, None]
    keep = keys <= pos
    if kind == "window-hole":
        keep &= keys > pos - 24
        keep[:, max(past - 5, 0)] = False
    if kind == "blind-rows":
        keep[::7] = False
    if kind == "additive":
        return torch.where(keep, 0.0, float("-inf"))[None, None]
    return keep[None, None]


def _reference(q, k, v, keep: torch.Tensor, scaling: float) -> torch.Tensor:
    """float64, the query heads of a K/V head sharing it; rows that see nothing are zero."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() * scaling) @ k.transpose(-1, -2)
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)[0]          # [C, H, d]


class _Attend(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.ops.llmnpu.chunk_attention(q, k, v, mask, 0.125, 0.0)


def run_cases(folder: Path) -> dict:
    """Every case's program (``folder``/case<i>.pte, its inputs in .pt) on this process's path."""
    from executorch.runtime import Runtime

    isa = program_ops.load()
    outputs = []
    for i in range(len(CASES)):
        inputs = torch.load(folder / f"case{i}.pt")
        method = Runtime.get().load_program(folder / f"case{i}.pte").load_method("forward")
        outputs.append(method.execute(inputs)[0].numpy().tolist())
    return {"isa": isa, "outputs": outputs}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Each case as an ExecuTorch program holding only the op, run on each path in its own process;
    per path its outputs and their errors against the reference."""
    from executorch.exir import to_edge_transform_and_lower

    folder = tmp_path_factory.mktemp("ops")
    torch.manual_seed(0)
    wants = []
    for i, (h, kvh, c, past, d, kind) in enumerate(CASES):
        q, k, v = torch.randn(1, h, c, d) * 3, torch.randn(1, kvh, past + c, d), torch.randn(1, kvh, past + c, d)
        mask = _mask(kind, c, past)
        program = to_edge_transform_and_lower(torch.export.export(_Attend(), (q, k, v, mask))).to_executorch()
        (folder / f"case{i}.pte").write_bytes(program.buffer)
        torch.save([q, k, v, mask], folder / f"case{i}.pt")
        wants.append(_reference(q, k, v, mask if mask.dtype == torch.bool else mask == 0, 0.125))
    runs = {}
    for cap in ("", "avx2", "baseline"):
        env = {**os.environ, "LLMNPU_OPS_ISA": cap} if cap else dict(os.environ)
        done = subprocess.run([sys.executable, __file__, str(folder)], capture_output=True, text=True, timeout=600,
                              env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        run = json.loads(done.stdout.strip().splitlines()[-1])
        run["errors"] = [float((torch.tensor(out)[0].double() - want).abs().max() / want.abs().max())
                         for out, want in zip(run["outputs"], wants)]
        runs[cap or "best"] = run
    return runs


def test_every_vector_path_computes_the_attention_of_the_mask(paths):
    """Within 1e-5 of the float64 attention, relative to the largest output (fp32 rounding measured
    ~1e-6; a key wrongly hidden or shown, a skipped tile or an unscaled row is off by ~1e-1)."""
    assert paths["avx2"]["isa"] in ("avx2", "baseline") and paths["baseline"]["isa"] == "baseline"
    for name, run in paths.items():
        for case, err in zip(CASES, run["errors"]):
            assert err <= 1e-5, (name, run["isa"], case, err)


def test_the_paths_agree_with_each_other(paths):
    """The paths sum in the same order but for the softmax's total (and x86 baseline's FMA-less
    products): they agree far inside the reference tolerance."""
    best = paths["best"]["outputs"]
    for name in ("avx2", "baseline"):
        for case, a, b in zip(CASES, best, paths[name]["outputs"]):
            a, b = np.asarray(a), np.asarray(b)
            assert np.abs(a - b).max() <= 2e-6 * np.abs(a).max(), (name, case)


def test_blind_rows_are_zero_and_every_other_row_is_not(paths):
    i = [c[-1] for c in CASES].index("blind-rows")
    out = np.asarray(paths["best"]["outputs"][i])[0]     # [C, H, d]
    blind = np.zeros(out.shape[0], bool)
    blind[::7] = True
    assert (out[blind] == 0).all() and (np.abs(out[~blind]).max(axis=(1, 2)) > 0).all()


def test_the_shadow_operators_give_the_aten_ops_bits():
    """``llmnpu::shadow_hits`` and ``shadow_gather`` (runner/ops/shadow.cpp) in an ExecuTorch program,
    against clamp / sub / abs / amax / index_select in torch: the same bits, on inputs with values on,
    inside and beyond the clip, a channel count that is not a multiple of the vector width, rank 2
    and 3."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from llmnpu_delegate.lower import shadow_branches  # noqa: F401  (registers the ops)

    program_ops.load()
    clip = 2.5

    class Branch(torch.nn.Module):
        def __init__(self, hot):
            super().__init__()
            self.register_buffer("hot", hot)

        def forward(self, x):
            return (torch.ops.llmnpu.shadow_hits(x, clip), torch.ops.llmnpu.shadow_gather(x, self.hot, clip))

    torch.manual_seed(1)
    for shape in ((64, 1538), (2, 37, 50)):
        x = torch.randn(shape) * 2
        x.view(-1)[::11] = clip
        x.view(-1)[5::13] = -clip
        x[..., 3] = 0.5                                    # a channel that never crosses the clip
        hot = torch.tensor([0, 3, 7, shape[-1] - 1])
        program = to_edge_transform_and_lower(torch.export.export(Branch(hot), (x,))).to_executorch()
        hits, gathered = Runtime.get().load_program(program.buffer).load_method("forward").execute([x])
        residue = x - torch.clamp(x, -clip, clip)
        want_hits = torch.amax(residue.abs(), list(range(x.dim() - 1)))
        assert hits.numpy().tobytes() == want_hits.numpy().tobytes()
        assert gathered.numpy().tobytes() == torch.index_select(residue, -1, hot).numpy().tobytes()
        assert hits[3] == 0 and (hits > 0).sum() > shape[-1] // 2


def test_a_missing_kernel_library_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMNPU_OPS", str(tmp_path / "libllmnpu_ops.so"))
    program_ops.load.cache_clear()
    try:
        with pytest.raises(LlmNpuError, match=r"not built .*make runner") as e:
            program_ops.load()
        assert "\n" not in str(e.value)
    finally:
        monkeypatch.delenv("LLMNPU_OPS")
        program_ops.load.cache_clear()
    assert program_ops.load() in ("avx512", "avx2", "baseline")


if __name__ == "__main__":
    print(json.dumps(run_cases(Path(sys.argv[1]))))
