"""CUDA graphs for the decoding forwards: the one-token step and verification blocks of
``T = 2..K`` tokens, captured once and replayed (``--cuda-graphs auto|on|off``; ``auto`` =
on for CUDA, never on the CPU).

Why: on a GPU a small model's decoding step is bound by launching kernels (a 30-layer
model launches ~15 kernels a layer, each ~5-10 µs of host time), not by the work; a captured
graph launches them all at once.

What a graph needs, and how the executor gives it:

* fixed addresses: a **static KV cache** (``KVCache(fixed=True)``: allocated once at its
  capacity, zeroed, never reallocated), static input buffers (token ids and positions of
  each captured size), the RoPE table grown to the capacity and held by the runner;
* no host syncs and no data-dependent shapes: :func:`static_forward` is the forward written
  for that — each layer writes its new keys and values at the positions with
  ``index_copy_`` and attends over the **whole** capacity under a mask ``column <= position``
  (so the shapes never depend on the cache length), in plain torch;
* the cache lengths are host ints kept by :class:`~selfspec.executor.cache.KVCache`: after a
  replay the runner marks the positions held (``KVCache.hold``), so crops and rollbacks work
  as on the eager path.

:class:`CudaGraphRunner` is attached to an executor (``executor.graphs``) by
:func:`attach_graphs`. :meth:`LayerExecutor.forward` asks it first; it replays when the block
is one it serves (batch 1, no observer, the runner's static cache, ``T`` in the captured
sizes, room left in the cache) and otherwise returns ``None`` and counts the reason in
:class:`GraphStats` (``fallbacks``): the executor then runs the block eagerly, on the same
static cache (prefill, long drafts, layer-range methods' ``run_layers`` calls all stay
eager). Generations get the static cache through :meth:`CudaGraphRunner.decode_cache` (one
generation at a time holds it; others get an ordinary cache and run eagerly).

Numerics: the static path attends with one SDPA call over the masked capacity where the
eager path attends one token at a time, so the two round differently; with graphs on, every
one-token step and captured verification block takes the static path, so decoding and
verification stay consistent with each other (greedy parity with ``ar`` is checked on the
GPU by ``scripts/gpu_check.py``).

Import-safe on the CPU: nothing here touches CUDA until a runner with ``replay="cuda"``
captures. The pure logic (sizes, buffers, fallback reasons, bookkeeping) and
:func:`static_forward` itself run on the CPU with ``replay="eager"``, which calls the
static forward on the static buffers instead of replaying a graph (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from selfspec.errors import InvalidArgumentError
from selfspec.executor.attention import (
    attention_input,
    mlp_output,
    parallel_residual,
    rotated_qkv,
    sublayer_output,
)
from selfspec.executor.cache import CacheShape, KVCache
from selfspec.executor.sync import first_position, position_block

if TYPE_CHECKING:
    from selfspec.executor.contract import Executor

CUDA_GRAPHS_CHOICES = ("auto", "on", "off")
#: Verification blocks up to this many tokens (a draft of K-1 and its bonus position) are
#: captured; longer ones run eagerly.
DEFAULT_MAX_TOKENS = 16
#: Positions of the static cache (at most the model's context).
DEFAULT_CAPACITY = 2048


def check_cuda_graphs(value: Any, device: torch.device | str | None = None) -> str:
    """A ``--cuda-graphs`` / ``cuda_graphs=`` value: ``"auto"``, ``"on"`` or ``"off"``.

    Raises:
        InvalidArgumentError: another value, or ``"on"`` for a device that is not CUDA.
    """
    if value not in CUDA_GRAPHS_CHOICES:
        raise InvalidArgumentError(
            f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS_CHOICES)}; got {value!r}")
    if value == "on" and device is not None and torch.device(device).type != "cuda":
        raise InvalidArgumentError(
            f"cuda_graphs='on' needs a CUDA device; the model is on {torch.device(device)} "
            "(use 'auto' or 'off')")
    return value


def graphs_wanted(value: str, device: torch.device | str) -> bool:
    """Whether ``value`` turns graphs on for ``device`` (``auto``: CUDA only)."""
    return check_cuda_graphs(value, device) != "off" and torch.device(device).type == "cuda"


def graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """The block sizes captured: one token (decoding) and ``2..max_tokens`` (verification).

    Raises:
        InvalidArgumentError: ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be >= 1; got {max_tokens}")
    return tuple(range(1, max_tokens + 1))


@dataclass
class GraphStats:
    """What a runner did.

    Attributes:
        captured: sizes captured so far, in order.
        capture_ms: time spent capturing.
        replays: size → replays.
        fallbacks: reason → forwards run eagerly instead (``"prefill"`` included).
    """

    captured: list[int] = field(default_factory=list)
    capture_ms: float = 0.0
    replays: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"captured": list(self.captured), "capture_ms": round(self.capture_ms, 1),
                "replays": {str(k): v for k, v in sorted(self.replays.items())},
                "fallbacks": dict(sorted(self.fallbacks.items()))}


def static_forward(ex: Executor, input_ids: torch.Tensor, positions: torch.Tensor,
                   keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                   columns: torch.Tensor, cos_table: torch.Tensor,
                   sin_table: torch.Tensor) -> torch.Tensor:
    """The full model on ``T`` tokens with shapes independent of the cache length and no
    host sync (what a CUDA graph captures).

    Args:
        ex: the executor (its weights, norms, ``lm_head``).
        input_ids: ``[1, T]`` int64.
        positions: ``[1, T]`` int64 consecutive positions; every position before the first
            must already be in ``keys``/``values``.
        keys / values: per layer, the whole storage ``[1, H_kv, C, hd]`` of a fixed cache
            (written at ``positions``).
        columns: ``[C]`` int64 ``0 .. C-1`` (the mask's key positions).
        cos_table / sin_table: ``[>= C, hd]`` RoPE rows in the model's dtype.

    Returns:
        ``[1, T, V]`` logits.
    """
    num_new = input_ids.shape[1]
    nq, nkv, hd = ex.num_heads, ex.num_kv_heads, ex.head_dim
    pos = positions[0]
    cos, sin = cos_table[positions].unsqueeze(2), sin_table[positions].unsqueeze(2)
    mask = columns.unsqueeze(0) <= pos.unsqueeze(1)             # [T, C]: causal over the cache
    hidden = ex.embed(input_ids)
    for i, w in enumerate(ex.layer_weights):
        qk, v = rotated_qkv(w, w.qkv(attention_input(w, hidden)), cos, sin, (nq, nkv, hd))
        keys[i].index_copy_(2, pos, qk[:, :, nq:].transpose(1, 2))
        values[i].index_copy_(2, pos, v.transpose(1, 2))
        layer_mask = mask if w.window is None else (  # a sliding window: p - W < k <= p
            mask & (columns.unsqueeze(0) > pos.unsqueeze(1) - w.window))
        out = F.scaled_dot_product_attention(
            qk[:, :, :nq].transpose(1, 2), keys[i], values[i], attn_mask=layer_mask,
            scale=ex.scaling, enable_gqa=nq != nkv)              # [1, Hq, T, hd]
        attn_out = sublayer_output(
            w, w.o(out.transpose(1, 2).reshape(1, num_new, nq * hd)), w.post_attn_norm)
        if w.parallel:  # use_parallel_residual
            hidden = parallel_residual(hidden, attn_out, mlp_output(w, hidden))
            continue
        hidden = hidden + attn_out
        hidden = hidden + mlp_output(w, hidden)
    return ex.logits(hidden)


@dataclass
class _Captured:
    """One captured size: its static inputs, its output and how to replay it."""

    input_ids: torch.Tensor     # [1, T]
    positions: torch.Tensor     # [1, T]
    logits: torch.Tensor        # [1, T, V], written by each replay
    replay: Callable[[], None]
    graph: Any = None           # the torch.cuda.CUDAGraph (kept alive)


class CudaGraphRunner:
    """Captured forwards of one executor over one static KV cache.

    Args:
        executor: the model's executor.
        capacity: positions of the static cache (at most the model's context).
        max_tokens: the largest block captured (:func:`graph_sizes`).
        replay: ``"cuda"`` (capture ``torch.cuda.CUDAGraph`` s; needs the executor on CUDA)
            or ``"eager"`` (call :func:`static_forward` on the static buffers: the same
            bookkeeping on any device, for tests).

    Raises:
        InvalidArgumentError: ``replay="cuda"`` for an executor not on CUDA.
    """

    def __init__(self, executor: Executor, capacity: int = DEFAULT_CAPACITY,
                 max_tokens: int = DEFAULT_MAX_TOKENS, replay: str = "cuda") -> None:
        if replay not in ("cuda", "eager"):
            raise InvalidArgumentError(f"replay must be 'cuda' or 'eager'; got {replay!r}")
        if replay == "cuda" and executor.device.type != "cuda":
            raise InvalidArgumentError(
                f"CUDA graphs need the model on a CUDA device; it is on {executor.device}")
        self.executor = executor
        self.capacity = max(2, min(capacity, executor.max_positions))
        self.sizes = graph_sizes(max_tokens)
        self.mode = replay
        self.stats = GraphStats()
        shape = CacheShape(executor.num_layers, 1, executor.num_kv_heads, executor.head_dim)
        self.cache = KVCache(shape, executor.dtype, executor.device, self.capacity, fixed=True)
        self._keys, self._values = self.cache.storage()
        self._columns = torch.arange(self.capacity, device=executor.device)
        # The RoPE table covering the capacity, held here: a graph reads it by address.
        probe = torch.zeros(1, 1, executor.config.hidden_size, dtype=executor.dtype,
                            device=executor.device)
        executor.rope.lookup(probe, position_block(self.capacity - 1, 1, executor.device))
        self._cos, self._sin = executor.rope.cos, executor.rope.sin
        self._graphs: dict[int, _Captured] = {}
        self._pool = None
        self._owner: Callable[[], Any] | None = None

    # ------------------------------------------------------------ the static cache
    def decode_cache(self, capacity: int, owner: Any) -> KVCache | None:
        """The static cache, emptied, for a generation (``owner``, e.g. its ``DecodeState``)
        that needs at most ``capacity`` positions; ``None`` (use an ordinary cache, run
        eagerly) when another generation still holds it (its owner alive and not ``done``)
        or ``capacity`` plus a draft's overshoot does not fit. Counted in
        ``stats.fallbacks``."""
        if capacity + self.executor.row_attention_max > self.capacity:
            self.stats.fallbacks["longer than the static cache"] += 1
            return None
        current = None if self._owner is None else self._owner()
        if current is not None and current is not owner and not getattr(current, "done", True):
            self.stats.fallbacks["static cache in use"] += 1
            return None
        try:
            self._owner = weakref.ref(owner)
        except TypeError:
            self._owner = lambda: owner
        self.cache.reset()
        return self.cache

    # ------------------------------------------------------------ forwards
    def why_eager(self, num_new: int, pos0: int, cache: KVCache, batch: int,
                  observe: Any) -> str | None:
        """Why a forward of ``num_new`` tokens from ``pos0`` runs eagerly, or ``None`` when
        a graph serves it (pure: reads the arguments and the cache's host-side lengths)."""
        if cache is not self.cache:
            return "not the static cache"
        if pos0 == 0:
            return "prefill"
        if batch != 1:
            return "batch"
        if observe is not None:
            return "observer"
        if num_new not in self.sizes:
            return f"block of {num_new} tokens"
        if pos0 + num_new > self.capacity:
            return "beyond the static cache"
        lengths = cache.lengths()
        if min(lengths) != pos0 or max(lengths) != pos0:
            return "layers of different lengths"
        if cache.any_masked(0, cache.num_layers):
            return "masked positions"
        if any(w.rope_kind != "default" for w in self.executor.layer_weights):
            return "a RoPE table per layer type"  # the graph reads one table
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                last_only: bool = False, observe: Any = None) -> torch.Tensor | None:
        """:meth:`LayerExecutor.forward` on a replayed graph, or ``None`` (run it eagerly:
        the reason is counted)."""
        batch, num_new = input_ids.shape
        pos0 = first_position(positions)
        reason = self.why_eager(num_new, pos0, cache, batch, observe)
        if reason is not None:
            self.stats.fallbacks[reason] += 1
            return None
        captured = self._graphs.get(num_new)
        if captured is None:
            captured = self._graphs[num_new] = self._capture(num_new)
        captured.input_ids.copy_(input_ids)
        captured.positions.copy_(self._columns[pos0:pos0 + num_new].unsqueeze(0))
        captured.replay()
        cache.hold(pos0, num_new)
        self.stats.replays[num_new] += 1
        logits = captured.logits[:, -1:] if last_only else captured.logits
        return logits.clone()  # the next replay overwrites the static output

    def _capture(self, num_new: int) -> _Captured:
        """Static buffers for ``num_new`` tokens and their graph (or eager stand-in). The
        warm-up and capture write keys at the cache's last positions, which no held
        position reads before a real forward overwrites them."""
        t0 = time.perf_counter()
        ex = self.executor
        input_ids = torch.zeros(1, num_new, dtype=torch.long, device=ex.device)
        positions = self._columns[self.capacity - num_new:].unsqueeze(0).clone()
        run = (lambda: static_forward(ex, input_ids, positions, self._keys, self._values,
                                      self._columns, self._cos, self._sin))
        if self.mode == "eager":
            logits = run()

            def replay() -> None:
                logits.copy_(run())

            captured = _Captured(input_ids, positions, logits, replay)
        else:
            captured = self._capture_cuda(run, input_ids, positions)
        self.stats.captured.append(num_new)
        self.stats.capture_ms += (time.perf_counter() - t0) * 1e3
        return captured

    def _capture_cuda(self, run: Callable[[], torch.Tensor], input_ids: torch.Tensor,
                      positions: torch.Tensor) -> _Captured:  # pragma: no cover - CUDA only
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy inits and autotuning outside the capture
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = run()
        return _Captured(input_ids, positions, logits, graph.replay, graph)


def attach_graphs(executor: Executor, value: str = "auto", **settings: Any) -> None:
    """Give ``executor`` a :class:`CudaGraphRunner` (``executor.graphs``) when ``value``
    turns graphs on for its device, else ``None``; ``settings`` go to the runner.

    Raises:
        InvalidArgumentError: a bad ``value``, or ``"on"`` off CUDA.
    """
    executor.graphs = (CudaGraphRunner(executor, **settings)
                       if graphs_wanted(value, executor.device) else None)
