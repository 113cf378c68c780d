"""Device → host transfers: the one a decoding step needs, the position blocks that need
none, and a counter of every implicit sync (tests, the GPU check script).

On a GPU every read of a tensor's value on the host (``.item()``, ``.tolist()``, ``int(t)``,
``bool(t)``, ``.cpu()``) waits for the device to finish all queued work: a *sync*. A
speculative step needs exactly one — the accepted count and the committed tokens, which the
host needs to decide what to run next — and everything else should stay on the device:

* :func:`to_host` is that one transfer (``.tolist()`` of one small int tensor); a step's reads
  of accepted counts and tokens go through it, so they can be counted.
* :func:`position_block` makes a ``[1, T]`` position tensor on the device from host ints and
  remembers its first position on the tensor, so the executor reads ``pos0`` from the
  host (:func:`first_position`) instead of from the device (``int(positions[0, 0])``, a sync
  per layer-range call).
* :class:`SyncCounter` counts the implicit syncs of a block of code by wrapping the tensor
  methods that cause them (on any device: on the CPU it is a stand-in for CUDA's
  ``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import threading
from collections import Counter

import torch

_START = "_selfspec_pos0"
_LOCK = threading.Lock()


def to_host(tensor: torch.Tensor) -> list:
    """The values of a small tensor on the host: the one device → host copy of a decoding
    step (:func:`selfspec.decoding.core.verification.verify_greedy` and
    ``verify_sampling`` bring the accepted count and the committed tokens back in one)."""
    return tensor.tolist()


def position_block(start: int, count: int, device: torch.device | str,
                   batch: int = 1) -> torch.Tensor:
    """``[batch, count]`` int64 positions ``start .. start + count - 1`` on ``device``
    (``torch.arange``, no sync), tagged with ``start`` for :func:`first_position`."""
    positions = torch.arange(start, start + count, device=device).unsqueeze(0)
    if batch != 1:
        positions = positions.expand(batch, count)
    setattr(positions, _START, int(start))
    return positions


def first_position(positions: torch.Tensor) -> int:
    """``positions[0, 0]`` as an int: from the tag of :func:`position_block` (no sync), else
    read from the tensor (a sync on a GPU)."""
    start = getattr(positions, _START, None)
    return int(positions[0, 0]) if start is None else start


def last_position(positions: torch.Tensor) -> int:
    """The largest position of a block of consecutive positions (``positions`` ``[B, T]``):
    from the tag without a sync, else ``int(positions.max())``."""
    start = getattr(positions, _START, None)
    return int(positions.max()) if start is None else start + positions.shape[-1] - 1


#: The tensor methods that copy values to the host (each a sync on a GPU).
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__",
                "__index__")


class SyncCounter:
    """Counts calls of :data:`SYNC_METHODS` on tensors (on any device) while active.

    Use as a context manager; ``counts`` maps a method name to its calls, ``total`` sums
    them. ``.cpu()`` on a tensor already on the CPU and ``.tolist()`` of a CPU tensor count
    too (on the CPU this is a stand-in for what the same code does on a GPU). Not
    re-entrant; patches ``torch.Tensor`` for the whole process while active.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._saved: dict[str, object] = {}

    @property
    def total(self) -> int:
        """Syncs counted."""
        return sum(self.counts.values())

    def __enter__(self) -> SyncCounter:  # noqa: PYI034
        _LOCK.acquire()
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        _LOCK.release()

    def _wrap(self, name: str, original):
        counts = self.counts

        def counted(tensor, *args, **kwargs):
            counts[name] += 1
            return original(tensor, *args, **kwargs)

        counted.__name__ = name
        return counted


def device_tensor(values: list, device: torch.device | str,
                  dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without a sync: on CUDA through pinned host
    memory and a non-blocking copy (a copy from ordinary host memory waits for the GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
