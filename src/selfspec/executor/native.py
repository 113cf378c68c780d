"""Compiling and loading selfspec's own C++ kernels (``executor/kernels/*.cpp``).

Each kernel is compiled at first use with the system's C++ compiler (``$CXX`` or ``g++``)
against torch's headers (for ``at::parallel_for``, so it shares torch's thread pool), cached
under ``$SELFSPEC_HOME/kernels`` by a hash of source, compiler, flags and torch version, and
loaded with ``ctypes`` (which releases the GIL during a call). Callers check the loaded
library on a probe before they use it and say why when any step fails
(:mod:`selfspec.executor.bf16_rows`, :mod:`selfspec.executor.w4a8`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_COMPILE_TIMEOUT_S = 300


def kernel_dir() -> Path:
    """``$SELFSPEC_HOME/kernels``: where compiled kernels are cached."""
    from selfspec.models.provision import selfspec_home

    return selfspec_home() / "kernels"


def avx2_unavailable_reason() -> str:
    """Why an AVX2 + FMA kernel cannot run on this machine (``""`` when it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU (this is {platform.machine()})"
    # ATen's AVX2 level itself requires AVX2 and FMA (and AVX512 implies both).
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "needs a CPU with AVX2 and FMA"
    return ""


def cpu_flag_missing(flag: str) -> bool:
    """Whether Linux's ``/proc/cpuinfo`` lists CPU flags and ``flag`` is not among them
    (``False`` where it cannot be read: the kernel's probe decides there)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag not in line.split(":", 1)[1].split()
    except OSError:
        pass
    return False


def _source(source_name: str) -> bytes:
    """The text of ``kernels/<source_name>`` as shipped in the package."""
    return resources.files("selfspec.executor").joinpath("kernels", source_name).read_bytes()


def _headers() -> dict[str, bytes]:
    """The shared headers ``kernels/*.h`` (every kernel is compiled beside all of them)."""
    folder = resources.files("selfspec.executor").joinpath("kernels")
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.name.endswith(".h")}


def _text(source_name: str) -> bytes:
    """A kernel's source followed by every header's name and text: what its build depends on."""
    parts = [_source(source_name)]
    for name, text in _headers().items():
        parts += [name.encode(), text]
    return b"\0".join(parts)


@cache
def source_digest(source_name: str) -> str:
    """8 hex digits of the SHA-256 of ``kernels/<source_name>`` and the headers: measurements
    made on a kernel (latency models) name it, so a changed kernel is measured again."""
    return hashlib.sha256(_text(source_name)).hexdigest()[:8]


def build(source_name: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library of ``kernels/<source_name>`` (compiled with :data:`FLAGS` and
    ``extra_flags``, beside the shared ``kernels/*.h``), compiling it first if it is not
    cached (``<stem>-<hash>.so``; the rename into place is atomic, so concurrent builds are
    safe).

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
    """
    from torch.utils.cpp_extension import include_paths

    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (install g++ or set CXX)")
    source = _source(source_name)
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    args = [*FLAGS, *extra_flags, abi, *(f"-I{p}" for p in include_paths()),
            f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    key = hashlib.sha256(b"\0".join(
        [_text(source_name), compiler.encode(), " ".join(args).encode(),
         torch.__version__.encode()]))
    out_dir = kernel_dir()
    target = out_dir / f"{Path(source_name).stem}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / source_name
        src.write_bytes(source)
        for name, text in _headers().items():
            (Path(tmp) / name).write_bytes(text)
        built = Path(tmp) / target.name
        logger.info("compiling %s (%s)", source_name, compiler)
        done = subprocess.run([compiler, str(src), "-o", str(built), *args], capture_output=True,
                              text=True, timeout=_COMPILE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {source_name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent build writes the same file
    return target


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel function, or why there is none.

    Attributes:
        call: the ``ctypes`` function, or ``None``.
        reason: why it is unavailable (``""`` when ``call`` is set).
        library: the loaded library (its other functions), or ``None``.
    """

    call: object | None
    reason: str
    library: ctypes.CDLL | None = None


def load(source_name: str, symbol: str, argtypes: Sequence[object],
         probe: Callable[[object], str], extra_flags: tuple[str, ...] = (),
         cpu_flags: tuple[str, ...] = ()) -> Kernel:
    """Build (or find) ``kernels/<source_name>``, load ``symbol`` with ``argtypes`` and check
    it with ``probe`` (which returns ``""`` or what is wrong). Never raises: any failure
    (not an AVX2 x86 CPU, a missing ``cpu_flags`` entry, no compiler, a failed compile or
    probe) is the returned :class:`Kernel`'s ``reason``, logged."""
    reason = avx2_unavailable_reason()
    missing = [f for f in cpu_flags if cpu_flag_missing(f)]
    if not reason and missing:
        reason = f"needs a CPU with {', '.join(missing)}"
    if reason:
        return Kernel(None, reason)
    try:
        lib = ctypes.CDLL(str(build(source_name, extra_flags)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        logger.info("%s unavailable: %s", source_name, err)
        return Kernel(None, str(err))
    fn = getattr(lib, symbol)
    fn.restype = None
    fn.argtypes = list(argtypes)
    problem = probe(fn)
    if problem:
        logger.warning("%s failed its probe (%s); not using it", source_name, problem)
        return Kernel(None, f"failed its probe: {problem}")
    return Kernel(fn, "", lib)
