"""What the load tests (:mod:`selfspec.bench.serve_load.run`,
:mod:`selfspec.bench.serve_load.mix`) ask of the server process they start (a port, the
request's ``selfspec`` field, ``/health``, its resident memory) and of the machine (the model
is there, the load average), and where a run writes (:func:`output_folder`,
:func:`command_line`). The machine's description is bench's
(:func:`selfspec.bench.report.collect_machine_info`)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import urllib.error
import urllib.request
from pathlib import Path


def method_body(method: str) -> dict:
    """The request's ``selfspec`` field. The n-gram drafters run without the server's history
    of earlier texts: the test sends the same prompts again and again, and drafting them from
    their own earlier outputs would report a speedup no real traffic gives."""
    from selfspec.methods.registry import get_method

    names = get_method(method).option_names
    return {"method": method, "options": {"history": False} if "history" in names else {}}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the server binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Process ``pid``'s resident memory in MiB (0.0 once it is gone or where /proc is not)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int | None, str]:
    """``GET path``: the status and the body's text; ``None`` when no answer came."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (OSError, urllib.error.URLError):
        return None, ""


def scheduler_rows(port: int) -> int:
    """Rows the server's scheduler holds (running and waiting), from ``/health``; -1 when
    it does not say."""
    status, body = http_get(port, "/health")
    if status != 200:
        return -1
    health = json.loads(body)
    return health["running"] + health["waiting"]


def model_problem(model: str, dtype: str) -> str | None:
    """Why ``model`` cannot be served without a download, or ``None``. A registry model
    needs its cache entry (in ``dtype``, or float32 to cast); a directory its
    ``config.json``; a hub id is left to the server."""
    from selfspec.errors import SelfSpecError
    from selfspec.models.provision import is_cached
    from selfspec.models.resolve import resolve

    try:
        source = resolve(model)
        if source.kind == "registry" and not (is_cached(model, dtype)
                                              or is_cached(model, "fp32")):
            return (f"{model} is not in the model cache ($SELFSPEC_HOME): run "
                    f"`selfspec models fetch {model}` first")
    except SelfSpecError as error:
        return str(error)
    if source.kind == "directory" and not (Path(model) / "config.json").is_file():
        return f"{model} has no config.json"
    return None


def load_average() -> str:
    """The 1, 5 and 15 minute load averages as text (``"unknown"`` where the OS has none):
    the clients share the server's CPUs, so a busy machine shows in the figures."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


#: Where the load tests' output folders go by default, as ``selfspec bench``'s.
OUTPUT_ROOT = Path("out", "bench")


def output_folder(out: str | None, tool: str, model: str) -> Path:
    """The folder a run writes to: ``out`` (created if needed), else a new folder
    ``out/bench/TOOL-MODEL-TIME`` claimed as ``selfspec bench`` claims its default one
    (:func:`selfspec.bench.outdir.claim_new_dir`: never a folder another run took).

    Raises:
        InvalidArgumentError: the folder cannot be created.
    """
    from selfspec.bench.outdir import claim_new_dir

    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return claim_new_dir(OUTPUT_ROOT / f"{tool}-{Path(model).name}-{stamp}")


def command_line(tool: str, args: argparse.Namespace) -> str:
    """The ``selfspec bench TOOL ...`` command that repeats a run of ``args`` (the tool's own
    flags only, every one written out, defaults included), for its report."""
    words = ["selfspec", "bench", tool]
    for key, value in vars(args).items():
        words += [f"--{key.replace('_', '-')}",
                  f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join(words)
