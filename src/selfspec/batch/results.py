"""The results file of ``selfspec batch``: one JSON line per request, appended as each
finishes, so a killed job loses nothing already written and a rerun skips those ids.

A line is written with one ``write`` and flushed; :meth:`ResultsFile.sync` makes the lines
so far durable (``fsync``). A job killed mid-line leaves a last line without its newline:
opening the file again cuts it off (that request runs again), so each id ends up in the file
exactly once.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from selfspec.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


class ResultsFile:
    """The JSONL results at ``path``, opened for appending.

    Attributes:
        done: the ids (string form) already in the file.

    Raises:
        InvalidArgumentError: the file cannot be opened, or a complete line in it is not a
            JSON object with an ``id`` (the message names the line: it is not a results file).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.done: set[str] = set()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._resume()
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as err:
            raise InvalidArgumentError(f"cannot open the results file {self.path}: {err}") from None

    def _resume(self) -> None:
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            logger.warning("%s: cutting off an unfinished last line (%d bytes) left by a job "
                           "that stopped mid-write; that request runs again",
                           self.path, len(data) - complete)
            with self.path.open("r+b") as f:
                f.truncate(complete)
        for number, line in enumerate(data[:complete].decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rid = json.loads(line)["id"]
            except (json.JSONDecodeError, TypeError, KeyError):
                raise InvalidArgumentError(
                    f"{self.path}:{number} is not a result line (a JSON object with an 'id'); "
                    "is --output another file? Move it away or name a new one") from None
            self.done.add(str(rid))

    def write(self, record: dict[str, Any]) -> bool:
        """Append ``record`` (a dict with ``id``) unless its id is already written.

        Returns:
            Whether it was written.
        """
        key = str(record["id"])
        if key in self.done:
            return False
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        self.done.add(key)
        return True

    def sync(self) -> None:
        """Make the lines written so far durable."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.sync()
            self._file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
