"""A QNN SDK folder for ExecuTorch's Qualcomm delegate, made from the ``onnxruntime-qnn`` wheel.

ExecuTorch looks for ``$QNN_SDK_ROOT/lib/x86_64-linux-clang/``. We build that folder once per QNN
version in the cache: symbolic links to the wheel's libraries (and their bundled C++ runtime), with
``libQnnHtp.so`` replaced by the small shim of ``htp_shim.c`` (compiled here with the machine's gcc)
that adapts ExecuTorch 1.5.1's HTP device config to QNN 2.47+. A ``QNN_SDK_ROOT`` set by the user to
a real SDK wins: it is used as it is.

``activate()`` points the current process at the folder: environment variables for ExecuTorch and
child processes, and the libraries loaded up front so bare-name lookups inside QNN resolve (the
dynamic loader reads ``LD_LIBRARY_PATH`` only when a process starts).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import LlmNpuError
from ..paths import atomic_path, cache_dir

LIB_SUBDIR = Path("lib") / "x86_64-linux-clang"
SHIM_SOURCE = Path(__file__).with_name("htp_shim.c")
INSTALL_HINT = "pip install 'llmnpu_delegate[qnn]' (it installs onnxruntime-qnn==2.7.0, Qualcomm's QNN libraries)"
_REQUIRED = ("libQnnHtp.so", "libQnnSystem.so", "libHtpPrepare.so")


@dataclass(frozen=True)
class QnnSdk:
    root: Path                 # what QNN_SDK_ROOT points at
    version: str               # QNN version, e.g. "2.51.0"
    provided_by: str           # "onnxruntime-qnn" or "QNN_SDK_ROOT"

    @property
    def lib(self) -> Path:
        return self.root / LIB_SUBDIR


def _wheel_dir() -> Path:
    spec = importlib.util.find_spec("onnxruntime_qnn")
    if spec is None or not spec.submodule_search_locations:
        raise LlmNpuError(f"the QNN backend needs Qualcomm's QNN libraries: {INSTALL_HINT}, or set QNN_SDK_ROOT "
                          "to a QNN SDK")
    folder = Path(list(spec.submodule_search_locations)[0])
    missing = [name for name in _REQUIRED if not (folder / name).is_file()]
    if missing:
        raise LlmNpuError(f"onnxruntime-qnn in {folder} lacks {', '.join(missing)}: reinstall it ({INSTALL_HINT})")
    return folder


def _wheel_version(folder: Path) -> str:
    info = folder / "build_and_package_info.py"
    for line in info.read_text().splitlines() if info.is_file() else []:
        if line.startswith("qnn_version"):
            return line.split("=", 1)[1].strip().strip("'\"")
    raise LlmNpuError(f"cannot read the QNN version from {info}: reinstall onnxruntime-qnn ({INSTALL_HINT})")


def build_shim(out: Path) -> Path:
    """Compile ``htp_shim.c`` into ``out`` (a shared library named libQnnHtp.so)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise LlmNpuError("building the QNN HTP shim needs a C compiler: install gcc (e.g. apt install gcc)")
    cmd = [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-Wl,-soname,libQnnHtp.so", "-Wl,-z,nodelete",
           "-o", str(out), str(SHIM_SOURCE), "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LlmNpuError(f"building the QNN HTP shim failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
    return out


def prepare_sdk(root: Path | None = None) -> QnnSdk:
    """The SDK folder to use: ``$QNN_SDK_ROOT`` if set, else ours (built once from the wheel)."""
    user = os.environ.get("QNN_SDK_ROOT")
    if user:
        lib = Path(user) / LIB_SUBDIR
        if not (lib / "libQnnHtp.so").is_file():
            raise LlmNpuError(f"QNN_SDK_ROOT={user} has no {LIB_SUBDIR}/libQnnHtp.so: point it at a QNN SDK, or "
                              f"unset it to use onnxruntime-qnn's libraries")
        return QnnSdk(Path(user), "user", "QNN_SDK_ROOT")
    wheel = _wheel_dir()
    version = _wheel_version(wheel)
    # The folder name covers the shim's source and the wheel's location: a change of either rebuilds it.
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes() + str(wheel).encode()).hexdigest()[:12]
    root = Path(root) if root else cache_dir() / "qnn-sdk" / f"{version}-{digest}"
    if not (root / LIB_SUBDIR / "libQnnHtp_real.so").exists():
        with atomic_path(root) as tmp:
            lib = tmp / LIB_SUBDIR
            lib.mkdir(parents=True)
            libs = wheel.parent / f"{wheel.name}.libs"
            for folder in (wheel, libs):
                for so in sorted(folder.glob("*.so*")) if folder.is_dir() else []:
                    name = "libQnnHtp_real.so" if so.name == "libQnnHtp.so" else so.name
                    (lib / name).symlink_to(so)
            build_shim(lib / "libQnnHtp.so")
            (tmp / "VERSION").write_text(f"QNN {version} from {wheel}\n")
    return QnnSdk(root, version, "onnxruntime-qnn")


_active: QnnSdk | None = None


def native_env(sdk: QnnSdk | None = None) -> dict:
    """Environment variables that give a native process (``llmnpu-runner``) the same libraries as
    ``activate`` gives this one: the loader reads them when that process starts."""
    sdk = sdk or prepare_sdk()
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p and p != str(sdk.lib)]
    return {"QNN_SDK_ROOT": str(sdk.root), "LD_LIBRARY_PATH": ":".join([str(sdk.lib), *paths])}


def activate(sdk: QnnSdk | None = None) -> QnnSdk:
    """Make ExecuTorch's Qualcomm delegate use ``sdk`` (default: ``prepare_sdk()``) in this process."""
    global _active
    if _active is not None:
        return _active
    sdk = sdk or prepare_sdk()
    lib = str(sdk.lib)
    os.environ["QNN_SDK_ROOT"] = str(sdk.root)
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if lib not in paths:
        os.environ["LD_LIBRARY_PATH"] = ":".join([lib, *paths])
    if sdk.provided_by == "onnxruntime-qnn":
        # The bundled C++ runtime (which the links' $ORIGIN run paths cannot reach), and the system
        # library ExecuTorch opens by bare name. (Not libHtpPrepare.so: the HTP library registers
        # its ops when it loads that one itself; loading it twice fails.) Local: loaded libraries are
        # found by soname anyway, and a global LLVM libunwind/libc++abi would become the personality
        # of every C++ extension loaded later, whose first exception then crashes under libgcc's
        # unwinder (matplotlib's ft2font did, drawing a trace after a QNN run).
        for so in sorted(sdk.lib.glob("lib*.so*")):
            if so.name.startswith(("libunwind", "libc++")) or so.name == "libQnnSystem.so":
                ctypes.CDLL(str(so.resolve()), mode=ctypes.RTLD_LOCAL)
    # A program that only runs (nothing lowered in this process) opens the HTP backend by bare name;
    # the loader read LD_LIBRARY_PATH at process start, before it named our folder. A library
    # already loaded under that soname (our shim, or the user SDK's own library) is found instead.
    htp = sdk.lib / "libQnnHtp.so"
    if htp.is_file() and htp.stat().st_size:
        ctypes.CDLL(str(htp), mode=ctypes.RTLD_GLOBAL)
    # The runtime's kernels before the Qualcomm package's: ExecuTorch keeps the first kernel
    # registered for an op, and that package loads one (``executorch.kernels.quantized``) holding
    # portable ones. After it, a program's float ``linear.out`` (the float LM head) ran the portable
    # loop in this process instead of the optimized kernel: slower, and not the native runner's bits.
    import executorch.runtime  # noqa: F401
    _active = sdk
    return sdk
