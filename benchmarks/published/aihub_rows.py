"""Extract the phone prefill measurements that `llmnpu simulate` is fitted and validated on.

Source: Qualcomm AI Hub's per-device tables as the PyPI package `qai-hub-models` ships them
(`qai_hub_models/models/<model>/perf.yaml`, and each model's `model.py` for the number of graphs
it is split into). Nothing is fetched at run time: get the wheel and unpack it, then

    pip download --no-deps -d /tmp/aihub qai-hub-models==0.65.0
    unzip -q /tmp/aihub/qai_hub_models-0.65.0-py3-none-any.whl -d /tmp/aihub/w
    python benchmarks/published/aihub_rows.py /tmp/aihub/w

writes `llmnpu_delegate/simulate/data/aihub.csv` (what the fit and `--validate` read) and
`llmnpu_delegate/simulate/data/aihub_graph_execute.csv` (what one graph execute costs, below).

What a row means (read from the package's own code, `models/templates/llm/perf_collection.py`
and `utils/llm/{genie,geniex}/jobs.py`):
- `geniex_qairt`, `geniex_llamacpp`: `prefill_tokens_per_second` is geniex-bench's median prompt rate
  on the shipped perf prompt for the context (`utils/llm/perf_prompts/sample_prompt_<n>.txt`, the
  largest n not above the context, in the chat template); the time-to-first-token range is derived
  from the rate. Its token count is not published: `prompt_tokens` counts it with the embedded
  model's tokenizer and chat template, a proxy (Qwen3's and Llama 3's tokenizers are not shipped
  here; their larger vocabularies give somewhat fewer tokens).
- `genie`: Genie's own prompt-processing rate and time to first token on one short prompt; their
  product is that prompt's token count (36 for the Qwen tokenizer, 56 for Llama's), kept as
  `prompt_tokens`.
- `aihub_graph_execute.csv`: the fastest whole-model QNN rows per SoC (`qnn_dlc` or
  `qnn_context_binary`, every layer on the NPU): `inference_time_milliseconds` of a small model is
  one graph execute on that phone's NPU, so it bounds from above what any graph execute costs
  before its work (`npu.graph_launch_s`). SM8550 has no phone among the package's devices; its
  rows are AI Hub's "QCS8550 (Proxy)", the same silicon.
Only phones the simulator has profiles for, text-only models whose shape `families.py` declares,
and rows with a non-zero rate are kept; the rest is listed on stderr with the reason.
"""
from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import yaml

PACKAGE = "qai-hub-models==0.65.0"
DATA = Path(__file__).resolve().parents[2] / "llmnpu_delegate" / "simulate" / "data"
OUT, EXECUTES = DATA / "aihub.csv", DATA / "aihub_graph_execute.csv"
PHONES = {"Samsung Galaxy S25": "SM8750", "Samsung Galaxy S26": "SM8850"}
# devices whose single-graph rows bound a graph execute (the LLM rows' phones and two older SoCs)
EXECUTE_DEVICES = {**PHONES, "Samsung Galaxy S24": "SM8650", "QCS8550 (Proxy)": "SM8550"}
QNN_GRAPH_RUNTIMES = ("qnn_dlc", "qnn_context_binary")
FASTEST = 5         # rows kept per SoC: the fit reads the fastest, the others show it is not a lone figure
# AI Hub model id -> (our random: shape, nominal size in billions of parameters)
MODELS = {
    "qwen3_0_6b": ("qwen3-0.6b", 0.6), "qwen3_1_7b": ("qwen3-1.7b", 1.7), "qwen3_4b": ("qwen3-4b", 4.0),
    "qwen3_4b_instruct_2507": ("qwen3-4b", 4.0), "qwen3_8b": ("qwen3-8b", 8.0),
    "llama_v3_2_1b_instruct": ("llama-1b", 1.0), "llama_v3_2_3b_instruct": ("llama-3b", 3.0),
    "llama_v3_1_8b_instruct": ("llama-8b", 8.0), "llama_v3_8b_instruct": ("llama-8b", 8.0),
    "llama_v3_1_sea_lion_3_5_8b_r": ("llama-8b", 8.0), "llama_v3_taide_8b_chat": ("llama-8b", 8.0),
    "llama_v3_elyza_jp_8b": ("llama-8b", 8.0), "smollm2_1_7b_it": ("smollm2-1.7b", 1.7),
    "falcon_v3_7b_instruct": ("falcon3-7b", 7.0),
}
EXECUTE_COLUMNS = ["source", "device", "soc", "model_id", "component", "precision", "runtime", "layers",
                   "inference_ms"]
COLUMNS = ["source", "device", "soc", "model_id", "shape", "size_b", "precision", "runtime", "context",
           "prompt_tokens", "graphs", "prefill_tok_s"]


def splits(model_dir: Path) -> int | None:
    """The number of graphs the model is exported in (NUM_SPLITS of its model.py)."""
    src = model_dir / "model.py"
    m = re.search(r"^NUM_SPLITS\s*=\s*(\d+)", src.read_text(), re.M) if src.is_file() else None
    return int(m.group(1)) if m else None


def entries(root: Path) -> list[tuple]:
    """Every (model dir, precision, component, device, runtime, metrics) of the package's perf tables,
    each file parsed once."""
    out = []
    for perf in sorted((root / "qai_hub_models" / "models").glob("*/perf.yaml")):
        doc = yaml.safe_load(perf.read_text()) or {}
        for precision, pd in (doc.get("precisions") or {}).items():
            for component, cd in (pd.get("components") or {}).items():
                for device, dd in (cd.get("performance_metrics") or {}).items():
                    for runtime, m in (dd or {}).items():
                        out.append((perf.parent, precision, component, device, runtime, m or {}))
    return out


def rows(perf: list[tuple]):
    for model_dir, precision, _, device, runtime, rd in perf:
        for m in rd.get("llm_metrics") or []:
            yield model_dir.name, precision, device, runtime, m, model_dir


def graph_execute_rows(perf: list[tuple]) -> list[dict]:
    """The ``FASTEST`` whole-model QNN rows per SoC with every layer on the NPU."""
    by_soc: dict[str, list[dict]] = {}
    for model_dir, precision, component, device, runtime, m in perf:
        counts = m.get("layer_counts") or {}
        if (device not in EXECUTE_DEVICES or runtime not in QNN_GRAPH_RUNTIMES
                or not m.get("inference_time_milliseconds") or not counts.get("total")
                or counts.get("npu") != counts["total"]):
            continue
        by_soc.setdefault(EXECUTE_DEVICES[device], []).append({
            "source": f"{PACKAGE} models/{model_dir.name}/perf.yaml", "device": device,
            "soc": EXECUTE_DEVICES[device], "model_id": model_dir.name, "component": component,
            "precision": precision, "runtime": runtime, "layers": counts["total"],
            "inference_ms": float(m["inference_time_milliseconds"])})
    return [r for soc in sorted(by_soc) for r in sorted(by_soc[soc], key=lambda r: r["inference_ms"])[:FASTEST]]


def write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def prompt_tokens(root: Path) -> dict[int, int]:
    """Context -> tokens of the perf prompt geniex-bench feeds at that context (see the docstring)."""
    from llmnpu_delegate.models import DEFAULT_MODEL, load_model

    tok = load_model(DEFAULT_MODEL).tokenizer
    prompts = {int(re.search(r"(\d+)", p.stem).group(1)): p.read_text()
               for p in (root / "qai_hub_models" / "utils" / "llm" / "perf_prompts").glob("sample_prompt_*.txt")}

    def count(ctx: int) -> int:
        size = max((s for s in prompts if s <= ctx), default=min(prompts))
        ids = tok.apply_chat_template([{"role": "user", "content": prompts[size]}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        return len(ids)

    return {ctx: count(ctx) for ctx in (512, 1024, 2048, 3072, 4096)}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "qai_hub_models").is_dir():
        print(f"usage: aihub_rows.py UNPACKED_WHEEL_DIR (the unpacked {PACKAGE} wheel; see the docstring)",
              file=sys.stderr)
        return 2
    kept, skipped = [], {}
    perf_prompt = prompt_tokens(Path(argv[0]))
    perf = entries(Path(argv[0]))
    for model_id, precision, device, runtime, m, model_dir in rows(perf):
        if m.get("desired_compute_unit", "npu") != "npu":
            continue
        why = ("not a phone with a profile" if device not in PHONES else
               "no declared shape (multimodal, or an architecture not modelled)" if model_id not in MODELS else
               "zero rate (a failed run)" if not m.get("prefill_tokens_per_second") else None)
        if why:
            skipped.setdefault(why, set()).add(model_id if device in PHONES else device)
            continue
        rate = float(m["prefill_tokens_per_second"])
        ttft = (m.get("time_to_first_token_range_milliseconds") or {}).get("min")
        prompt = round(rate * ttft / 1e3) if runtime == "genie" else perf_prompt[int(m["context_length"])]
        graphs = splits(model_dir) if runtime != "geniex_llamacpp" else ""
        shape, size = MODELS[model_id]
        kept.append({"source": f"{PACKAGE} models/{model_id}/perf.yaml", "device": device, "soc": PHONES[device],
                     "model_id": model_id, "shape": shape, "size_b": size, "precision": precision,
                     "runtime": runtime, "context": int(m["context_length"]), "prompt_tokens": prompt,
                     "graphs": graphs or "", "prefill_tok_s": round(rate, 1)})
    kept.sort(key=lambda r: (r["soc"], r["runtime"], r["model_id"], r["precision"], r["context"]))
    write_csv(OUT, COLUMNS, kept)
    executes = graph_execute_rows(perf)
    write_csv(EXECUTES, EXECUTE_COLUMNS, executes)
    for why, what in skipped.items():
        print(f"skipped ({why}): {', '.join(sorted(what))}", file=sys.stderr)
    print(f"{len(kept)} rows -> {OUT}\n{len(executes)} rows -> {EXECUTES}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
