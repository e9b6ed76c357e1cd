"""The sidecar's format: what ``llmnpu export`` writes beside a ``.pte`` and every runner reads.

``SCHEMA`` states each field's JSON type; ``check_sidecar`` checks a loaded sidecar against it and
against itself (indices in range, names that exist), so a runner refuses a malformed sidecar when it
opens it, not in the middle of a prompt. ``sidecar_sha256`` is a checksum of the content: a damaged
or edited sidecar is refused outright (the native runner, without SHA-256, relies on the schema).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import LlmNpuError
from ..paths import file_sha256
from .rows import ROW_DTYPES
from .tasks import data_flow

FORMAT = "llmnpu-pte-sidecar"
# The layout's version: both runners refuse any other. CHANGELOG.md says what each version changed.
VERSION = 13

# An NPU subgraph's method that holds more than linears (``lower/graph_methods.py``) takes and returns
# its tensors by name, as a CPU one does; without a form, it holds linears and takes input groups.
GRAPH = "graph"
# A block norm and the linears it feeds as one integer graph (``lower/norm_region.py``): its input on
# the norm's input grid (``norm``: its block, name and encodings) in; the subgraph's outputs no linear makes, then the linears'
# outputs as a linears-only method gives them, merged into ``linear_outputs``.
NORM_REGION = "norm-region"
# RoPE, the chunk's attention against a fixed K/V window and the linears it feeds as one integer graph
# (``lower/attention_region.py``): the subgraph's inputs by name, the past K/V padded to the window
# and the mask made additive (``npu_io.window_inputs``, ``attention``: which inputs, the window, the
# mask's value, the layer's encodings); out the chunk's new K and V (a runner writes them after the
# past: the ``present`` outputs), the outputs no linear makes, then the linears' parts, merged into
# ``linear_outputs``.
ATTENTION_REGION = "attention-region"
FORMS = (GRAPH, NORM_REGION, ATTENTION_REGION)

NUM = "number"
ANY = "any"
INTS, STRS, NUMS = [int], [str], [NUM]
ENCODING = {"scale": NUM, "zero": int, "bits": int}      # kernels/npu_attention.py Encoding (unsigned)
SIGNED_ENCODING = {**ENCODING, "signed": bool}
# A dict of fields (a trailing "?" marks an optional one), {str: T} a map, [T] a list, a tuple alternatives.
SCHEMA = {
    "format": str, "version": int, "pte": str, "pte_sha256": str, "pte_bytes": int,
    "target": str, "soc": (str, None), "chunk_len": int, "context": int, "quant": {str: ANY}, "export?": {str: ANY},
    "placement": str,
    "model": {"fingerprint": str, "layers": int, "kv_heads": int, "head_dim": int, "vocab_size": int, "spec?": str},
    "graph": {"inputs": STRS, "outputs": STRS},
    "subgraphs": [{"index": int, "method": str, "kind": str, "processor": str, "layer": (int, None), "static": bool,
                   "inputs": STRS, "outputs": STRS, "linears": STRS, "input_groups?": [INTS], "form?": str,
                   "norm?": {"layer": int, "name": str, "x": ENCODING, "weight": ENCODING, "out": ENCODING},
                   "linear_outputs?": STRS,
                   "attention?": {"layer": int, "past": STRS, "present": STRS, "mask": str, "window": int,
                                  "mask_value": NUM, "heads": int,
                                  "encodings": {k: SIGNED_ENCODING for k in ("q", "k", "v", "scores", "out")}},
                   "shadow?": [{"linear": str, "input": int, "output": int, "hits": int}]}],
    "tasks": {"after": [INTS], "after_previous": [INTS], "needed_kv": INTS, "needed_final": INTS, "processors": STRS},
    "linears": {str: {"act_scale": NUM, "output": {"bits": int, "scale?": NUM, "range?": NUMS}, "split_channels": [INTS],
                      "split_outputs": [ANY], "fine_outputs": [{"part": int, "bits": int, "scale": NUM, "range": NUMS}],
                      "shadow": bool, "clip": (NUM, None), "hot_channels": INTS,
                      "peak?": {"channels": INTS, "clip": NUM, "residue": ENCODING, "out": ENCODING}}},
    "pruned_layers": STRS,
    "profile": (None, {"static": {str: NUM}, "dynamic": {str: NUMS}}),
    "shadow": {"form": str, "rows_file?": str, "rows_dtype?": str, "bytes?": int, "rows_sha256?": str,
               "linears?": {str: {"cold_channels": INTS, "rows_offset": int, "in_features": int,
                                  "out_features": int, "clip": NUM, "scales_offset?": int,
                                  "rows_in?": str}}},
    "tokenizer": (None, {"folder": str, "files": STRS, "bos_id": (int, None), "eos_ids": INTS,
                         "chat_template?": (str, None)}),
    "decode": {"method": str, "mode": str, "backend": str, "hot_inputs": {str: INTS}, "inputs": STRS, "outputs": STRS,
               "kv_layout": str},
    "sidecar_sha256": str,
}


def sidecar_path(pte: Path) -> Path:
    return Path(pte).with_suffix(".json")


def rows_path(pte: Path) -> Path:
    return Path(pte).with_suffix(".rows.bin")


def tokenizer_path(pte: Path) -> Path:
    return Path(pte).with_suffix(".tokenizer")


def load_program_tokenizer(meta: dict, pte: Path):
    """The tokenizer written beside an exported program (``llmnpu export``); ``meta``: its sidecar."""
    from transformers import AutoTokenizer

    tok = meta.get("tokenizer")
    if not tok:
        raise LlmNpuError(f"{pte.name} was exported without a tokenizer (its model has none): "
                          "export a model that has one")
    folder = pte.parent / tok["folder"]
    if not folder.is_dir():
        raise LlmNpuError(f"{pte.name}'s tokenizer folder {tok['folder']} is missing: copy it with the .pte")
    return AutoTokenizer.from_pretrained(folder)


def sidecar_digest(meta: dict) -> str:
    """SHA-256 of the sidecar's content without its own checksum, in a canonical JSON form."""
    # as a reader sees it: through JSON once (integer keys become strings and sort as strings)
    body = json.loads(json.dumps({k: v for k, v in meta.items() if k != "sidecar_sha256"}))
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def schema_problem(value, schema, where: str) -> str | None:
    """The first place where ``value`` does not have the type ``schema`` describes, or None."""
    if isinstance(schema, tuple):
        problems = [schema_problem(value, s, where) for s in schema]
        return None if None in problems else problems[0]
    if schema is None:
        return None if value is None else f"{where} is not null"
    if schema == ANY:
        return None
    if schema == NUM:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{where} is not a number"
    if schema in (int, str, bool):
        ok = isinstance(value, schema) and (schema is bool or not isinstance(value, bool))
        return None if ok else f"{where} is not {'an' if schema is int else 'a'} {schema.__name__}"
    if isinstance(schema, list):
        if not isinstance(value, list):
            return f"{where} is not a list"
        return next((p for i, v in enumerate(value) if (p := schema_problem(v, schema[0], f"{where}[{i}]"))), None)
    if not isinstance(value, dict):
        return f"{where} is not an object"
    if list(schema) == [str]:                                   # a map
        return next((p for k, v in value.items() if (p := schema_problem(v, schema[str], f"{where}.{k}"))), None)
    for key, sub in schema.items():
        name = key.rstrip("?")
        if name not in value:
            if key.endswith("?"):
                continue
            return f"{where} lacks {name}"
        if p := schema_problem(value[name], sub, f"{where}.{name}"):
            return p
    return None


def check_sidecar(meta: dict) -> str | None:
    """What is wrong with a loaded sidecar (first problem), or None: types, then cross-references."""
    if p := schema_problem(meta, SCHEMA, "sidecar"):
        return p
    subs, n = meta["subgraphs"], len(meta["subgraphs"])
    for i, e in enumerate(subs):
        if e["index"] != i:
            return f"subgraphs[{i}] has index {e['index']}"
        if unknown := [x for x in e["linears"] if x not in meta["linears"] and e["kind"] == "npu"]:
            return f"subgraphs[{i}] names unknown linears {unknown[:2]}"
        if "form" in e and (e["form"] not in FORMS or e["kind"] != "npu"):
            return f"subgraphs[{i}] has form {e['form']!r}: an NPU subgraph may be one of {', '.join(FORMS)}"
        if e.get("form") == NORM_REGION and ("norm" not in e or len(e.get("linear_outputs", [])) !=
                                             len(e["linears"]) or not set(e["linear_outputs"]) <= set(e["outputs"])
                                             or len(e["inputs"]) != 1):
            return f"subgraphs[{i}] is a {NORM_REGION!r} without one input, its norm's encodings or its linears' outputs"
        if e.get("form") == ATTENTION_REGION and (
                "attention" not in e or len(e.get("linear_outputs", [])) != len(e["linears"])
                or not set(e["linear_outputs"]) <= set(e["outputs"]) or len(e["attention"]["past"]) != 2
                or not {*e["attention"]["past"], e["attention"]["mask"]} <= set(e["inputs"])
                or len(e["attention"]["present"]) != 2 or not set(e["attention"]["present"]) <= set(e["outputs"])):
            return (f"subgraphs[{i}] is an {ATTENTION_REGION!r} without its past, present and mask among its inputs "
                    f"and outputs, or its linears' outputs")
        if e["kind"] == "npu" and e.get("form") != GRAPH and e.get("linears") and \
                sorted(j for g in e.get("input_groups", []) for j in g) != list(range(len(e["linears"]))):
            return f"subgraphs[{i}].input_groups do not cover its linears"
    for name, lin in meta["linears"].items():
        out = lin["output"]
        if out["bits"] not in (8, 16, 32) or (out["bits"] != 32) != ("scale" in out and "range" in out):
            return f"linears.{name}.output is neither an 8- or 16-bit encoding nor a float output"
    shadow = meta["shadow"]
    if shadow["form"] not in ("sparse", "dense"):
        return f"shadow.form is {shadow['form']!r}"
    if shadow["form"] == "sparse":
        if any(k not in shadow for k in ("rows_dtype", "linears")):
            return "a sparse shadow lacks its rows' type or linears"
        if shadow["rows_dtype"] not in ROW_DTYPES:
            return f"shadow.rows_dtype is {shadow['rows_dtype']!r}, not one of {', '.join(ROW_DTYPES)}"
        places = {lin.get("rows_in", "rows_file") for lin in shadow["linears"].values()}
        if places - {"rows_file", "program"}:
            return f"shadow.linears put rows in {sorted(places - {'rows_file', 'program'})[0]!r}"
        if "rows_file" in places and any(k not in shadow for k in ("rows_file", "bytes", "rows_sha256")):
            return "a sparse shadow lacks its rows file"
        if "program" in places and shadow["rows_dtype"] != "int8":
            return "shadow.linears read rows of the program, which holds INT8 ones only"
        if shadow["rows_dtype"] == "int8" and any("scales_offset" not in lin for lin in shadow["linears"].values()):
            return "shadow.linears of INT8 rows lack their scales_offset"
        branches = [b["linear"] for e in subs for b in e.get("shadow", [])]
        if missing := [b for b in branches if b not in shadow["linears"]]:
            return f"shadow.linears lacks {missing[0]}"
    tasks = meta["tasks"]
    if any(len(tasks[k]) != n for k in ("after", "after_previous", "processors")):
        return "tasks do not have one entry per subgraph"
    if any(not 0 <= j < n for k in ("needed_kv", "needed_final") for j in tasks[k]) or \
            any(not 0 <= j < n for k in ("after", "after_previous") for deps in tasks[k] for j in deps):
        return "tasks name a subgraph that does not exist"
    return _dependency_problem(meta)


def _dependency_problem(meta: dict) -> str | None:
    """The task table must be the data flow of the subgraphs (``format/tasks.py``): a missing
    dependency would let a task read a value not yet made (a race), a step left out of the needed
    sets one that never is (a stall)."""
    subs, tasks, layers = meta["subgraphs"], meta["tasks"], meta["model"]["layers"]
    outs = meta["graph"]["outputs"]
    made = {x for e in subs for x in e["outputs"]}
    if len(outs) != 1 + 2 * layers or any(x not in made for x in outs):
        return "graph.outputs are not the logits, K and V of every layer made by the subgraphs"
    after, after_previous = data_flow([(e["inputs"], e["outputs"]) for e in subs], outs[1:1 + layers], outs[1 + layers:])
    if tasks["after"] != after or tasks["after_previous"] != after_previous:
        return "tasks are not the data flow of the subgraphs"
    if tasks["processors"] != [e["processor"] for e in subs]:
        return "tasks.processors are not the subgraphs' processors"
    kv, final = set(tasks["needed_kv"]), set(tasks["needed_final"])
    for needed, name in ((kv, "needed_kv"), (final, "needed_final")):
        if any(not set(after[j]) <= needed or not set(after_previous[j]) <= kv for j in needed):
            return f"tasks.{name} leaves out a step that a needed step waits for"
    producer = {x: j for j, e in enumerate(subs) for x in e["outputs"]}
    if not {producer[x] for x in outs[1:]} <= kv or producer[outs[0]] not in final:
        return "the needed steps do not make the K/V and logits"
    return None


def load_sidecar(pte: str | Path) -> dict:
    """The sidecar of ``pte``, checked: right format and version, unaltered, and written for this very file."""
    pte = Path(pte)
    if not pte.is_file():
        raise LlmNpuError(f"no such .pte file: {pte}")
    path = sidecar_path(pte)
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise LlmNpuError(f"{pte} has no sidecar {path.name} beside it: export writes both; copy them together") from None
    except (ValueError, OSError) as e:
        raise LlmNpuError(f"sidecar {path} is not valid JSON ({type(e).__name__}): export the program again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise LlmNpuError(f"{path} is not an llmnpu sidecar: export the program again (llmnpu export)")
    if meta.get("version") != VERSION:
        raise LlmNpuError(f"{path} was written by another version of llmnpu export (format {meta.get('version')}, "
                          f"this runner reads {VERSION}): export the program again with this version")
    if problem := check_sidecar(meta):
        raise LlmNpuError(f"sidecar {path} is malformed ({problem}): export the program again")
    if meta["sidecar_sha256"] != sidecar_digest(meta):
        raise LlmNpuError(f"sidecar {path} was altered or damaged since export (its checksum fails): export the "
                          f"program again")
    if meta["pte_sha256"] != file_sha256(pte):
        raise LlmNpuError(f"{path.name} was written for another {meta['pte']}: the .pte and sidecar do not match")
    return meta
