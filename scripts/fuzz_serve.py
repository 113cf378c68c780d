#!/usr/bin/env python
"""The longer fuzz of ``selfspec serve`` (docs/serving.md), against a real server process.

Usage::

    python scripts/fuzz_serve.py --examples 2000            # minutes
    python scripts/fuzz_serve.py --examples 50 --st --probe  # + the schemathesis CLI, probe
    python scripts/fuzz_serve.py --url http://127.0.0.1:8000 --key KEY --model NAME
                                 # a running server: raw HTTP and the probe, no fuzz

Saves a tiny random model (tests/tiny.py), starts ``selfspec serve`` on it as a subprocess
(uvicorn, real sockets), and fuzzes it over its own ``/openapi.json``:

1. ``tests/serving/test_fuzz.py::test_api`` with ``SELFSPEC_FUZZ_URL`` (the suite's checks: no 5xx,
   responses and each event of a stream inside the document, documented status codes and
   content types, requests outside the document refused, and every response, a stream
   too, ended within ``--timeout`` seconds), ``--examples`` per operation, schemathesis's
   coverage phase included;
2. with ``--st``, the schemathesis CLI (``st run``) with its own checks and
   ``--request-timeout`` / ``--max-response-time``;
3. ``tests/serving/test_fuzz.py::test_raw_http_cases_get_no_server_error`` over the socket
   (chunked, slow, truncated, non-ASCII: no 5xx, the documented statuses);
4. with ``--probe`` (or ``--url``), the hostile-client probe of issue 76
   (:func:`probe`): a mixed load with cancelled requests, streams and ``n = 2`` whose
   answers must equal lone greedy references and whose ``/metrics`` must equal what the
   clients saw, then ``--disconnects`` clients leaving mid-answer with the server's
   resident memory before and after;
5. the server is still healthy, has logged no error, and on SIGTERM drains and exits with
   status 0 within its drain time.

With ``--url`` the server is the caller's (started with ``--header-timeout`` and
``--body-timeout`` equal to ``--raw-timeout``, on 127.0.0.1): steps 3 and 4 only.

Prints what ran and the server's count of answers by route and status (from ``/metrics``);
exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
KEY = "fuzz-key"
logger = logging.getLogger("fuzz_serve")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 10.0, key: str = KEY) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _wait_healthy(url: str, process: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if _get(url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {seconds} s")


def _answers(url: str, key: str = KEY) -> Counter:
    """``selfspec_http_requests_total`` by (endpoint, status)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: Counter = Counter()
    for family in text_string_to_metric_families(_get(url + "/metrics", key=key)[1].decode()):
        if family.name == "selfspec_http_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[(sample.labels["endpoint"], sample.labels["status"])] += int(
                        sample.value)
    return counts


# ------------------------------------------------------------------ the probe (issue 76)
PROMPTS = ("Write a haiku about the sea.", "Explain what a hash table is in two sentences.",
           "Give three tips for writing clear code.", "Why is the sky blue? Answer briefly.")
#: The kinds of the mixed load, in rotation; ``cancel*``: the client leaves mid-answer.
KINDS = ("chat", "stream", "n2", "logprobs", "cancel", "cancel-stream")
CHAT = "/v1/chat/completions"


def long_prompt(i: int) -> str:
    """A prompt whose answer is long and new (the n-gram history holds none of it, so no
    draft makes it end within a client's patience): what clients that leave ask."""
    return (f"Write a long essay, at least ten paragraphs, about the history of the number "
            f"{i}.")


class Client:
    """A probe's HTTP client of one server (stdlib only), and what its requests saw."""

    def __init__(self, url: str, key: str, model: str, max_tokens: int,
                 leave_after: float) -> None:
        self.url, self.key, self.model, self.max_tokens = url, key, model, max_tokens
        self.leave_after = leave_after  # seconds a non-streamed client waits, then leaves
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.lock = threading.Lock()
        self.seen: Counter = Counter()  # ("http", status), ("finish", reason), tokens, ...
        self.wrong: list[str] = []
        self._fresh = 1000  # long_prompt numbers not used yet

    def fresh(self) -> int:
        """A number no other request of this probe used."""
        with self.lock:
            self._fresh += 1
            return self._fresh

    def body(self, prompt: str, **fields: object) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens, "temperature": 0, **fields}

    def post(self, body: dict) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url + CHAT, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.key}"})
        try:
            with urllib.request.urlopen(request, timeout=600) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def leave(self, body: dict, stream: bool) -> None:
        """Send ``body`` on a raw socket and close it mid-answer: after the first event of a
        stream, or :attr:`leave_after` seconds."""
        data = json.dumps(body).encode()
        with socket.create_connection((self.host, self.port), timeout=600) as sock:
            sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nAuthorization: Bearer " + self.key.encode()
                         + b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            got = b""
            if stream:
                while b"data: {" not in got:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    got += chunk
            else:
                time.sleep(self.leave_after)
        with self.lock:
            self.seen["http", 200 if stream else 499] += 1
            self.seen["finish", "cancelled"] += 1

    def count(self, status: int, reply: dict | None, n: int = 1) -> None:
        with self.lock:
            self.seen["http", status] += 1
            if reply is None:
                return
            use = reply["usage"]
            self.seen["prompt_tokens"] += use["prompt_tokens"]
            self.seen["completion_tokens"] += use["completion_tokens"]
            self.seen["rows"] += n
            for choice in reply["choices"]:
                # no stop strings here: a "stop" is the end-of-sequence token
                reason = {"stop": "eos"}.get(choice["finish_reason"], choice["finish_reason"])
                self.seen["finish", reason] += 1

    def check(self, kind: str, got: str, want: str) -> None:
        if got != want:
            with self.lock:
                self.wrong.append(f"{kind}: {got[:60]!r} != {want[:60]!r}")


def _streamed(raw: bytes) -> dict:
    """A chat stream's events as one reply (text per choice, its finish, the usage)."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    use = None
    for line in raw.decode().split("\n"):
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        use = event.get("usage") or use
        for choice in event.get("choices", ()):
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice["delta"].get("content") or "")
            finish[choice["index"]] = choice.get("finish_reason") or finish.get(choice["index"])
    return {"choices": [{"message": {"content": texts[i]}, "finish_reason": finish[i]}
                        for i in sorted(texts)], "usage": use}


def _one(client: Client, kind: str, prompt: str, ref: str) -> None:
    """One request of ``kind`` (:data:`KINDS`), checked against the greedy ``ref``."""
    if kind.startswith("cancel"):
        client.leave(client.body(long_prompt(client.fresh()), max_tokens=10 * client.max_tokens,
                                 stream=kind == "cancel-stream"), kind == "cancel-stream")
        return
    fields: dict = {"n": 2} if kind == "n2" else {}
    if kind == "stream":
        fields = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "logprobs":
        fields = {"logprobs": True, "top_logprobs": 2}
    status, raw = client.post(client.body(prompt, **fields))
    if status != 200:
        client.count(status, None)
        client.check(kind, f"HTTP {status}", "HTTP 200")
        return
    reply = _streamed(raw) if kind == "stream" else json.loads(raw)
    client.count(status, reply, n=len(reply["choices"]))
    for choice in reply["choices"]:
        client.check(kind, choice["message"]["content"], ref)
    if kind == "logprobs":
        joined = "".join(c["token"] for c in reply["choices"][0]["logprobs"]["content"])
        client.check("logprobs tokens", joined, reply["choices"][0]["message"]["content"])


def _metrics(client: Client) -> Counter:
    """The probe's counters from ``/metrics`` (sums over labels but the ones kept)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Counter = Counter()
    text = _get(client.url + "/metrics", key=client.key)[1].decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "selfspec_http_requests_total" and labels["endpoint"] == CHAT:
                out["http", int(labels["status"])] += sample.value
            elif sample.name == "selfspec_http_requests_total" and labels["status"] >= "500":
                out["5xx elsewhere"] += sample.value
            elif sample.name == "selfspec_requests_finished_total":
                out["finish", labels["finish_reason"]] += sample.value
            elif sample.name in ("selfspec_prompt_tokens_total",
                                 "selfspec_generation_tokens_total",
                                 "selfspec_e2e_request_latency_seconds_count"):
                out[sample.name] += sample.value
            elif sample.name == "process_resident_memory_bytes":
                out["rss"] = sample.value
    return out


def _idle(client: Client, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        health = json.loads(_get(client.url + "/health", key=client.key)[1])
        if health.get("running") == 0 and health.get("waiting") == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("the server did not become idle")


def probe(url: str, key: str, model: str, clients: int = 4, rounds: int = 6,
          disconnects: int = 50, max_tokens: int = 24, leave_after: float = 0.5) -> dict:
    """Issue 76's probe of a running server: wrong answers, 5xx, ``/metrics`` against the
    clients' own counts under a mixed load (:data:`KINDS`: cancellations, streams,
    ``n = 2``, logprobs), then resident memory before and after ``disconnects`` clients
    leave mid-answer (a non-streamed one after ``leave_after`` seconds: less than its
    answer takes). Returns the figures; ``problems`` lists what failed."""
    client = Client(url, key, model, max_tokens, leave_after)
    refs = {}
    for prompt in PROMPTS:
        status, raw = client.post(client.body(prompt))
        refs[prompt] = json.loads(raw)["choices"][0]["message"]["content"]
    client.seen.clear()
    before = _metrics(client)

    def run(i: int) -> None:
        for r in range(rounds):
            kind, prompt = KINDS[(i + r) % len(KINDS)], PROMPTS[(i + r) % len(PROMPTS)]
            _one(client, kind, prompt, refs[prompt])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _idle(client)
    time.sleep(0.5)
    after = _metrics(client)
    got = {k: after[k] - before[k] for k in after if k != "rss"}
    problems = list(client.wrong)
    for key_ in [k for k in client.seen if isinstance(k, tuple)]:
        if got.get(key_, 0) != client.seen[key_]:
            problems.append(f"/metrics {key_}: {got.get(key_, 0):g}, clients {client.seen[key_]}")
    if got.get("selfspec_e2e_request_latency_seconds_count", 0) != client.seen["rows"]:
        problems.append("e2e latency count differs from the rows that finished")
    cancelled_prompts = got.get("selfspec_prompt_tokens_total", 0) - client.seen["prompt_tokens"]
    figures = {"requests": sum(v for k, v in client.seen.items()
                               if isinstance(k, tuple) and k[0] == "http"),
               "clients_saw": {_name(k): v for k, v in client.seen.items()},
               "metrics_delta": {_name(k): v for k, v in got.items() if v},
               "prompt_tokens_of_cancelled": cancelled_prompts,
               "wrong_answers": len(client.wrong)}
    figures |= _disconnects(client, disconnects, problems)
    five = sum(v for k, v in _metrics(client).items()
               if (isinstance(k, tuple) and k[0] == "http" and k[1] >= 500) or k == "5xx elsewhere")
    figures["5xx"] = five
    if five:
        problems.append(f"{five:g} 5xx answers")
    figures["problems"] = problems
    return figures


def _name(key: object) -> str:
    return " ".join(map(str, key)) if isinstance(key, tuple) else str(key)


def _disconnects(client: Client, count: int, problems: list[str]) -> dict:
    """``count`` clients (four at a time) leaving mid-answer: half streams, half not."""
    _idle(client)
    rss = _metrics(client)["rss"]
    before = _metrics(client)["finish", "cancelled"]

    def leave(i: int) -> None:
        for j in range(i, count, 4):
            client.leave(client.body(long_prompt(client.fresh()), max_tokens=256,
                                     stream=j % 2 == 1), stream=j % 2 == 1)

    threads = [threading.Thread(target=leave, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _idle(client)
    time.sleep(0.5)
    after = _metrics(client)
    if after["finish", "cancelled"] - before != count:
        problems.append(f"{after['finish', 'cancelled'] - before:g} of {count} disconnects "
                        "counted cancelled")
    return {"disconnects": count, "rss_mib_before": round(rss / 2**20, 1),
            "rss_mib_after": round(after["rss"] / 2**20, 1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000,
                        help="examples per operation (tests/serving/test_fuzz.py)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds a response may take before it counts as hung")
    parser.add_argument("--st", action="store_true", help="also run the schemathesis CLI")
    parser.add_argument("--st-examples", type=int, default=200)
    parser.add_argument("--no-coverage", action="store_true",
                        help="skip schemathesis's coverage phase (boundary values)")
    parser.add_argument("--drain-seconds", type=float, default=10.0)
    parser.add_argument("--raw-timeout", type=float, default=1.0,
                        help="the server's --header-timeout and --body-timeout, seconds")
    parser.add_argument("--probe", action="store_true", help="also run the probe (issue 76)")
    parser.add_argument("--url", help="probe this running server instead (no fuzz)")
    parser.add_argument("--key", default=KEY, help="its API key")
    parser.add_argument("--model", default="tiny", help="its served model name")
    parser.add_argument("--disconnects", type=int, default=50)
    parser.add_argument("--leave-after", type=float, default=0.5,
                        help="seconds a probe's non-streamed client waits before it leaves "
                             "(less than a 240-token answer takes)")
    return parser.parse_args(argv)


def _pytest(env: dict, select: str, name: str, failed: list[str]) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "serving" / "test_fuzz.py"), "-k", select], env=env, cwd=ROOT)
    logger.info("tests/serving/test_fuzz.py -k %r: exit %d in %.0f s", select, done.returncode,
                time.monotonic() - started)
    if done.returncode:
        failed.append(name)


def _run_probe(args: argparse.Namespace, url: str, failed: list[str]) -> None:
    started = time.monotonic()
    figures = probe(url, args.key, args.model, disconnects=args.disconnects,
                    leave_after=args.leave_after)
    logger.info("probe (%.0f s): %s", time.monotonic() - started, json.dumps(figures, indent=1))
    if figures["problems"]:
        failed.append("probe")


def _fuzz_env(args: argparse.Namespace, url: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "SELFSPEC_FUZZ_URL": url, "SELFSPEC_FUZZ_KEY": args.key,
        "SELFSPEC_FUZZ_MODEL": args.model, "SELFSPEC_FUZZ_EXAMPLES": str(args.examples),
        "SELFSPEC_FUZZ_TIMEOUT": str(args.timeout),
        "SELFSPEC_FUZZ_RAW_TIMEOUT": str(args.raw_timeout),
        "SELFSPEC_FUZZ_COVERAGE": "0" if args.no_coverage else "1"}


def main(argv: list[str] | None = None) -> int:
    """Fuzz a fresh server on a tiny model, or probe a running one (module docstring); exit
    status 0 when nothing failed, 1 otherwise (the model and the server's log are then
    kept)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[fuzz] %(message)s")
    if args.url is not None:
        failed: list[str] = []
        _pytest(_fuzz_env(args, args.url), "raw", "raw HTTP", failed)
        _run_probe(args, args.url, failed)
        logger.info("result: %s", "FAILED: " + "; ".join(failed) if failed else "no failures")
        return 1 if failed else 0
    return _fuzz_tiny(args)


def _fuzz_tiny(args: argparse.Namespace) -> int:
    """Steps 1-5 of the module docstring on a fresh server on a tiny model."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import save_tiny

    work = Path(tempfile.mkdtemp(prefix="selfspec-fuzz-"))
    model = save_tiny(work / "tiny", max_position_embeddings=2048)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**_fuzz_env(args, url), "SELFSPEC_HOME": str(work)}
    log = (work / "serve.log").open("w")
    command = [sys.executable, "-m", "selfspec.cli", "serve", "--model", str(model),
               "--served-name", "tiny", "--method", "ar", "--api-key", args.key,
               "--port", str(port), "--max-tokens", "300" if args.probe else "6",
               "--default-max-tokens", "6",
               "--max-prompt-tokens", "2047", "--max-batch", "4", "--threads", "1",
               "--drain-seconds", str(args.drain_seconds),
               "--header-timeout", str(args.raw_timeout), "--body-timeout", str(args.raw_timeout)]
    logger.info("starting %s", " ".join(command))
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    failed: list[str] = []
    try:
        _wait_healthy(url, server, 300)
        _pytest(env, "test_api", "tests/serving/test_fuzz.py", failed)
        if args.st:
            _schemathesis_cli(args, url, work, failed)
        _pytest(env, "raw", "raw HTTP", failed)
        if args.probe:
            _run_probe(args, url, failed)
        if _get(url + "/health", key=args.key)[0] != 200:
            failed.append("health after the fuzz")
        answers = _answers(url, args.key)
        logger.info("answers by route and status: %s", json.dumps(
            {f"{e} {s}": n for (e, s), n in sorted(answers.items())}, indent=1))
        logger.info("requests in all: %d", sum(answers.values()))
    finally:
        code = _stop(server, args.drain_seconds)
        log.close()
    return _verdict(failed, code, work)


def _schemathesis_cli(args: argparse.Namespace, url: str, work: Path, failed: list[str]) -> None:
    started = time.monotonic()
    st = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", url + "/openapi.json",
         "-H", f"Authorization: Bearer {args.key}", "-w", "1", "-n", str(args.st_examples),
         "--seed", "1", "--continue-on-failure", "--request-timeout",
         str(args.timeout), "--max-response-time", str(args.timeout),
         "-c", "not_a_server_error,status_code_conformance,content_type_conformance,"
               "response_schema_conformance,negative_data_rejection"], cwd=work)
    logger.info("st run: exit %d in %.0f s", st.returncode, time.monotonic() - started)
    if st.returncode:
        failed.append("st run")


def _stop(server: subprocess.Popen, drain_seconds: float) -> int | None:
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=drain_seconds + 30)
    except subprocess.TimeoutExpired:
        server.kill()
        return None


def _verdict(failed: list[str], code: int | None, work: Path) -> int:
    if code != 0:
        failed.append(f"shutdown (exit status {code})")
    logged = [line for line in (work / "serve.log").read_text().splitlines()
              if line.startswith(("ERROR", "Traceback", "CRITICAL"))]
    if logged:
        failed.append(f"{len(logged)} errors in the server log ({work / 'serve.log'})")
        logger.info("first logged error: %s", logged[0])
    logger.info("result: %s", "FAILED: " + "; ".join(failed) if failed else "no failures")
    if failed:
        logger.info("the model and the server's log are kept in %s", work)
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
