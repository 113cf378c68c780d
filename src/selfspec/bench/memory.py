"""Peak resident memory (RSS) of one generation, for the benchmark's memory column.

Methods run interleaved in one process, so the process-wide peak (``ru_maxrss``) would charge
every method with the largest one's. On Linux the kernel's high-water mark of the process
(``VmHWM`` in ``/proc/self/status``) can be reset to the current RSS by writing ``5`` to
``/proc/self/clear_refs`` (proc(5)); resetting it before a generation and reading it after
gives that generation's peak. Freed memory that the C allocator keeps for reuse still counts
as resident, so an earlier method's large buffers would raise every later method's baseline:
:meth:`PeakRss.reset` first returns it to the system (glibc ``malloc_trim``, where present).
Where the peak cannot be reset (other systems, a restricted ``/proc``) the probe reports
nothing rather than a misleading number.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK = "5"  # proc(5): reset the peak resident set size ("high water mark")


@dataclass
class PeakRss:
    """Resettable peak-RSS probe of this process (Linux).

    Attributes:
        available: whether resetting and reading the peak works here (probed on creation).
    """

    available: bool = False
    _trim: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.available and self._trim is None:
            self._trim = _malloc_trim()

    @classmethod
    def probe(cls) -> PeakRss:
        """A probe that works here, or one that reports ``None`` (logged once)."""
        probe = cls(available=True)
        try:
            probe.reset()
            if probe.read_mib() is None:
                raise OSError("no VmHWM in /proc/self/status")
        except OSError as err:
            logger.info("peak RSS per generation unavailable: %s", err)
            return cls(available=False)
        return probe

    def reset(self) -> None:
        """Set the peak to the current RSS.

        Raises:
            OSError: ``/proc/self/clear_refs`` cannot be written (only from :meth:`probe`).
        """
        if self.available:
            if self._trim is not None:
                self._trim(0)  # hand freed heap memory back, so it stops counting as resident
            _CLEAR_REFS.write_text(_RESET_PEAK)

    def read_mib(self) -> float | None:
        """The peak RSS since the last :meth:`reset`, in MiB (``None`` if unavailable)."""
        if not self.available:
            return None
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # the kernel reports kB
        return None


def _malloc_trim():
    """glibc's ``malloc_trim`` (``int malloc_trim(size_t pad)``), or None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


@dataclass
class PeakGpu:
    """Peak GPU memory allocated by torch during one generation (CUDA's allocator
    statistics, reset before each generation), for the benchmark's "peak GPU MiB" column.

    Attributes:
        device: the CUDA device measured, or ``None`` (nothing measured: the CPU).
    """

    device: object = None

    @classmethod
    def probe(cls, device: object = None) -> PeakGpu:
        """A probe of ``device`` (default: the current CUDA device, when torch has used
        CUDA in this process), or one that reports ``None``."""
        import torch

        if device is None:
            if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                return cls()
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        return cls(device if device.type == "cuda" else None)

    def reset(self) -> None:
        """Start a new peak at the memory allocated now."""
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def read_mib(self) -> float | None:
        """The peak since :meth:`reset`, in MiB (``None`` off CUDA)."""
        if self.device is None:
            return None
        import torch

        return torch.cuda.max_memory_allocated(self.device) / 2**20
