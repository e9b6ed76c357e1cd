"""Peak memory of a program's two runners against llama.cpp on the same model, each in a fresh process.

Usage: python benchmarks/bench_memory.py model.pte [--new-tokens 16] [--prompt-file examples/prompt.txt]
(a cpu-int8 program: `llmnpu export --backend cpu-int8 --out smol.pte`, or with `--model random:qwen2-0.5b`;
llama.cpp comes from the ``bench`` extra: `.venv/bin/pip install -e '.[bench]'`.)

The prompt is the demo's (``examples/prompt.txt`` in the chat template: 517 tokens). Each runner prefills
it and decodes ``--new-tokens`` in its own process; the figure is that process's peak resident set
(``ru_maxrss`` of the child), with the program's files (or llama.cpp's GGUF) out of the page cache
first, as after a fresh start. The reference is llama.cpp (cyllama) on the same GGUF requantized to
Q8_0 with llama.cpp's own ``model_quantize``, with the program's context length and the same prompt,
in a process that imports cyllama only. For the embedded model only (its GGUF ships in the package).

Every program is also measured against what it cannot do without: its INT8 weights (the delegates'
named data), its K/V at the context length and its two largest arenas (one per prefill lane), the
issue's reference for models without a GGUF here (``--model random:qwen2-0.5b`` exports); llama.cpp
and the Python runner run only for the embedded model.

The table beside the figures splits what the program asks for: its planned arenas (all methods, and
the largest per lane: what one arena per lane holds), its weights (the program's constants and its
delegates' named data), the hot shadow rows among them, and the decode K/V at the context length.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2 ** 20
REPO = Path(__file__).resolve().parents[1]


def _out_of_page_cache(*files: Path) -> None:
    """Drop ``files``' pages from the page cache, so that each run reads them as an app started
    afresh would. A file just written stays cached in large folios, and a fault in a mapped large
    folio maps all of it: the float16 embedding table of a program read right after its export
    showed 47 MiB resident after the prefill's lookups instead of 11."""
    for f in files:
        if f.exists():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _peak_of(cmd: list[str], stdin: str = "", env: dict | None = None, files: tuple = ()) -> tuple[float, str]:
    """``cmd``'s peak RSS in MiB, read by the child itself at exit (``resource`` in a wrapper); ``files``
    are dropped from the page cache first."""
    _out_of_page_cache(*files)
    wrapper = ("import os, resource, subprocess, sys\n"
               "p = subprocess.run(sys.argv[1:], input=sys.stdin.read(), capture_output=True, text=True)\n"
               "sys.stdout.write(p.stdout)\n"
               "sys.stderr.write(p.stderr)\n"
               "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
               "sys.exit(p.returncode)\n")
    done = subprocess.run([sys.executable, "-c", wrapper, *cmd], input=stdin, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{cmd[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    lines = done.stdout.splitlines()
    peak = next(int(line.split()[1]) for line in lines if line.startswith("PEAK_KIB"))
    return peak / 1024, "\n".join(line for line in lines if not line.startswith("PEAK_KIB"))


def program_parts(pte: Path, meta: dict) -> dict:
    """What the program asks for, in MiB, read from the .pte and its sidecar."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pp = deserialize_pte_binary(pte.read_bytes())
    plans = {p.name: sum(p.non_const_buffer_sizes[1:]) for p in pp.program.execution_plan}
    lane = {e["method"]: e["processor"] for e in meta["subgraphs"]}
    lane[meta["decode"]["method"]] = "cpu"
    largest = {p: max((b for m, b in plans.items() if lane.get(m) == p), default=0) for p in ("npu", "cpu")}
    constants = sum(len(b.storage) for b in pp.program.constant_buffer)
    named = sum(len(b) for b in pp.named_data.buffers)
    m = meta["model"]
    hot = sum((lin["in_features"] - len(lin["cold_channels"])) * lin["out_features"] * 4
              for lin in meta["shadow"].get("linears", {}).values())
    kv = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * meta["context"] * 4
    return {"file": pte.stat().st_size / MiB, "arenas_all_methods": sum(plans.values()) / MiB,
            "arenas_one_per_lane": sum(largest.values()) / MiB, "weights_constants": constants / MiB,
            "weights_named_data": named / MiB, "hot_rows_fp32": hot / MiB, "kv_at_context": kv / MiB,
            "methods": len(plans)}


def prompt_ids(pte: Path, prompt_file: Path) -> list[int]:
    """The demo's prompt ids: ``llmnpu run --chat``'s own tokenization."""
    from transformers import AutoTokenizer

    from llmnpu_delegate.generation import prompt_ids as chat_ids

    tok = AutoTokenizer.from_pretrained(str(pte.with_suffix(".tokenizer")))
    return chat_ids(tok, str(pte), prompt_file.read_text(), chat=True).reshape(-1).tolist()


def native_peak(pte: Path, ids: list[int], new_tokens: int, *flags: str) -> float:
    from llmnpu_delegate.runtime.native import find_runner, runner_env

    meta = json.loads(pte.with_suffix(".json").read_text())
    cmd = [str(find_runner()), "--pte", str(pte), "--prompt-ids", "-", "--max-new-tokens", str(new_tokens), *flags]
    return _peak_of(cmd, " ".join(map(str, ids)), runner_env(meta), _program_files(pte))[0]


def python_peak(pte: Path, ids: list[int], new_tokens: int) -> float:
    code = ("import sys, torch\n"
            "from llmnpu_delegate.runtime.pte_runner import PteRunner\n"
            "ids = torch.tensor([int(t) for t in sys.stdin.read().split()])\n"
            f"PteRunner({str(pte)!r}).generate(ids, {new_tokens})\n")
    return _peak_of([sys.executable, "-c", code], " ".join(map(str, ids)), files=_program_files(pte))[0]


def _program_files(pte: Path) -> tuple[Path, ...]:
    from llmnpu_delegate.format.sidecar import rows_path

    return pte, rows_path(pte)


def llamacpp_peak(ids: list[int], new_tokens: int, context: int, workdir: Path) -> float:
    from llmnpu_delegate.models import SMOLLM2_GGUF, smollm2_folder

    q8 = workdir / "smollm2-q8_0.gguf"
    if not q8.exists():
        code = ("import sys\nfrom cyllama.llama import llama_cpp as cy\ncy.disable_logging()\n"
                "p = cy.LlamaModelQuantizeParams()\np.ftype = 7\np.allow_requantize = True\n"   # Q8_0; the shipped GGUF is Q4_1
                "cy.model_quantize(sys.argv[1], sys.argv[2], p)\n")
        subprocess.run([sys.executable, "-c", code, str(smollm2_folder() / SMOLLM2_GGUF), str(q8)], check=True,
                       capture_output=True)
    code = ("import sys\nfrom cyllama.llama import llama_cpp as cy\n"
            "cy.disable_logging(); cy.ggml_backend_load_all()\n"
            "tokens = [int(t) for t in sys.stdin.read().split()]\n"
            "model = cy.LlamaModel(sys.argv[1], cy.LlamaModelParams())\n"
            "p = cy.LlamaContextParams(); p.n_ctx = int(sys.argv[2]); p.n_batch = p.n_ubatch = len(tokens)\n"
            "p.n_threads = p.n_threads_batch = 2\n"
            "ctx = cy.LlamaContext(model, p)\n"
            "s = cy.LlamaSampler(cy.LlamaSamplerChainParams()); s.add_greedy()\n"
            "ctx.decode(cy.llama_batch_get_one(tokens)); t = s.sample(ctx, -1)\n"
            "for i in range(int(sys.argv[3]) - 1):\n"
            "    ctx.decode(cy.llama_batch_get_one([t], len(tokens) + i)); t = s.sample(ctx, -1)\n")
    return _peak_of([sys.executable, "-c", code, str(q8), str(context), str(new_tokens)], " ".join(map(str, ids)),
                    files=(q8,))[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pte", type=Path)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-file", type=Path, default=REPO / "examples" / "prompt.txt")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    meta = json.loads(args.pte.with_suffix(".json").read_text())
    ids = prompt_ids(args.pte, args.prompt_file)[: meta["context"] - args.new_tokens]   # a small program's context
    parts = program_parts(args.pte, meta)
    essential = parts["weights_named_data"] + parts["kv_at_context"] + parts["arenas_one_per_lane"]
    embedded = meta["model"]["spec"] == "smollm2-135m" and not meta["model"].get("blocks")
    result = {"cpu": _cpu(), "prompt_tokens": len(ids), "context": meta["context"], "new_tokens": args.new_tokens,
              "program": {k: round(v, 1) for k, v in parts.items()},
              "int8_weights_kv_two_arenas_mib": round(essential, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        peaks = {}
        if embedded:
            peaks["llama.cpp (Q8_0)"] = llamacpp_peak(ids, args.new_tokens, meta["context"], Path(tmp))
        peaks["native runner"] = native_peak(args.pte, ids, args.new_tokens)
        if embedded:
            peaks["Python runner"] = python_peak(args.pte, ids, args.new_tokens)
    result["peak_rss_mib"] = {k: round(v, 1) for k, v in peaks.items()}
    result["vs_weights_kv_arenas"] = {k: round(v / essential, 2) for k, v in peaks.items()}
    if embedded:
        result["vs_llamacpp"] = {k: round(v / peaks["llama.cpp (Q8_0)"], 2) for k, v in peaks.items()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['cpu']}; prompt {len(ids)} tokens, context {meta['context']}, {args.new_tokens} new tokens")
    print(f"  INT8 weights + K/V at the context + two largest arenas: {essential:.1f} MiB")
    for k, v in peaks.items():
        vs = f"   {v / peaks['llama.cpp (Q8_0)']:5.2f}x llama.cpp" if embedded else ""
        print(f"  {k:<20} peak RSS {v:8.1f} MiB   {v / essential:5.2f}x weights+K/V+arenas{vs}")
    print("  program:", ", ".join(f"{k} {v}" for k, v in result["program"].items()))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
