"""Dtype choice by what the processor can do (executor/cpu.py)."""

from selfspec.executor import cpu


def test_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not cpu.native_bf16() and cpu.fast_matmul_dtype() == "fp32"
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert cpu.native_bf16() and cpu.fast_matmul_dtype() == "bf16"
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert cpu.fast_matmul_dtype() == "bf16"


def test_cpu_flags_are_read_once_and_are_strings():
    flags = cpu.cpu_flags()
    assert isinstance(flags, frozenset) and all(isinstance(f, str) for f in flags)
