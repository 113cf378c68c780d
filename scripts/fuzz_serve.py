#!/usr/bin/env python
"""The longer fuzz of ``selfspec serve`` (docs/serving.md), against a real server process.

Usage::

    python scripts/fuzz_serve.py --examples 2000            # minutes
    python scripts/fuzz_serve.py --examples 50 --st          # + the schemathesis CLI

Saves a tiny random model (tests/tiny.py), starts ``selfspec serve`` on it as a subprocess
(uvicorn, real sockets), and fuzzes it over its own ``/openapi.json``:

1. ``tests/serving/test_fuzz.py::test_api`` with ``SELFSPEC_FUZZ_URL`` (the suite's checks: no 5xx,
   responses and each event of a stream inside the document, documented status codes and
   content types, requests outside the document refused, and every response, a stream
   too, ended within ``--timeout`` seconds), ``--examples`` per operation, schemathesis's
   coverage phase included;
2. with ``--st``, the schemathesis CLI (``st run``) with its own checks and
   ``--request-timeout`` / ``--max-response-time``;
3. the server is still healthy, has logged no error, and on SIGTERM drains and exits with
   status 0 within its drain time.

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
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "fuzz-key"
logger = logging.getLogger("fuzz_serve")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
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


def _answers(url: str) -> Counter:
    """``selfspec_http_requests_total`` by (endpoint, status)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: Counter = Counter()
    for family in text_string_to_metric_families(_get(url + "/metrics")[1].decode()):
        if family.name == "selfspec_http_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[(sample.labels["endpoint"], sample.labels["status"])] += int(
                        sample.value)
    return counts


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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Fuzz a fresh server on a tiny model (module docstring); exit status 0 when nothing
    failed, 1 otherwise (the model and the server's log are then kept)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[fuzz] %(message)s")

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import save_tiny

    work = Path(tempfile.mkdtemp(prefix="selfspec-fuzz-"))
    model = save_tiny(work / "tiny", max_position_embeddings=2048)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]), "SELFSPEC_HOME": str(work)}
    log = (work / "serve.log").open("w")
    command = [sys.executable, "-m", "selfspec.cli", "serve", "--model", str(model),
               "--served-name", "tiny", "--method", "ar", "--api-key", KEY,
               "--port", str(port), "--max-tokens", "6", "--default-max-tokens", "6",
               "--max-prompt-tokens", "2047", "--max-batch", "4", "--threads", "1",
               "--drain-seconds", str(args.drain_seconds)]
    logger.info("starting %s", " ".join(command))
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    failed = []
    try:
        _wait_healthy(url, server, 300)
        started = time.monotonic()
        fuzz_env = {**env, "SELFSPEC_FUZZ_URL": url, "SELFSPEC_FUZZ_KEY": KEY,
                    "SELFSPEC_FUZZ_EXAMPLES": str(args.examples),
                    "SELFSPEC_FUZZ_TIMEOUT": str(args.timeout),
                    "SELFSPEC_FUZZ_COVERAGE": "0" if args.no_coverage else "1"}
        pytest = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             str(ROOT / "tests" / "serving" / "test_fuzz.py"), "-k", "test_api"], env=fuzz_env,
            cwd=ROOT)
        logger.info("tests/serving/test_fuzz.py::test_api: exit %d in %.0f s", pytest.returncode,
                    time.monotonic() - started)
        if pytest.returncode:
            failed.append("tests/serving/test_fuzz.py")
        if args.st:
            started = time.monotonic()
            st = subprocess.run(
                [sys.executable, "-m", "schemathesis.cli", "run", url + "/openapi.json",
                 "-H", f"Authorization: Bearer {KEY}", "-w", "1", "-n", str(args.st_examples),
                 "--seed", "1", "--continue-on-failure", "--request-timeout",
                 str(args.timeout), "--max-response-time", str(args.timeout),
                 "-c", "not_a_server_error,status_code_conformance,content_type_conformance,"
                       "response_schema_conformance,negative_data_rejection"], cwd=work)
            logger.info("st run: exit %d in %.0f s", st.returncode, time.monotonic() - started)
            if st.returncode:
                failed.append("st run")
        if _get(url + "/health")[0] != 200:
            failed.append("health after the fuzz")
        answers = _answers(url)
        logger.info("answers by route and status: %s", json.dumps(
            {f"{e} {s}": n for (e, s), n in sorted(answers.items())}, indent=1))
        logger.info("requests in all: %d", sum(answers.values()))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=args.drain_seconds + 30)
        except subprocess.TimeoutExpired:
            server.kill()
            code = None
        log.close()
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
