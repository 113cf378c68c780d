"""Seeded sampling through the server does not depend on other clients (issue 76, fault 4):
the same chat request with ``temperature 1, seed 1234`` sent three times, with other
clients' texts joining the n-gram history in between, gives the same text with ``auto`` and
``ngram``, and it is ``ar``'s text; each choice of ``n = 2`` is ``ar``'s with its own seed."""

from contextlib import contextmanager

import pytest

import selfspec

from tiny import tiny_model, tiny_tokenizer

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402 - needs FastAPI

from selfspec.serving.app import ServeConfig, create_app  # noqa: E402 - needs FastAPI

MODEL = "tiny"
PROMPT = "the cat sat on the mat; the cat sat on the mat; the cat"
OTHERS = [PROMPT + " sat on the hat; the cat sat on the hat; the cat sat on the hat",
          PROMPT + " ran to the park and the dog ran to the park and the dog ran"]


@contextmanager
def served(method, **options):
    engine = selfspec.from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(),
                                            name=MODEL)
    config = ServeConfig(model_name=MODEL, method=method, method_options=options, max_batch=4)
    with TestClient(create_app(engine, config), raise_server_exceptions=False) as client:
        yield client


def _chat(client, content, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 40, **fields}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _texts(reply):
    return [choice["message"]["content"] for choice in reply["choices"]]


@pytest.fixture(scope="module")
def ar_texts():
    with served("ar") as client:
        one = _texts(_chat(client, PROMPT, temperature=1.0, seed=1234))
        two = _texts(_chat(client, PROMPT, temperature=1.0, seed=1234, n=2))
    assert two[0] == one[0] and two[1] != two[0]
    return two


@pytest.mark.parametrize("method,options", [("auto", {}), ("ngram", {}),
                                            ("auto", {"drafters": "ngram"})])
def test_the_same_seeded_request_gives_the_same_text_whatever_others_sent(ar_texts, method,
                                                                          options):
    with served(method, **options) as client:
        texts, drafted = [], []
        for other in OTHERS + [None]:
            reply = _chat(client, PROMPT, temperature=1.0, seed=1234)
            texts.append(_texts(reply)[0])
            usage = reply["usage"]["selfspec"]
            drafted.append((usage["draft_tokens"], usage["accepted_tokens"]))
            if other is not None:  # another client's text joins the history
                _chat(client, other, temperature=0)
                _chat(client, other, temperature=0.8)
        both = _texts(_chat(client, PROMPT, temperature=1.0, seed=1234, n=2))
    assert texts == [ar_texts[0]] * 3, (method, options, drafted)
    assert len(set(drafted)) > 1, drafted  # the other clients' texts changed the drafts
    assert both == ar_texts  # choice i samples with seed + i, each as ar would
