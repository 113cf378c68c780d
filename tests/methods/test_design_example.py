"""docs/design.md's "Worked example: adding a method" runs as written.

The section's Python block is written out as a module, its ``SPEC`` registered for the test
only (``METHODS`` patched, ``methods/registry.py`` untouched), and a greedy generation on a
tiny random model must give exactly ``ar``'s tokens, with drafts really made."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import selfspec
from selfspec.methods import registry

from tiny import tiny_model, tiny_tokenizer

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
SECTION = "## Worked example: adding a method"


def example_code(text: str) -> str:
    """The first ```python block of the worked-example section of ``text``."""
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert match, f"no python block under {SECTION!r} in {DESIGN}"
    return match.group(1)


@pytest.fixture
def minus_two(tmp_path, monkeypatch):
    path = tmp_path / "minus_two.py"
    path.write_text(example_code(DESIGN.read_text(encoding="utf-8")), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("minus_two_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(registry.METHODS, module.SPEC.name, module.SPEC)
    return module.SPEC


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_worked_example_is_lossless_on_a_tiny_model(minus_two, arch):
    engine = selfspec.from_pretrained_model(tiny_model(arch, seed=5), tiny_tokenizer(),
                                            f"tiny-{arch}")
    prompt = "the cat sat on the mat; the cat sat on"
    ar = engine.generate(prompt, method="ar", max_new_tokens=32)
    for options in ({}, {"gamma": 0.3}, {"exit_layer": 2}):
        result = engine.generate(prompt, method=minus_two.name, max_new_tokens=32, **options)
        assert result.token_ids == ar.token_ids, options
        assert result.stats.drafted > 0, options
    assert registry.get_method("minus-two") is minus_two


def test_the_example_is_not_registered_for_real():
    assert "minus-two" not in registry.METHODS
