"""Generated code runs in a sandbox: it cannot write outside its folder, reach the network,
leave a trace with a shell command, or leave a process alive after the timeout; without a
sandbox it is refused unless the user opts in."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from selfspec.bench import accuracy
from selfspec.bench.sandbox import Sandbox, SandboxUnavailableError, find_sandbox, probe
from selfspec.data import Prompt

BACKENDS = [pytest.param(name, marks=pytest.mark.skipif(
    probe(name) is None, reason=f"{name} sandbox not available on this machine "
                                "(bwrap: apt install bubblewrap; unshare: user namespaces)"))
    for name in ("bwrap", "unshare")]


@pytest.fixture(params=BACKENDS)
def sandbox(request) -> Sandbox:
    return find_sandbox(prefer=request.param)


def test_at_least_one_sandbox_works_on_linux():
    # CI's machines have util-linux and user namespaces; a machine without either would
    # refuse HumanEval scoring, which the refusal test below covers.
    if not os.path.exists("/proc/self/ns/user"):
        pytest.skip("no user namespaces")
    assert probe("bwrap") or probe("unshare")


def _marker() -> Path:
    return Path("/tmp", f"selfspec-escape-{uuid.uuid4().hex}")


def test_a_correct_program_runs_and_errors_are_reported(sandbox):
    assert sandbox.run("assert 1 + 1 == 2\n", 10).returncode == 0
    failed = sandbox.run("raise ValueError('wrong answer')\n", 10)
    assert failed.returncode != 0 and "ValueError: wrong answer" in failed.stderr
    loop = sandbox.run("while True:\n    pass\n", 1.0)
    assert loop.timed_out


def test_writes_outside_the_work_dir_are_blocked(sandbox):
    tmp, home = _marker(), Path.home() / f".selfspec-escape-{uuid.uuid4().hex}"
    program = (f"import os\nopen('inside.txt', 'w').write('ok')\n"
               f"for p in ({str(tmp)!r}, {str(home)!r}, '/etc/selfspec-escape'):\n"
               "    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n"
               "    else:\n        raise SystemExit('wrote ' + p)\n")
    result = sandbox.run(program, 10)
    assert result.returncode == 0, result.stderr
    assert not tmp.exists() and not home.exists() and not Path("/etc/selfspec-escape").exists()


def test_no_network_even_through_the_raw_socket_module(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    server.settimeout(0.05)
    ran = threading.Event()

    def accept():  # until the program has ended, then once more (its connection would wait
        while not accepted:  # in the listen queue: the kernel completes it without accept())
            last = ran.is_set()
            try:
                accepted.append(server.accept())
            except OSError:
                if last:
                    return

    thread = threading.Thread(target=accept)
    thread.start()
    program = ("import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
               f"s.settimeout(2)\ns.connect(('127.0.0.1', {port}))\n")
    result = sandbox.run(program, 5)
    ran.set()
    thread.join()
    server.close()
    assert result.returncode != 0 and not accepted


def test_shell_commands_leave_no_trace(sandbox):
    a, b = _marker(), _marker()
    program = (f"import os, subprocess\nos.system('touch {a}')\n"
               f"subprocess.run(['sh', '-c', 'echo x > {b}'])\n"
               "subprocess.run(['sh', '-c', 'id -u > /etc/selfspec-uid'])\n")
    sandbox.run(program, 10)
    assert not a.exists() and not b.exists() and not Path("/etc/selfspec-uid").exists()


def test_no_child_survives_the_timeout(sandbox):
    marker = _marker()
    # A double-forked, setsid child that outlives its parent and writes after the timeout.
    program = (f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               f"        time.sleep(2.0)\n        open('{marker}', 'w').write('alive')\n"
               "        os._exit(0)\n    os._exit(0)\ntime.sleep(30)\n")
    result = sandbox.run(program, 1.0)
    assert result.timed_out
    time.sleep(2.5)
    assert not marker.exists()


def test_humaneval_scoring_uses_the_sandbox(sandbox):
    prompt = Prompt("HumanEval/x", "def add(a, b):\n", chat=False,
                    meta={"test": "def check(f):\n    assert f(2, 3) == 5\n",
                          "entry_point": "add"})
    assert accuracy.check_humaneval(prompt, "    return a + b\n", sandbox=sandbox).correct
    wrong = accuracy.check_humaneval(prompt, "    return a - b\n", sandbox=sandbox)
    assert not wrong.correct and "AssertionError" in wrong.detail
    marker = _marker()
    evil = f"    open('{marker}', 'w').write('x')\n    return a + b\n"
    assert not accuracy.check_humaneval(prompt, evil, sandbox=sandbox).correct
    assert not marker.exists()


def test_without_a_sandbox_untrusted_code_is_refused_unless_opted_in(monkeypatch, caplog):
    from selfspec.bench import sandbox as module

    monkeypatch.setattr(module, "probe", lambda name: None)
    with pytest.raises(SandboxUnavailableError, match="apt install bubblewrap.*--unsafe-run-code"):
        module.find_sandbox()
    unsafe = module.find_sandbox(allow_unsandboxed=True)
    assert not unsafe.isolated and "NOT SANDBOXED" in unsafe.describe()
    assert "WITHOUT a sandbox" in caplog.text
    assert unsafe.run("import socket\ntry:\n    socket.socket()\nexcept OSError:\n    pass\n"
                      "else:\n    raise SystemExit(1)\n", 10).returncode == 0
