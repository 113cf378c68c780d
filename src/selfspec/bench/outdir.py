"""The output folder of a benchmark run: claiming it, the progress journal, resuming.

A run owns its folder through three files besides the report files:

- ``run.json``: the run's settings (:class:`RunIdentity`), its status (``running``,
  ``interrupted``, ``complete``), the processes that worked on it and how many generations
  it plans; rewritten atomically at each change.
- ``journal.jsonl``: one line per finished generation (a ``records.jsonl`` line without its
  parity and accuracy, which need the whole run) and one per method failure, appended,
  flushed and fsynced as each happens. It is what a resumed run reads back.
- ``.bench.lock``: a file lock held while a process writes the folder, so two processes
  never write one folder.

The report files (``records.jsonl``, ``specbench/``, ``summary.json``, ``report.md``, the
plots) are views of the journal, written at the end and, marked partial, when a run is
interrupted. A folder is never overwritten silently: a new run needs a missing or empty
folder; ``resume`` needs a saved run with the same settings; ``overwrite`` removes only
the files a benchmark run writes, and refuses a folder that holds anything else.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from filelock import FileLock, Timeout

from selfspec.bench.harness import PromptRecord
from selfspec.bench.report import record_from_json, record_json, write_text_atomic
from selfspec.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
JOURNAL_FILE = "journal.jsonl"
LOCK_FILE = ".bench.lock"
SPECBENCH_DIR = "specbench"
FORMAT = 1

# Every name a benchmark run writes at the top of its folder (plots: selfspec.bench.plots).
_OUTPUT_NAMES = ("records.jsonl", "summary.json", "report.md", RUN_FILE, JOURNAL_FILE,
                 LOCK_FILE, ".selfspec-write-test", "speedup.png", "acceptance-vs-exit-layer.png",
                 "accuracy-vs-speedup.png", "sweep-*.png")


class OutputMode(enum.Enum):
    """What to do with an existing output folder."""

    NEW = "new"  # the folder must be missing or empty
    RESUME = "resume"  # continue the interrupted run saved there
    OVERWRITE = "overwrite"  # remove its previous benchmark outputs first


@dataclass(frozen=True)
class RunIdentity:
    """The settings a resumed run must share with the saved one (timings aside, they decide
    every record).

    Attributes:
        model / dtype: the model as asked for and its weights' format (``bf16``, ...).
        dataset: the dataset name or a prompt file's label.
        prompts: the ids of the prompts given, in order; prompts_sha256: a hash of their
            ids, texts and chat flags.
        methods: the method labels, in run order.
        max_new_tokens / temperature / top_p / seed: generation settings.
        warmup_prompts / warmup_tokens: the untimed warm-up.
        allow_in_sample: whether prompts the heads saw were kept.
        torch_threads: torch intra-op threads (timings from other thread counts would mix).
        run_prompts: the prompts left after the held-out check (None = not yet known: a
            check before the model loads compares everything else).
        batch_size: prompts generated together (1 = one at a time; left out of the saved
            settings then, so runs saved before batching resume).
    """

    model: str
    dtype: str
    dataset: str
    prompts: tuple[str, ...]
    prompts_sha256: str
    methods: tuple[str, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    warmup_prompts: int
    warmup_tokens: int
    allow_in_sample: bool
    torch_threads: int
    run_prompts: tuple[str, ...] | None = None
    batch_size: int = 1

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (lists for tuples; ``run_prompts`` left out while unknown)."""
        data = {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}
        if self.run_prompts is None:
            del data["run_prompts"]
        if self.batch_size == 1:
            del data["batch_size"]
        return data

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """``"name (saved X, now Y)"`` for each setting that differs from ``saved`` (a
        :meth:`to_json` dict); settings this identity does not know yet are skipped."""
        out = []
        for key, now in self.to_json().items():
            before = saved.get(key)
            if before != now:
                out.append(f"{key} (saved {_show(before)}, now {_show(now)})")
        return out


def _show(value: Any) -> str:
    if isinstance(value, list):
        shown = ", ".join(map(str, value[:4])) + (", …" if len(value) > 4 else "")
        return f"[{shown}] ({len(value)})"
    return repr(value)


@dataclass
class SavedRun:
    """What an output folder holds from an earlier run.

    Attributes:
        status: ``running`` (or killed without a chance to say so), ``interrupted`` or
            ``complete``.
        settings: the saved :meth:`RunIdentity.to_json` dict.
        command: the saved run's command line (may be empty).
        sessions: ISO start times of the processes that worked on it, first first.
        planned: generations the run plans (methods × prompts).
        records: finished generations in the journal.
        failures: method label → error, for methods that failed.
    """

    status: str
    settings: dict[str, Any]
    command: str = ""
    sessions: list[str] = field(default_factory=list)
    planned: int = 0
    records: list[PromptRecord] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)


def is_output_name(name: str) -> bool:
    """True for a name a benchmark run writes at the top of its folder."""
    if name.startswith(".") and name.endswith(".tmp"):  # a write cut short
        name = name[1:-len(".tmp")]
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in _OUTPUT_NAMES)


def _is_specbench_name(name: str) -> bool:
    return name.endswith(".jsonl") or (name.startswith(".") and name.endswith(".jsonl.tmp"))


def foreign_entries(folder: Path) -> list[str]:
    """The entries of ``folder`` that no benchmark run writes (relative names, sorted)."""
    foreign = []
    for entry in sorted(folder.iterdir()):
        if entry.name == SPECBENCH_DIR and entry.is_dir() and not entry.is_symlink():
            foreign += [f"{SPECBENCH_DIR}/{e.name}" for e in sorted(entry.iterdir())
                        if not (_is_specbench_name(e.name) and e.is_file())]
        elif not (is_output_name(entry.name) and entry.is_file()):
            foreign.append(entry.name + ("/" if entry.is_dir() else ""))
    return foreign


def _listing(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def read_saved_run(folder: Path, *, load_records: bool = True) -> SavedRun | None:
    """The run saved in ``folder`` (None when it has no ``run.json``).

    A last journal line cut short by a crash is ignored.

    Raises:
        InvalidArgumentError: ``run.json`` or a journal line before the last is damaged.
    """
    path = folder / RUN_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        saved = SavedRun(status=data["status"], settings=data["settings"],
                         command=data.get("command", ""), sessions=list(data.get("sessions", [])),
                         planned=int(data.get("planned", 0)))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InvalidArgumentError(
            f"{path} is damaged ({err}); the run saved in {folder} cannot be resumed; start "
            f"over with --out {folder} --overwrite or pick another --out") from None
    if load_records:
        saved.records, saved.failures, _ = _read_journal(folder / JOURNAL_FILE)
    return saved


def _read_journal(path: Path) -> tuple[list[PromptRecord], dict[str, str], int]:
    """Records, failures and the byte length of the journal's whole lines."""
    records: list[PromptRecord] = []
    failures: dict[str, str] = {}
    if not path.is_file():
        return records, failures, 0
    data = path.read_bytes()
    good = 0
    lines = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        last = number == len(lines)
        if not line.strip():
            good += len(line) + (0 if last else 1)
            continue
        try:
            entry = json.loads(line)
            if entry.get("event") == "failure":
                failures.setdefault(entry["method"], entry["error"])
            else:
                records.append(record_from_json(entry))
        except (ValueError, KeyError, TypeError) as err:
            if last:  # a line cut short by a crash: the generation did not finish writing
                logger.warning("ignoring the unfinished last line of %s", path)
                break
            raise InvalidArgumentError(
                f"{path} line {number} is damaged ({err}); the run cannot be resumed; start "
                f"over with --out {path.parent} --overwrite or pick another --out") from None
        good += len(line) + (0 if last else 1)
    return records, failures, good


def _nonempty_message(folder: Path, saved: SavedRun | None, foreign: list[str]) -> str:
    if saved is not None and saved.status != "complete":
        done = len(saved.records)
        return (f"--out {folder} holds an unfinished selfspec bench run ({done} of "
                f"{saved.planned} generations recorded); continue it with --resume {folder} "
                f"(same options), replace it with --out {folder} --overwrite, or pick a new "
                "--out")
    if saved is not None:
        return (f"--out {folder} already holds a complete selfspec bench run (started "
                f"{saved.sessions[0] if saved.sessions else 'earlier'}); pass --overwrite to "
                "replace it or pick a new --out")
    if foreign:
        return (f"--out {folder} is not empty (it holds {_listing(foreign)}); pick a new or "
                "empty --out")
    return (f"--out {folder} already holds selfspec bench results; pass --overwrite to "
            "replace them or pick a new --out")


def check_out_dir(folder: Path, mode: OutputMode, identity: RunIdentity) -> SavedRun | None:
    """Check that a run with ``identity`` may write ``folder`` in ``mode``; changes nothing.

    Returns:
        The saved run to continue (``RESUME``), else None.

    Raises:
        InvalidArgumentError: ``folder`` is a file; ``NEW`` and it is not empty;
            ``OVERWRITE`` and it holds files a benchmark run does not write; ``RESUME`` and
            it holds no run, a complete run, or a run with other settings (each difference
            is named).
    """
    if folder.exists() and not folder.is_dir():
        raise InvalidArgumentError(f"--out {folder} is a file; pass a folder")
    if mode is OutputMode.RESUME:
        return _check_resumable(folder, identity)
    if not folder.exists() or not any(e.name != LOCK_FILE for e in folder.iterdir()):
        return None
    foreign = foreign_entries(folder)
    if mode is OutputMode.OVERWRITE:
        if foreign:
            raise InvalidArgumentError(
                f"--overwrite refused: {folder} holds files selfspec bench did not write "
                f"({_listing(foreign)}) and it removes only its own; move them away or pick "
                "another --out")
        return None
    raise InvalidArgumentError(_nonempty_message(folder, read_saved_run(folder), foreign))


def _check_resumable(folder: Path, identity: RunIdentity) -> SavedRun:
    saved = read_saved_run(folder) if folder.is_dir() else None
    if saved is None:
        raise InvalidArgumentError(
            f"nothing to resume in {folder}: it holds no {RUN_FILE} (selfspec bench writes it "
            "when a run starts); start a run with --out instead of --resume")
    if saved.status == "complete":
        raise InvalidArgumentError(
            f"nothing to resume in {folder}: its run is complete ({len(saved.records)} "
            f"generations); pass --out {folder} --overwrite to run it again or pick a new --out")
    differences = identity.differences(saved.settings)
    if differences:
        again = f"`{saved.command}` with --resume {folder}" if saved.command else \
            "the saved run's command with --resume"
        raise InvalidArgumentError(
            f"cannot resume {folder}: this command's settings differ from the saved run's in "
            f"{'; '.join(differences)}; run {again}, start over with --out {folder} "
            "--overwrite, or pick a new --out")
    return saved


def remove_outputs(folder: Path) -> list[Path]:
    """Delete the files a benchmark run writes in ``folder`` (never anything else, never
    recursively); returns what was removed."""
    removed = []
    for entry in sorted(folder.iterdir()):
        if entry.name == LOCK_FILE:
            continue
        if entry.name == SPECBENCH_DIR and entry.is_dir() and not entry.is_symlink():
            for inner in sorted(entry.iterdir()):
                if _is_specbench_name(inner.name) and inner.is_file():
                    inner.unlink()
                    removed.append(inner)
            if not any(entry.iterdir()):
                entry.rmdir()
                removed.append(entry)
        elif is_output_name(entry.name) and entry.is_file():
            entry.unlink()
            removed.append(entry)
    return removed


def claim_new_dir(base: Path) -> Path:
    """Create and return a folder that did not exist: ``base``, else ``base-2``, ``base-3``,
    ... (creation is atomic, so two runs started in the same second get different folders).

    Raises:
        InvalidArgumentError: the folder cannot be created.
    """
    for attempt in range(1, 1000):
        path = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
        except OSError as err:
            raise InvalidArgumentError(
                f"cannot write benchmark results to {path}: {err.strerror or err}; pass --out "
                "with a writable directory") from None
    raise InvalidArgumentError(f"{base} and 998 numbered folders beside it exist; pass --out")


class RunFolder:
    """An output folder opened for writing by this process (see :func:`open_run_folder`).

    It holds the folder's lock until :meth:`close`, and is the harness's record sink: each
    finished generation and each failure goes to the journal at once.

    Attributes:
        path: the folder.
        previous: what earlier processes of this run finished (empty for a new run).
        sessions: start times of every process of the run, this one last.
    """

    def __init__(self, path: Path, lock: FileLock, state: dict[str, Any],
                 previous: SavedRun | None) -> None:
        self.path = path
        self._lock = lock
        self._state = state
        self.previous = previous or SavedRun(status="running", settings=state["settings"])
        self.sessions: list[str] = state["sessions"]
        self._journal = (path / JOURNAL_FILE).open("ab")

    def _append(self, entry: dict[str, Any]) -> None:
        self._journal.write(json.dumps(entry).encode() + b"\n")
        self._journal.flush()
        os.fsync(self._journal.fileno())

    def record(self, record: PromptRecord) -> None:
        """Append a finished generation to the journal (flushed and fsynced)."""
        self._append({"event": "record", **record_json(record, None)})

    def failure(self, method: str, message: str) -> None:
        """Append a method's failure to the journal (it stays failed when resumed)."""
        self._append({"event": "failure", "method": method, "error": message})

    def set_status(self, status: str) -> None:
        """Record the run's status (``interrupted`` or ``complete``) in ``run.json``."""
        self._state["status"] = status
        _write_state(self.path, self._state)

    def close(self) -> None:
        """Close the journal and release the lock."""
        self._journal.close()
        self._lock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_state(folder: Path, state: dict[str, Any]) -> None:
    write_text_atomic(folder / RUN_FILE, json.dumps(state, indent=2) + "\n")


def open_run_folder(folder: Path, mode: OutputMode, identity: RunIdentity, *, planned: int,
                    command: str, started: str) -> RunFolder:
    """Take ``folder`` for a run: lock it, check it (:func:`check_out_dir`), remove the
    previous outputs (``OVERWRITE``) or read the saved run back (``RESUME``), and write
    ``run.json`` with status ``running``.

    Args:
        folder: the output folder (created if missing).
        mode: what to do with what is there.
        identity: the run's settings (``run_prompts`` known).
        planned: generations the run plans (methods × prompts).
        command: the command line, saved for the resume hint.
        started: this process's start time (ISO 8601).

    Raises:
        InvalidArgumentError: another process is writing ``folder``; any refusal of
            :func:`check_out_dir`.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(folder / LOCK_FILE)
        lock.acquire(timeout=0)
    except Timeout:
        raise InvalidArgumentError(
            f"another selfspec bench process is writing to {folder}; wait for it to finish "
            "(or stop it), or pick another --out") from None
    except OSError as err:
        raise _unwritable(folder, err) from None
    try:
        saved = check_out_dir(folder, mode, identity)
        if mode is OutputMode.OVERWRITE:
            removed = remove_outputs(folder)
            if removed:
                logger.info("--overwrite: removed %d previous outputs from %s", len(removed),
                            folder)
        journal = folder / JOURNAL_FILE
        if saved is not None:
            _, _, good = _read_journal(journal)
            with journal.open("r+b" if journal.exists() else "wb") as f:
                f.truncate(good)  # drop a line a crash cut short
                if good and (f.seek(good - 1), f.read(1))[1] != b"\n":
                    f.write(b"\n")  # a whole line whose newline was not written
        else:
            journal.write_bytes(b"")
        state = {"format": FORMAT, "tool": "selfspec bench", "status": "running",
                 "settings": identity.to_json(), "planned": planned,
                 "command": saved.command if saved and saved.command else command,
                 "sessions": [*(saved.sessions if saved else []), started]}
        _write_state(folder, state)
        return RunFolder(folder, lock, state, saved)
    except OSError as err:
        lock.release()
        raise _unwritable(folder, err) from None
    except BaseException:
        lock.release()
        raise


def _unwritable(folder: Path, err: OSError) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"cannot write benchmark results to {folder}: {err.strerror or err}; pass --out with "
        "a writable directory")
