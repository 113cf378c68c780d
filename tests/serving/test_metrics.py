"""`selfspec serve`'s `GET /metrics` (Prometheus text format) and `usage.selfspec`, in process
on a tiny random model: the counters equal what the responses' usage adds up to (tokens,
steps, draft and accepted tokens, per position and per drafter), every answer counts under
its route and status (errors included), the label sets stay bounded, and the page needs the
API key."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

import selfspec
from selfspec.decoding.core.stats import StepStats

from tiny import steady_latency, tiny_model, tiny_tokenizer

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from selfspec.serving.app import ServeConfig, create_app  # noqa: E402 - needs FastAPI
from selfspec.serving.metrics import ServerMetrics  # noqa: E402 - needs prometheus-client

KEY = "metrics-key"
MODEL = "tiny"
PROMPT = "abcabcabcabc abc"  # repeats: the n-gram drafters find matches


@pytest.fixture(scope="module")
def server():
    engine = steady_latency(selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(),
                                                           name=MODEL))
    app = create_app(engine, ServeConfig(model_name=MODEL, method="ar", api_key=KEY,
                                         max_batch=4))

    @app.get("/boom")  # an unexpected failure: the 500 of the app's error handler
    async def boom() -> None:
        raise RuntimeError("boom")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not uv.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield url
    uv.should_exit = True
    thread.join(timeout=30)
    sock.close()


def _call(url, path, body=None, key=KEY):
    """(status, body bytes) of a GET (``body`` None) or a JSON POST."""
    request = urllib.request.Request(
        url + path, data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _scrape(url):
    """``{(sample name, ((label, value), ...)): value}`` of ``/metrics``."""
    status, text = _call(url, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text.decode())
            for s in family.samples}


def _sum(samples, name, **labels):
    return sum(v for (n, ls), v in samples.items()
               if n == name and labels.items() <= dict(ls).items())


def _delta(before, after):
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _complete(url, method, stream=False, chat=False, ids=False):
    """One greedy request with ``method``; its ``usage``."""
    body = {"model": MODEL, "max_tokens": 20, "temperature": 0,
            "selfspec": {"method": method}}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = tiny_tokenizer()(PROMPT)["input_ids"] if ids else PROMPT
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    status, raw = _call(url, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert status == 200, raw
    if not stream:
        return json.loads(raw)["usage"]
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    assert raw.decode().rstrip().endswith("data: [DONE]")
    return events[-1]["usage"]


def test_metrics_equal_the_responses_usage(server):
    before = _scrape(server)
    jobs = [("ar", {}), ("ar", {"stream": True, "chat": True}), ("ngram", {}),
            ("ngram", {"stream": True, "ids": True}), ("auto", {}), ("auto", {"chat": True})]
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: rows share batches
        usages = list(pool.map(lambda job: (job[0], _complete(server, job[0], **job[1])), jobs))
    after = _scrape(server)
    delta = _delta(before, after)

    for method, use in usages:
        own = use["selfspec"]
        assert own["method"] == method
        assert use["completion_tokens"] == 20
        drafted, accepted = own["draft_tokens"], own["accepted_tokens"]
        assert 0 <= accepted <= drafted
        assert own["acceptance_rate"] == (round(accepted / drafted, 4) if drafted else 0.0)
        verifications = own["verifications"]
        assert own["mean_accepted_tokens"] == (
            round((accepted + verifications) / verifications, 4) if verifications else 0.0)
        # each step commits >= 1 token, the first token comes from the prefill
        assert own["steps"] <= use["completion_tokens"] - 1
    assert all(u["selfspec"]["draft_tokens"] == 0 for m, u in usages if m == "ar")
    assert sum(u["selfspec"]["draft_tokens"] for m, u in usages if m != "ar") > 0

    for method in ("ar", "ngram", "auto"):
        mine = [u for m, u in usages if m == method]

        def total(key, mine=mine):
            return sum(u[key] for u in mine)

        def own(key, mine=mine):
            return sum(u["selfspec"][key] for u in mine)

        def got(name, method=method, **labels):
            return _sum(delta, name, method=method, **labels)

        assert got("selfspec_generation_tokens_total") == total("completion_tokens")
        assert got("selfspec_prompt_tokens_total") == total("prompt_tokens")
        assert got("selfspec_spec_decode_steps_total") == own("steps")
        assert got("selfspec_spec_decode_num_draft_tokens_total") == own("draft_tokens")
        assert got("selfspec_spec_decode_num_accepted_tokens_total") == own("accepted_tokens")
        assert got("selfspec_spec_decode_verifications_total") == own("verifications")
        assert got("selfspec_spec_decode_num_drafts_total") <= own("steps")
        drafters = Counter()
        for use in mine:
            drafters.update(use["selfspec"].get("drafters", {}))
        for drafter, steps in drafters.items():
            assert got("selfspec_spec_decode_drafter_steps_total", drafter=drafter) == steps
        assert got("selfspec_spec_decode_drafter_steps_total") == sum(drafters.values())
        # acceptance by position: sums to the totals, never more accepted than drafted, and
        # a later position is reached no more often than an earlier one
        per_pos = {name: [got(f"selfspec_spec_decode_num_{name}_tokens_per_pos_total",
                              position=str(k)) for k in range(32)]
                   for name in ("draft", "accepted")}
        assert sum(per_pos["draft"]) == own("draft_tokens")
        assert sum(per_pos["accepted"]) == own("accepted_tokens")
        assert all(a <= d for a, d in zip(per_pos["accepted"], per_pos["draft"]))
        assert per_pos["draft"] == sorted(per_pos["draft"], reverse=True)
        assert got("selfspec_requests_finished_total", finish_reason="length") == len(mine)
        for histogram in ("time_to_first_token", "time_per_output_token",
                          "e2e_request_latency"):
            assert got(f"selfspec_{histogram}_seconds_count") == len(mine)
            assert got(f"selfspec_{histogram}_seconds_bucket", le="+Inf") == len(mine)
    assert _sum(delta, "selfspec_http_requests_total", endpoint="/v1/completions",
                status="200") == 4
    assert _sum(delta, "selfspec_http_requests_total", endpoint="/v1/chat/completions",
                status="200") == 2
    assert after[("selfspec_requests_running", ())] == 0
    assert after[("selfspec_requests_waiting", ())] == 0


def test_every_answer_counts_under_its_route_and_status(server):
    before = _scrape(server)
    completion = {"model": MODEL, "prompt": "ab", "max_tokens": 2}
    assert _call(server, "/v1/completions", {**completion, "temperature": 5})[0] == 400
    unknown = {**completion, "selfspec": {"method": "no-such-method"}}
    assert _call(server, "/v1/completions", unknown)[0] == 400
    assert _call(server, "/v1/completions", {**completion, "model": "gpt-4"})[0] == 404
    assert _call(server, "/metrics", key=None)[0] == 401
    assert _call(server, "/metrics", key="wrong")[0] == 401
    assert _call(server, "/v1/no-such-route/12345")[0] == 404
    assert _call(server, "/boom")[0] == 500
    assert _call(server, "/health", key=None)[0] == 200
    after = _scrape(server)
    counts = {dict(labels)["endpoint"] + " " + dict(labels)["status"]: value
              for (name, labels), value in _delta(before, after).items()
              if name == "selfspec_http_requests_total"}
    assert counts == {"/v1/completions 400": 2, "/v1/completions 404": 1, "/metrics 401": 2,
                      "other 404": 1, "/boom 500": 1, "/health 200": 1,
                      "/metrics 200": 1}  # the scrape `before`
    # nothing a client sent became a label value
    # (label values only: a sample's value may hold the digits 12345 by chance)
    labels = " ".join(value for _, pairs in _scrape(server) for _, value in pairs)
    assert "no-such-method" not in labels and "12345" not in labels and "gpt-4" not in labels
    assert _delta(before, after).keys() & {k for k in after if k[0].startswith(
        "selfspec_spec_decode")} == set()  # refused requests decode nothing


def test_draft_positions_past_the_cap_share_a_label_and_unknown_methods_are_other():
    metrics = ServerMetrics(max_position=4)
    metrics.on_step("ngram", StepStats(num_drafted=6, num_accepted=5, committed=6,
                                       verified=True, drafter="ngram"))
    metrics.on_step("ngram", StepStats(num_drafted=1, num_accepted=0, committed=1,
                                       verified=True))
    metrics.on_step("made-up", StepStats(committed=1))

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, labels) or 0.0

    drafted = {p: value("selfspec_spec_decode_num_draft_tokens_per_pos_total",
                        method="ngram", position=p) for p in ("0", "1", "2", "3", "4+")}
    accepted = {p: value("selfspec_spec_decode_num_accepted_tokens_per_pos_total",
                         method="ngram", position=p) for p in ("0", "1", "2", "3", "4+")}
    assert drafted == {"0": 2, "1": 1, "2": 1, "3": 1, "4+": 2}
    assert accepted == {"0": 1, "1": 1, "2": 1, "3": 1, "4+": 1}
    assert value("selfspec_spec_decode_num_drafts_total", method="ngram") == 2
    assert value("selfspec_spec_decode_verifications_total", method="ngram") == 2
    assert value("selfspec_spec_decode_drafter_steps_total", method="ngram",
                 drafter="ngram") == 1
    assert value("selfspec_spec_decode_steps_total", method="other") == 1
    assert b"made-up" not in metrics.render()
    # a registry per instance: a second server in the process counts apart
    assert ServerMetrics().registry.get_sample_value(
        "selfspec_spec_decode_steps_total", {"method": "ngram"}) is None
