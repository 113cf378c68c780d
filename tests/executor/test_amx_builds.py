"""Both AMX builds compile on every x86 machine with g++, AMX or not.

Their numerics run in ``test_gguf_rows.py`` / ``test_bf16_rows.py`` where the CPU has AMX (and
Linux grants the tile state); elsewhere those tests skip, and without this file a change that
broke the AMX code would pass CI on most machines. No emulator runs AMX here: QEMU's TCG does
not implement it and Intel SDE is not a package.
"""

import ctypes
import os
import platform
import shutil
import subprocess

import pytest

from selfspec.executor import bf16_rows, gguf_rows, native

pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AMX is x86 only"),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None
                       and shutil.which("c++") is None, reason="no C++ compiler"),
]

BUILDS = [
    pytest.param(gguf_rows, ("selfspec_gguf_rows", "selfspec_gguf_rows_amx",
                             "selfspec_gguf_attention", "selfspec_gguf_mlp"),
                 ("tdpbssd", "tileloadd", "ldtilecfg"), id="gguf-int8"),
    pytest.param(bf16_rows, ("selfspec_bf16_rows", "selfspec_bf16_rows_amx",
                             "selfspec_bf16_attention", "selfspec_bf16_mlp"),
                 ("tdpbf16ps", "tileloadd", "ldtilecfg"), id="bf16"),
]


@pytest.mark.parametrize("module, symbols, instructions", BUILDS)
def test_the_amx_build_compiles_with_its_tile_code(module, symbols, instructions):
    # Without AMX here no test runs the -O3 build: -O0 compiles the same tile code ~2x faster.
    quick = () if _cpu_has_amx() else ("-O0",)
    path = native.build(module.SOURCE, module._FLAGS["amx"] + quick)  # cached after the first
    library = ctypes.CDLL(str(path))  # loading executes no AMX instruction
    assert all(hasattr(library, name) for name in symbols)
    if shutil.which("objdump") is None:
        pytest.skip("objdump is not installed: the tile code is not checked")
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], check=True,
                          capture_output=True, text=True).stdout
    # the AMX paths are behind #ifdef: a build without them would still export the symbols
    assert all(f"\t{op}" in text or f" {op}" in text for op in instructions)


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False
