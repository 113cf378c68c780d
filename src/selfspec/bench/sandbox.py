"""Run untrusted generated code (HumanEval completions) in an isolated process.

A model's completion is arbitrary Python. It runs in a fresh process that

- has **no network** (an empty network namespace: not even the host's loopback),
- sees the whole filesystem **read-only** except a private, empty work directory (its
  current directory, ``$HOME`` and ``$TMPDIR``), deleted afterwards,
- has **no capabilities** (an unprivileged user namespace; under bubblewrap it runs as
  ``nobody``; under ``unshare`` as a root with an empty capability bounding set),
- has **resource limits**: address space, CPU seconds, file size, processes,
- lives in its own **PID namespace and session**: on timeout (or when selfspec dies) the whole
  namespace is killed, so no child it spawned survives, however it detached.

Two maintained tools provide this (:func:`find_sandbox` probes them once per process):

1. `bubblewrap <https://github.com/containers/bubblewrap>`_ (``bwrap``; Debian/Ubuntu
   ``apt install bubblewrap``, Fedora ``dnf install bubblewrap``), preferred;
2. util-linux's ``unshare`` and ``setpriv`` (present on nearly every Linux), where the kernel
   allows unprivileged user namespaces: a short launcher bind-mounts the work directory,
   remounts every other mount read-only, checks that it did, drops every capability and
   execs Python.

Where neither works (macOS, Windows, kernels without user namespaces) untrusted code is not
run: :class:`SandboxUnavailableError` says what to install, or to opt in explicitly
(``selfspec bench --unsafe-run-code``), which runs completions as before this sandbox existed
(``python -I`` in a temp dir with the limits and the ``socket`` module disabled: a guard
against accidents, not against hostile code), logs a warning and labels the report.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import SelfSpecError

logger = logging.getLogger(__name__)

MEMORY_LIMIT_BYTES = 2 << 30
FILE_LIMIT_BYTES = 64 << 20
EXTRA_PROCESSES = 64
_STDERR_TAIL_BYTES = 4096
# Exit status of the unshare launcher when it could not make the filesystem read-only.
_LAUNCHER_REFUSED = 97

_UNSHARE_LAUNCHER = r"""
set -eu
work="$1"; shift
mount --bind "$work" "$work"
for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do
  [ "$m" = "$work" ] || mount -o remount,bind,ro "$m" 2>/dev/null || true
done
# Fail closed: a writable mount but the work dir means no sandbox. A later line for the same
# mount point is stacked on top of the earlier ones (which are then hidden): check the top.
awk -v w="$work" '{opts[$5] = $6}
  END {for (m in opts) if (m != w && opts[m] !~ /(^|,)ro(,|$)/) {
         print "writable: " m > "/dev/stderr"; bad = 1}
       exit bad ? 97 : 0}' /proc/self/mountinfo
cd "$work"
exec setpriv --bounding-set=-all --inh-caps=-all --no-new-privs -- "$@"
"""

_UNSANDBOXED_GUARD = f'''\
import resource, socket
resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT_BYTES}, {MEMORY_LIMIT_BYTES}))
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled while checking generated code")
socket.socket = socket.create_connection = socket.getaddrinfo = _no_network
del resource, socket
'''


class SandboxUnavailableError(SelfSpecError):
    """No sandbox for generated code on this machine, and running it unsandboxed was not
    allowed; the message says what to install or which flag opts in."""


@dataclass(frozen=True)
class RunResult:
    """How a sandboxed program ended.

    Attributes:
        returncode: the exit status (``None`` when it was killed on timeout).
        timed_out: it ran past the time limit and everything it started was killed.
        stderr: the last few KB of its standard error.
    """

    returncode: int | None
    timed_out: bool
    stderr: str


@dataclass(frozen=True)
class Sandbox:
    """One way of running untrusted Python (see the module docstring).

    Attributes:
        name: ``"bwrap"``, ``"unshare"`` or ``"none"`` (unsandboxed, opt-in only).
        tool: path of the tool that isolates (``None`` for ``"none"``).
    """

    name: str
    tool: str | None = None

    @property
    def isolated(self) -> bool:
        """Whether the process is really isolated (False only for the opt-in ``"none"``)."""
        return self.name != "none"

    def describe(self) -> str:
        """One line for reports: what protected the host."""
        if self.name == "bwrap":
            return ("bubblewrap: no network, read-only filesystem but a private work dir, "
                    "user 'nobody', own PID namespace, resource limits")
        if self.name == "unshare":
            return ("unshare/setpriv: no network, read-only filesystem but a private work dir, "
                    "no capabilities, own PID namespace, resource limits")
        return ("NOT SANDBOXED (--unsafe-run-code): python -I in a temp dir with resource "
                "limits and the socket module disabled")

    def command(self, work: Path, script: Path) -> list[str]:
        """The command line that runs ``script`` (inside ``work``) in this sandbox."""
        python = [sys.executable, "-I", str(script)]
        if self.name == "bwrap":
            return [self.tool or "bwrap", "--ro-bind", "/", "/", "--dev", "/dev",
                    "--proc", "/proc", "--bind", str(work), str(work), "--chdir", str(work),
                    "--unshare-all", "--die-with-parent", "--new-session",
                    "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL", "--", *python]
        if self.name == "unshare":
            return [self.tool or "unshare", "--user", "--map-root-user", "--mount", "--net",
                    "--pid", "--fork", "--kill-child", "--ipc", "--uts", "--mount-proc",
                    "--", "sh", "-c", _UNSHARE_LAUNCHER, "selfspec-sandbox", str(work),
                    *python]
        return python

    def run(self, program: str, timeout_s: float) -> RunResult:
        """Run the Python source ``program`` in a fresh private work dir, then delete it.

        Args:
            program: Python source.
            timeout_s: wall-time limit in seconds; past it everything the program started
                is killed.

        Returns:
            Exit status (``None`` on timeout), whether it timed out, the end of its stderr.
        """
        with tempfile.TemporaryDirectory(prefix="selfspec-sandbox-") as tmp:
            work = Path(tmp, "work")
            work.mkdir()
            script = work / "program.py"
            source = program if self.isolated else _UNSANDBOXED_GUARD + program
            script.write_text(source, encoding="utf-8")
            errors = Path(tmp, "stderr")  # outside the work dir: the program cannot replace it
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work),
                   "TMPDIR": str(work), "LANG": "C.UTF-8"}
            with errors.open("wb") as err:
                proc = subprocess.Popen(
                    _with_limits(self.command(work, script), timeout_s), cwd=work, env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    start_new_session=True)
                try:
                    code: int | None = proc.wait(timeout=timeout_s)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    code, timed_out = None, True
            tail = _tail(errors)
            # Files the program left are its own; make them deletable whatever their modes.
            _make_writable(work)
        return RunResult(code, timed_out, tail)


# Sets the limits, then execs the sandbox tool: limits are inherited across exec, and doing it
# in a fresh interpreter avoids preexec_fn, which can deadlock in a threaded parent (torch).
_LIMITS_EXEC = """\
import os, resource, sys
for name, value in zip(("CPU", "AS", "FSIZE", "CORE", "NPROC"), map(int, sys.argv[1:6])):
    limit = getattr(resource, "RLIMIT_" + name)
    resource.setrlimit(limit, (value, value))
os.execvp(sys.argv[6], sys.argv[6:])
"""


def _with_limits(command: list[str], timeout_s: float) -> list[str]:
    """``command`` under resource limits: CPU seconds, address space, file size, no core
    files, and processes (RLIMIT_NPROC counts every process of this user on the host, so a
    few more than run now)."""
    nproc = _processes_of_this_user() + EXTRA_PROCESSES
    limits = [int(timeout_s) + 2, MEMORY_LIMIT_BYTES, FILE_LIMIT_BYTES, 0, nproc]
    return [sys.executable, "-I", "-c", _LIMITS_EXEC, *map(str, limits), *command]


def _processes_of_this_user() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (its session) and reap it; the sandbox tools
    take their PID namespace down with them (``--die-with-parent`` / ``--kill-child``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path) -> str:
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - _STDERR_TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


def _make_writable(root: Path) -> None:
    for dirpath, dirnames, _ in os.walk(root):
        for name in dirnames:
            try:
                os.chmod(os.path.join(dirpath, name), 0o700)
            except OSError:
                pass


@functools.cache
def probe(name: str) -> Sandbox | None:
    """The sandbox ``name`` (``"bwrap"`` or ``"unshare"``) if its tools exist and a trivial
    program runs in it on this machine (probed once per process), else None."""
    tools = {"bwrap": ["bwrap"], "unshare": ["unshare", "setpriv"]}[name]
    paths = [shutil.which(t) for t in tools]
    if not all(paths) or not sys.platform.startswith("linux"):
        return None
    sandbox = Sandbox(name, paths[0])
    try:
        result = sandbox.run("import os\nopen('ok', 'w').write('1')\n", timeout_s=20.0)
    except OSError as err:
        logger.info("sandbox %s unusable: %s", name, err)
        return None
    if result.returncode != 0:
        logger.info("sandbox %s unusable (exit %s): %s", name, result.returncode,
                    result.stderr.strip()[-300:])
        return None
    return sandbox


def find_sandbox(allow_unsandboxed: bool = False, prefer: str | None = None) -> Sandbox:
    """The best sandbox on this machine: bubblewrap, else unshare, else (only when allowed)
    none.

    Args:
        allow_unsandboxed: fall back to running unsandboxed (with a logged warning) instead
            of refusing.
        prefer: ``"bwrap"``, ``"unshare"`` or ``"none"`` to force one (tests); a forced
            backend that does not work here raises.

    Raises:
        SandboxUnavailableError: no working sandbox and ``allow_unsandboxed`` is false.
    """
    names = [prefer] if prefer else ["bwrap", "unshare"]
    for name in names:
        if name == "none":
            break
        found = probe(name)
        if found is not None:
            return found
    if allow_unsandboxed or prefer == "none":
        logger.warning("running generated code WITHOUT a sandbox (--unsafe-run-code): it can "
                       "read and write your files and reach the network")
        return Sandbox("none")
    raise SandboxUnavailableError(
        "HumanEval scoring runs the model's code, and no sandbox works on this machine: "
        "install bubblewrap (`apt install bubblewrap` / `dnf install bubblewrap`) or allow "
        "unprivileged user namespaces for util-linux `unshare`; or skip scoring with "
        "--no-accuracy, or run the code unsandboxed at your own risk with --unsafe-run-code")
