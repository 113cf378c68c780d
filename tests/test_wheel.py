"""The package as a user installs it: build the sdist and the wheel, install the wheel into a fresh
virtual environment and run the installed ``selfspec`` command from there.

The wheel is built from the sdist (``python -m build`` does that), so a file the sdist misses
is missing from the wheel too. The environment must import selfspec from the wheel, never from
this checkout or an editable install on the host: it is a venv *without* the system
site-packages, into which the wheel is installed with the venv's own pip; only after that does
a ``.pth`` file add the host's site-packages directories as plain paths, behind the venv's own,
so torch and transformers need not be installed again. Plain path lines are not site
directories, so the ``.pth`` files inside them (an editable install's path or import hook) are
never run. The subprocesses run without ``PYTHONPATH`` and in a temporary directory, and the
test checks where ``selfspec`` was imported from, that no other ``selfspec`` package is on
``sys.path`` and that no editable-install finder is active.

Nothing here needs the network: the build runs without isolation (the ``test`` extra installs
``build`` and a recent enough setuptools) and pip installs the wheel with ``--no-deps --no-index``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "src" / "selfspec" / "executor" / "kernels"
# What the sdist is made of (MANIFEST.in and pyproject say which of it goes in).
_TREE = ("pyproject.toml", "MANIFEST.in", "README.md", "CHANGELOG.md", "src", "tests")
_TIMEOUT_S = 300


def _source_version() -> str:
    text = (ROOT / "src" / "selfspec" / "version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    assert match, "src/selfspec/version.py has no __version__ line"
    return match.group(1)


def _kernel_sources() -> list[str]:
    return sorted(p.name for p in KERNELS.iterdir() if p.suffix in (".cpp", ".h"))


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment for the venv's processes: nothing that adds paths or user site-packages."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH",
                        "VIRTUAL_ENV", "__PYVENV_LAUNCHER__")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _run(args: list[str | Path], cwd: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env or _clean_env(),
                          capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    assert done.returncode == 0, (
        f"{' '.join(map(str, args))} exited {done.returncode}\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    return done


def _start(args: list[str | Path], cwd: Path) -> tuple[list[str], subprocess.Popen[str]]:
    """:func:`_run`'s command started in the background (:func:`_finish` waits for it)."""
    argv = [str(a) for a in args]
    return argv, subprocess.Popen(argv, cwd=cwd, env=_clean_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)


def _finish(started: tuple[list[str], subprocess.Popen[str]]) -> subprocess.CompletedProcess[str]:
    """Wait for a :func:`_start`-ed command: its result, as :func:`_run` checks it."""
    argv, proc = started
    try:
        stdout, stderr = proc.communicate(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    assert done.returncode == 0, (
        f"{' '.join(argv)} exited {done.returncode}\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    return done


def _host_site_dirs() -> list[str]:
    """The host interpreter's site-packages directories (where torch and the rest live)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    for key in ("purelib", "platlib"):
        dirs.append(sysconfig.get_path(key))
    seen: list[str] = []
    for d in dirs:
        if d and Path(d).is_dir() and d not in seen:
            seen.append(d)
    return seen


def _unmet_build_requirements() -> list[str]:
    """pyproject's build-system requirements that this environment does not satisfy (a build
    without isolation uses this environment's setuptools)."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    with open(ROOT / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    unmet = []
    for text in requires:
        requirement = Requirement(text)
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{text} (not installed)")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            unmet.append(f"{text} (found {version})")
    return unmet


@dataclass(frozen=True)
class Installed:
    wheel: Path
    sdist: Path
    venv: Path
    python: Path
    script: Path
    purelib: Path
    work: Path


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    pytest.importorskip("build", reason="the wheel test needs `build` (pip install -e '.[test]')")
    unmet = _unmet_build_requirements()
    if unmet:
        pytest.skip(f"building without isolation needs {', '.join(unmet)} in this environment "
                    f"(pip install -e '.[test]' installs them)")
    base = tmp_path_factory.mktemp("wheel")
    work = base / "work"
    work.mkdir()

    # Build from a copy of the source tree: setuptools writes build/ and *.egg-info beside the
    # sources, which must not land in the checkout (nor race another run building it).
    tree = base / "tree"
    tree.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", ".pytest_cache")
    for name in _TREE:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=ignore)
        elif source.is_file():
            shutil.copy2(source, tree / name)
    dist = base / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(tree)],
        cwd=work, env=_clean_env(), capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    output = build.stdout + build.stderr
    assert build.returncode == 0, f"python -m build failed:\n{output[-4000:]}"
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())

    venv = base / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=work)
    bindir = "Scripts" if os.name == "nt" else "bin"
    python = venv / bindir / ("python.exe" if os.name == "nt" else "python")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", "-q",
          wheels[0]], cwd=work)
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        cwd=work).stdout.strip())
    # Only now the dependencies: pip above saw nothing outside the venv (so it could neither
    # find nor uninstall the host's selfspec).
    (purelib / "_selfspec_test_host_site.pth").write_text("\n".join(_host_site_dirs()) + "\n")
    script = venv / bindir / ("selfspec.exe" if os.name == "nt" else "selfspec")
    return Installed(wheel=wheels[0], sdist=sdists[0], venv=venv, python=python, script=script,
                     purelib=purelib, work=work)


def test_wheel_metadata_and_kernel_sources(installed: Installed) -> None:
    version = _source_version()
    assert installed.wheel.name == f"selfspec-{version}-py3-none-any.whl"
    assert installed.sdist.name == f"selfspec-{version}.tar.gz"
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(f"selfspec-{version}.dist-info/METADATA").decode()
        entry_points = wheel.read(f"selfspec-{version}.dist-info/entry_points.txt").decode()
    assert f"\nVersion: {version}\n" in metadata
    assert "selfspec = selfspec.cli:main" in entry_points
    kernels = _kernel_sources()
    assert any(k.endswith(".cpp") for k in kernels) and any(k.endswith(".h") for k in kernels)
    missing = [k for k in kernels if f"selfspec/executor/kernels/{k}" not in names]
    assert not missing, f"kernel sources missing from the wheel: {missing}"


def test_sdist_contents(installed: Installed) -> None:
    import tarfile

    prefix = installed.sdist.name.removesuffix(".tar.gz")
    with tarfile.open(installed.sdist) as sdist:
        names = set(sdist.getnames())
    expected = [f"{prefix}/{name}" for name in
                ("pyproject.toml", "README.md", "CHANGELOG.md", "src/selfspec/version.py",
                 "tests/test_wheel.py", "tests/conftest.py")]
    expected += [f"{prefix}/src/selfspec/executor/kernels/{k}" for k in _kernel_sources()]
    missing = [name for name in expected if name not in names]
    assert not missing, f"missing from the sdist: {missing}"


def _can_compile() -> str | None:
    """Why the AVX2 kernels cannot be compiled here, or ``None``."""
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        return "no C++ compiler (g++ or $CXX)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are AVX2 code (this is {platform.machine()})"
    return None


def test_venv_imports_selfspec_from_the_wheel(installed: Installed, tmp_path: Path) -> None:
    """One interpreter in the venv (each start imports torch): selfspec comes from the wheel,
    at the source's version, with the kernel sources, and it compiles a kernel from its own
    copy of them (in a temporary ``SELFSPEC_HOME``, so the build is not a cache hit)."""
    compile_skip = _can_compile()
    probe = (
        "import importlib.metadata, json, sys\n"
        "from importlib import resources\n"
        "from pathlib import Path\n"
        "import selfspec\n"
        "from selfspec.executor import native\n"
        "kernels = resources.files('selfspec.executor').joinpath('kernels')\n"
        "print(json.dumps({\n"
        "  'file': selfspec.__file__, 'version': selfspec.__version__,\n"
        "  'dist': importlib.metadata.version('selfspec'), 'path': sys.path,\n"
        "  'others': [p for p in sys.path if p and Path(p, 'selfspec', '__init__.py').is_file()],\n"
        "  'finders': [repr(f) for f in sys.meta_path],\n"
        "  'kernels': str(kernels), 'kernel_files': sorted(f.name for f in kernels.iterdir()),\n"
        "  'built': " + ("None" if compile_skip else 'str(native.build("argmax.cpp"))') + ",\n"
        "}))\n")
    env = _clean_env(SELFSPEC_HOME=str(tmp_path / "home"))
    info = json.loads(_run([installed.python, "-c", probe], cwd=installed.work, env=env).stdout)
    package = installed.purelib / "selfspec"
    assert Path(info["file"]).resolve() == (package / "__init__.py").resolve(), info["file"]
    assert info["version"] == info["dist"] == _source_version()
    others = [Path(p).resolve() for p in info["others"]]  # any second selfspec on sys.path
    assert others == [installed.purelib.resolve()], info["others"]
    assert not any("editable" in f.lower() for f in info["finders"]), info["finders"]
    assert Path(info["kernels"]).resolve() == (package / "executor" / "kernels").resolve()
    assert set(_kernel_sources()) <= set(info["kernel_files"])
    for name in _kernel_sources():  # the installed copies are the checkout's sources
        assert ((package / "executor" / "kernels" / name).read_bytes()
                == (KERNELS / name).read_bytes())
    if compile_skip is None:
        built = Path(info["built"])
        assert built.is_file() and (built.parent.resolve()
                                    == (tmp_path / "home" / "kernels").resolve())


@pytest.mark.real_model
def test_installed_command_generates(installed: Installed) -> None:
    """``selfspec generate`` from the venv on the default model (its cache is the user's),
    and ``selfspec --version``: two processes, run side by side (each start imports torch)."""
    version = _start([installed.script, "--version"], cwd=installed.work)
    generate = _start([installed.script, "generate", "--method", "ar", "--max-new-tokens", "4",
                       "def f(x):"], cwd=installed.work)
    try:
        assert _finish(version).stdout.strip() == f"selfspec {_source_version()}"
        done = _finish(generate)
    finally:
        for _, proc in (version, generate):
            if proc.poll() is None:  # a failed check above: leave no process behind
                proc.kill()
                proc.communicate()
    assert done.stdout.strip(), done.stderr
    assert "· ar ·" in done.stderr and "new tokens" in done.stderr, done.stderr
