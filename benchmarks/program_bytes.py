"""A program's bytes on disk by component, against its model's INT8 weight bytes.

Usage: python benchmarks/program_bytes.py model.pte [other.pte ...]

For each program (its ``.pte`` and, when it has one, its cold rows file): the delegates' payloads per
backend (QNN's context binaries, XNNPACK's graphs), XNNPACK's named data (its weights: INT8 codes,
their scales, float weights) of which the codes the shadow paths read as cold rows, the constants
outside any delegate (the float16 embedding table), the rows file, and the rest (the program's plans).
The reference is the model's INT8 weight bytes: one byte per weight of its decoder linears and its
embedding table (the LM head is the table where the family ties them, else counted apart).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MiB = 2 ** 20


def int8_weight_bytes(spec: str) -> int:
    """One byte per weight of the model's decoder linears, its embedding and an untied LM head."""
    from torch import nn

    from llmnpu_delegate.models import decoder_layers, load_model, model_skeleton

    model = model_skeleton(spec) if spec.startswith("random:") else load_model(spec).model
    linears = sum(m.weight.numel() for m in decoder_layers(model).modules() if isinstance(m, nn.Linear))
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return linears + table.numel() + (0 if head is table or model.config.tie_word_embeddings else head.numel())


def program_bytes(pte: Path) -> dict:
    """Bytes of each component of the program at ``pte`` (and its rows file)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    from llmnpu_delegate.format.sidecar import rows_path, sidecar_path

    meta = json.loads(sidecar_path(pte).read_text())
    pf = deserialize_pte_binary(pte.read_bytes())
    program = pf.program
    delegates: dict[str, int] = {}
    seen = set()
    for plan in program.execution_plan:
        for d in plan.delegates:
            if d.processed.index not in seen:           # a method shared by several subgraphs: its payload once
                seen.add(d.processed.index)
                delegates[d.id] = delegates.get(d.id, 0) + len(program.backend_delegate_data[d.processed.index].data)
    named = dict(zip(pf.named_data.pte_data.keys(), pf.named_data.buffers)) if pf.named_data else {}
    scales = sum(len(b) for k, b in named.items() if k.startswith("scale_"))
    shadow = meta["shadow"].get("linears", {})
    rows = sum(lin["in_features"] * lin["out_features"] for lin in shadow.values() if lin.get("rows_in") == "program")
    rows_file = rows_path(pte)
    parts = {f"delegate payloads, {k}": v for k, v in sorted(delegates.items())}
    parts.update({"named data: cold rows read from it (shadowed linears' INT8 codes)": rows,
                  "named data: other weights": sum(len(b) for b in named.values()) - scales - rows,
                  "named data: per-channel scales": scales,
                  "constants outside delegates": sum(len(b.storage) for b in program.constant_buffer),
                  "rows file": rows_file.stat().st_size if rows_file.is_file() else 0})
    total = pte.stat().st_size + parts["rows file"]
    parts["plans, headers, alignment"] = total - sum(parts.values())
    return {"meta": meta, "parts": parts, "total": total}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pte", type=Path, nargs="+")
    args = ap.parse_args(argv)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "unknown CPU"))
    for pte in args.pte:
        got = program_bytes(pte)
        meta = got["meta"]
        spec = meta["model"].get("spec", "?")
        weights = int8_weight_bytes(spec)
        print(f"\n{pte} ({spec}, {meta['target']}{' ' + meta['soc'] if meta.get('soc') else ''}, decode "
              f"{meta['decode']['mode']}): {got['total'] / MiB:.1f} MiB on disk, {got['total'] / weights:.3f}x "
              f"the model's INT8 weight bytes ({weights / MiB:.2f} MiB)")
        for name, b in got["parts"].items():
            print(f"  {name:<68} {b / MiB:9.2f} MiB  {b / weights:6.3f}x")


if __name__ == "__main__":
    sys.exit(main())
