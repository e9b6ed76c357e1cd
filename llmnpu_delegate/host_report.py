"""``llmnpu info``: what this machine gives the project, on one screen (for bug reports).

The CPU and its INT8 capability, the INT8 kernel every NPU subgraph will run and why it is exact,
the native kernels and runner, Qualcomm's libraries, and the cache folder.
"""
from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

from . import __version__
from .errors import LlmNpuError
from .kernels import int8_path, native_ops
from .paths import cache_dir
from .qnn.sdk import prepare_sdk
from .runtime.native import find_runner


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink()) if folder.is_dir() else 0


def info() -> dict:
    cpu = int8_path.detect()
    out: dict = {"llmnpu_delegate": __version__, "python": platform.python_version(),
                 "torch": _version("torch"), "executorch": _version("executorch"),
                 "cpu": cpu.model or cpu.arch, "arch": cpu.arch, "isa": int8_path.isa_class(cpu),
                 "onednn_cap": cpu.onednn_cap or None, "fbgemm_cap": cpu.fbgemm_cap or None}
    try:
        out["int8_kernel"] = int8_path.current()
    except LlmNpuError as e:
        out["int8_kernel"], out["int8_kernel_error"] = None, str(e)
    out["onednn_exact_here"] = int8_path.onednn_exact(cpu)
    out["decode_kernel"] = int8_path.decode_kernel()
    out["decode_activation_bits"] = 7 if int8_path.decode_reduce_range() else 8
    lib = native_ops._library_path()
    out["native_kernels"] = str(lib) if lib.is_file() else None
    if lib.is_file():
        record = lib.parent / "build-isa.txt"
        out["native_build_isa"] = record.read_text().split() if record.is_file() else None
        out["native_missing_features"] = native_ops.missing_build_features(lib)
        out["bf16_attention"] = not out["native_missing_features"] and native_ops.bf16_attention_available()
    try:
        out["native_runner"] = str(find_runner())
    except LlmNpuError:
        out["native_runner"] = None
    try:
        sdk = prepare_sdk()
        out["qnn"] = f"QNN {sdk.version} from {sdk.provided_by} ({sdk.root})"
    except LlmNpuError as e:
        out["qnn"] = None
        out["qnn_reason"] = str(e)
    cache = cache_dir()
    out["cache_dir"], out["cache_mib"] = str(cache), round(_folder_bytes(cache) / 2**20, 1)
    return out


def format_info(r: dict) -> str:
    kernel = r["int8_kernel"] or f"none: {r.get('int8_kernel_error')}"
    lines = [f"llmnpu_delegate {r['llmnpu_delegate']}  python {r['python']}  torch {r['torch']}  "
             f"executorch {r['executorch'] or 'not installed'}",
             f"cpu            {r['cpu']} ({r['arch']}, INT8 class {r['isa']})"
             + "".join(f", {k} {r[k]}" for k in ("onednn_cap", "fbgemm_cap") if r.get(k)),
             f"int8 kernel    {kernel} (exact int32 sums; oneDNN would be {'exact' if r['onednn_exact_here'] else 'saturating'} here)",
             f"int8 decode    {r['decode_kernel']} dynamic linear, {r['decode_activation_bits']}-bit activations"]
    if r["native_kernels"]:
        missing = r.get("native_missing_features")
        state = (f"built for {', '.join(missing)} which this CPU lacks: run `make kernels`" if missing
                 else f"built ({len(r.get('native_build_isa') or [])} SIMD features), "
                      f"bf16 attention {'yes' if r.get('bf16_attention') else 'no'}")
        lines.append(f"native kernels {state}  {r['native_kernels']}")
    else:
        lines.append("native kernels not built: `make kernels`")
    lines.append(f"native runner  {r['native_runner'] or 'not built: `make runner`'}")
    lines.append(f"qnn            {r['qnn'] or 'unavailable: ' + r.get('qnn_reason', '')}")
    lines.append(f"cache          {r['cache_dir']} ({r['cache_mib']:.1f} MiB)")
    return "\n".join(lines)
