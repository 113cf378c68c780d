"""Measured latency model of one model on this machine (KnapSpec §3.1-3.4).

One decoding token costs, per layer, an attention sub-layer whose time grows with the context
length ``n`` (``t_attn(n) ≈ attn_slope_ms · n + attn_base_ms``: it reads ``n`` cached keys
and values) and an MLP sub-layer of constant time, plus the final norm and ``lm_head`` once.
The model predicts the time of a draft token under a :class:`SkipPlan`, of a verification,
and a step's Tokens-per-Time (eq. 4); KnapSpec turns it into integer knapsack weights.

Two measurements go beyond the paper, which assumes a GPU where verifying ``γ + 1`` tokens
costs as much as one: the verification of ``T`` tokens (``target_ms`` plus the extra time of
``T`` tokens over one, measured at :data:`VERIFY_TOKENS` and interpolated: on a CPU the extra
tokens cost, and not linearly — with AMX a product of 1 to 16 rows costs the same and 17 rows
cost a second tile; beyond the table ``verify_token_ms`` per token), and the time of one
read-only call of a sub-layer on a batch of rows (``batched_call_ms + rows ·
batched_row_ms``), from which a planner predicts its own cost.

Byte accounting (:func:`decode_weight_bytes`, :func:`decode_layer_bytes`,
:func:`output_decode_bytes`) counts what one decoding call reads, each matrix in its decoding
backend's format (:meth:`selfspec.executor.backends.MatrixBackend.decode_bytes`): the
numerator of the bandwidth roofline and the unit of the byte-based cost models.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from selfspec.executor import bf16_rows, native, w4a8
from selfspec.executor.contract import Executor
from selfspec.executor.cpu import detect_cpu
from selfspec.executor.plan import SkipPlan
from selfspec.executor.sync import first_position, position_block

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS = (64, 256, 1024, 2048)
FORMAT = 7  # bump when the measured quantities change: older files are measured again
#: Forward sizes ``T`` at which the extra time of a verification is measured: every draft
#: length a method uses by default (``auto`` up to 16, KnapSpec up to 10) and both sides of
#: the 16-row step of AMX tiles and of oneDNN's row blocking.
VERIFY_TOKENS = (1, 2, 4, 8, 12, 16, 17, 20, 24, 32)


@dataclass(frozen=True)
class LatencyModel:
    """Sub-layer latencies of one model, dtype, thread count and machine, in ms.

    Attributes:
        num_layers: L.
        attn_slope_ms: attention time per cached position (c2).
        attn_base_ms: attention time at an empty cache (c3).
        mlp_ms: one MLP sub-layer.
        head_ms: the final norm + ``lm_head``.
        verify_token_ms: each token beyond the first of a full forward (0 = the paper's GPU
            assumption: verifying ``T`` tokens costs one token's time), fitted over
            ``verify_points``; used alone where those are absent and beyond the last.
        verify_points: ``((T, ms), ...)``, increasing ``T`` from 1: the measured extra time
            of a full forward of ``T`` tokens over one token (non-decreasing in ``T``);
            linear between the points.
        batched_row_ms: one sub-layer (attention + MLP averaged) on each row of a batch of
            rows, read-only: what KnapSpec's DP pays per budget, token and sub-layer.
        batched_call_ms: the fixed part of one such call, whatever its rows (on CPUs that
            emulate bf16 the bulk products cast the weights each call, many times a row's
            cost).
        key: what it was measured for (model, dtype, threads, machine).
        draft_head_ms: the output head a draft token pays when it is not ``head_ms``: a
            reduced draft vocabulary's rows only (:meth:`with_draft_head`); ``None`` = the
            full head. Verification always pays ``head_ms``.
    """

    num_layers: int
    attn_slope_ms: float
    attn_base_ms: float
    mlp_ms: float
    head_ms: float
    verify_token_ms: float = field(default=0.0, kw_only=True)
    verify_points: tuple[tuple[int, float], ...] = field(default=(), kw_only=True)
    batched_row_ms: float = field(default=0.0, kw_only=True)
    batched_call_ms: float = field(default=0.0, kw_only=True)
    key: str = field(default="", kw_only=True)
    draft_head_ms: float | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        # JSON gives lists; keep the dataclass hashable and comparable
        object.__setattr__(self, "verify_points",
                           tuple((int(t), float(ms)) for t, ms in self.verify_points))

    def t_attn(self, context_len: int) -> float:
        """One attention sub-layer on one token over ``context_len`` cached positions, ms."""
        return max(self.attn_slope_ms * context_len + self.attn_base_ms, 1e-6)

    def weights(self, context_len: int, cap: int = 5) -> tuple[int, int]:
        """KnapSpec §3.4 integer weights ``(w_attn, w_mlp)``: each latency divided by the
        smaller one, rounded, capped at ``cap``."""
        t_attn, t_mlp = self.t_attn(context_len), max(self.mlp_ms, 1e-6)
        delta = min(t_attn, t_mlp)
        return (min(cap, max(1, round(t_attn / delta))), min(cap, max(1, round(t_mlp / delta))))

    def draft_ms(self, plan: SkipPlan, context_len: int) -> float:
        """One draft token under ``plan``: the sub-layers it runs plus the output head (the
        reduced one where :meth:`with_draft_head` set it)."""
        attn = self.num_layers - len(plan.skip_attention)
        mlp = self.num_layers - len(plan.skip_mlp)
        head = self.head_ms if self.draft_head_ms is None else self.draft_head_ms
        return attn * self.t_attn(context_len) + mlp * self.mlp_ms + head

    def with_draft_head(self, byte_share: float) -> LatencyModel:
        """This model with draft tokens paying an output head of ``byte_share`` of the full
        head's weight bytes (a draft vocabulary of ``R`` of ``V`` rows: about ``R / V``): the
        head is bound by its weight bytes on one token, as the MLP sub-layers are (FR-Spec
        §3's premise), so its time scales with them.

        Raises:
            ValueError: ``byte_share`` outside ``(0, 1]``.
        """
        if not 0 < byte_share <= 1:
            raise ValueError(f"byte_share must lie in (0, 1], got {byte_share}")
        return dataclasses.replace(self, draft_head_ms=self.head_ms * byte_share)

    def target_ms(self, context_len: int) -> float:
        """One verification, as the paper counts it: ``L (t_attn + t_mlp)`` plus the head."""
        return self.num_layers * (self.t_attn(context_len) + self.mlp_ms) + self.head_ms

    def verify_ms(self, context_len: int, num_tokens: int) -> float:
        """A full forward of ``num_tokens`` tokens (a verification of ``num_tokens - 1``
        draft tokens), ms: ``target_ms`` plus the measured cost of the extra tokens."""
        return self.target_ms(context_len) + self.extra_tokens_ms(num_tokens)

    def extra_tokens_ms(self, num_tokens: int) -> float:
        """Extra time of a full forward of ``num_tokens`` tokens over one token, ms."""
        points = self.verify_points or ((1, 0.0),)  # no table: verify_token_ms per token
        if num_tokens <= points[0][0]:
            return points[0][1]
        for (t0, ms0), (t1, ms1) in itertools.pairwise(points):
            if num_tokens <= t1:
                return ms0 + (ms1 - ms0) * (num_tokens - t0) / (t1 - t0)
        last_t, last_ms = points[-1]
        return last_ms + (num_tokens - last_t) * self.verify_token_ms

    def batched_ms(self, rows: int) -> float:
        """One read-only call of one sub-layer on ``rows`` rows, ms."""
        return self.batched_call_ms + rows * self.batched_row_ms

    def predict(self, plan: SkipPlan, context_len: int, draft_len: int) -> float:
        """Time of one speculative step, ms: ``γ t_draft(plan) + t_verify(γ + 1)``."""
        return (draft_len * self.draft_ms(plan, context_len)
                + self.verify_ms(context_len, draft_len + 1))

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)})

    @classmethod
    def from_json(cls, text: str) -> LatencyModel:
        """Raises: ValueError: not JSON, another format, or missing fields."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
            raise ValueError(f"not a format-{FORMAT} latency file")
        return cls(**data)


def decode_layer_bytes(executor: Executor, layer: int = 0) -> int:
    """Bytes of weights decoder layer ``layer`` (``0 <= layer < L``) reads per decoding call:
    its four matrices in their decoding backend's format (or the weights' own) and its norms
    (:attr:`~selfspec.executor.weights.LayerWeights.norms`). The unit of the byte-based cost models.

    Raises:
        IndexError: ``layer`` outside ``[0, L)``.
    """
    w = executor.layer_weights[layer]
    return (sum(lin.decode_bytes for lin in w.matrices)
            + sum(t.numel() * t.element_size() for t in w.norms))


def output_decode_bytes(executor: Executor) -> int:
    """Bytes of ``lm_head`` weights (and bias) one decoding call reads."""
    return executor.output_weights.decode_bytes


def decode_weight_bytes(executor: Executor) -> int:
    """Bytes of weights one token's full forward reads in decoding: every layer
    (:func:`decode_layer_bytes`), the final norm and ``lm_head``
    (:func:`output_decode_bytes`). The numerator of the bandwidth roofline."""
    total = output_decode_bytes(executor) + sum(decode_layer_bytes(executor, i)
                                                for i in range(executor.num_layers))
    return total + sum(p.numel() * p.element_size() for p in executor.norm.parameters())


def machine_key(executor: Executor) -> str:
    """What a measurement holds for: model, dtype, decoding kernel (and a draft view's weight
    format; for selfspec's own kernels, a digest of their source), threads, processor and
    its kernel level (cloud VMs often name every CPU "AMD EPYC"; an AVX2-only one and one
    with native bf16 time the same model 1.5-2x apart, so the name alone is not enough).
    The model's shapes are part of the key: two models loaded under one name (a user's
    ``name=``, or a resized model) must not read each other's timings."""
    name = executor.name.replace("/", "_")
    cfg = executor.config
    shape = "x".join(str(getattr(cfg, attr, None) or 0) for attr in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "vocab_size"))
    name += f"-{shape}"
    formats = getattr(executor, "formats", None)
    kernel = ""
    if formats is not None and formats.rows != "weights":
        kernel = f"-{formats.rows}rows{formats.rows_min_bytes >> 20}M"
        if "bf16" in formats.rows.split("+"):  # selfspec's own kernel: its version counts
            kernel += f"-{native.source_digest(bf16_rows.SOURCE)}"
        if formats.rows.startswith("gguf"):  # the kernels' version, the file's block types
            weights = getattr(executor, "gguf_weights", None)
            types = "" if weights is None else "".join(
                f"{t}{n}" for t, n in sorted(weights.types().items()))
            kernel += f"-{native.source_digest('gguf_rows.cpp')}-{types}"
    draft = getattr(executor, "draft_weights", None)
    if draft is not None:  # a draft view: every linear on quantized copies
        kernel += f"-draft{draft}"
        if draft == "w4a8":
            kernel += f"-{native.source_digest(w4a8.SOURCE)}"
        elif draft in ("q3_k", "q2_k"):  # GGUF blocks: the gguf kernels' version counts
            kernel += f"-{native.source_digest('gguf_rows.cpp')}"
    device = torch.device(getattr(executor, "device", "cpu"))
    if device.type != "cpu":  # a GPU's timings: its name, never mixed with a CPU's
        graphs = "-graphs" if getattr(executor, "graphs", None) is not None else ""
        return (f"{name}-{str(executor.dtype).removeprefix('torch.')}{kernel}{graphs}-"
                f"{device.type}-{device_name(device)}")
    cpu = detect_cpu()
    level = "-".join(filter(None, (cpu.aten_capability, "bf16" if cpu.native_bf16 else "",
                                   cpu.onednn_max_isa)))
    return (f"{name}-{str(executor.dtype).removeprefix('torch.')}{kernel}-t"
            f"{torch.get_num_threads()}-{platform.machine()}-{_cpu_name()}-{level}")


def device_name(device: torch.device | str) -> str:
    """A file-name-safe name of ``device``'s hardware: ``torch.cuda.get_device_name`` on
    CUDA (``NVIDIA_H200``), the CPU's model name otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        raw = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        return _cpu_name()
    else:
        raw = device.type
    return "".join(c if c.isalnum() else "_" for c in raw)


def synchronize(device: torch.device | str) -> None:
    """Wait for ``device``'s queued work (CUDA; nothing on the CPU), so a timer reads the
    work's end, not its launch."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "".join(c if c.isalnum() else "_" for c in line.split(":", 1)[1].strip())
    except OSError:
        pass
    return platform.processor() or "cpu"


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``y = slope · x + intercept`` (slope 0 when
    every ``x`` is the same)."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return 0.0, mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    return slope, mean_y - slope * mean_x


def _context_lengths(lengths: tuple[int, ...], max_positions: int) -> list[int]:
    """``lengths`` that fit a context of ``max_positions`` (each cut to ``max_positions - 1``,
    duplicates dropped); a short context whose lengths all cut to one gets a quarter of it
    too, so the attention fit has two points."""
    top = max(1, max_positions - 1)
    fitted = sorted({min(n, top) for n in lengths})
    if len(fitted) < 2:
        fitted = sorted({max(1, top // 4), top})
    return fitted


def _time_ms(fn, repeats: int, device: torch.device | str = "cpu") -> float:
    """Fastest of ``repeats`` timings of ``fn()``, ms (after a warm-up), the device
    synchronized around each call (on CUDA the kernels run after the launch returns).

    The minimum, not the median: the code timed is deterministic, so the fastest run is the
    one least disturbed by other processes (as ``timeit``'s documentation argues). A median
    of a few repeats taken during another process's burst priced verification so high that
    the n-gram gate never drafted until the cached file was measured again."""
    fn()  # warm-up
    return min(_once_ms(fn, device) for _ in range(repeats))


def _once_ms(fn, device: torch.device | str = "cpu") -> float:
    """Milliseconds of one call of ``fn()``, the device synchronized around it."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


@dataclass(frozen=True)
class SublayerTimes:
    """Measured time of one sub-layer on one token, ms.

    Attributes:
        context_len: cached positions it attended to.
        attention_ms: the attention sub-layer (norm included).
        mlp_ms: the MLP sub-layer (norm included).
    """

    context_len: int
    attention_ms: float
    mlp_ms: float


@torch.inference_mode()
def measure_sublayers(executor: Executor, context_len: int,
                      repeats: int = 20) -> SublayerTimes:
    """Median time of one attention and of one MLP sub-layer on one token over a cache of
    ``context_len`` random keys and values (the cache is left as it was).

    Each is timed as all ``L`` sub-layers of its kind in one pass (a plan skipping every
    sub-layer of the other kind), divided by ``L``: every layer's weights stream from
    memory as in decoding. Timing one layer again and again would keep a small model's
    weights in the processor's cache and undercount (SmolLM2 fp32: 2x).
    """
    ex = executor
    every = frozenset(range(ex.num_layers))
    hidden = torch.randn(1, 1, ex.config.hidden_size, dtype=ex.dtype, device=ex.device) * 0.1
    cache = _filled_cache(ex, context_len, range(ex.num_layers))
    pos = position_block(context_len, 1, ex.device)
    times = [_time_ms(functools.partial(_step, ex, hidden, pos, cache, plan), repeats,
                      ex.device) / ex.num_layers
             for plan in (SkipPlan(skip_mlp=every), SkipPlan(skip_attention=every))]
    return SublayerTimes(context_len, times[0], times[1])


def _step(ex: Executor, hidden: torch.Tensor, pos: torch.Tensor, cache,
          plan: SkipPlan | None = None, head: bool = False) -> None:
    """One block as decoding and verification run it (appending to the cache: the path
    they take, e.g. the fused w4a8 sub-layers, which read-only blocks do not), then the cache
    cropped back to where it was."""
    length = first_position(pos)
    out = ex.run_layers(hidden, pos, 0, ex.num_layers, cache, plan)
    if head:
        ex.logits(out)
    cache.truncate(length)


@torch.inference_mode()
def measure_latency(executor: Executor, lengths: tuple[int, ...] = DEFAULT_LENGTHS,
                    repeats: int = 20,
                    verify_tokens: tuple[int, ...] = VERIFY_TOKENS) -> LatencyModel:
    """Measure the sub-layer latencies of ``executor``'s model on this machine.

    Every layer's attention alone, then every layer's MLP alone, runs on one token over a
    cache of each length in ``lengths`` filled with random keys and values (left as it was;
    :func:`measure_sublayers`); ``t_attn(n)`` is fitted by least squares; then the output
    head, the extra tokens of a verification and the DP's batched sub-layer calls
    (:func:`_batched_ms`).

    Args:
        verify_tokens: the forward sizes ``T`` of the verification table (increasing, from
            1; default :data:`VERIFY_TOKENS`). Its forwards are most of the measurement's
            time (nine tenths of it on SmolLM2-135M fp32, one thread); a shorter table is a
            coarser (linear between its points) but cheaper model.

    Raises:
        ValueError: fewer than two lengths, or ``verify_tokens`` not increasing from 1.
    """
    if len(lengths) < 2:
        raise ValueError("the attention fit needs at least two context lengths")
    if not verify_tokens or verify_tokens[0] != 1 or list(verify_tokens) != sorted(
            set(verify_tokens)):
        raise ValueError(f"verify_tokens must increase from 1, got {verify_tokens!r}")
    ex = executor
    attn_ms = []
    mlp_samples = []
    for n in _context_lengths(lengths, ex.max_positions):
        times = measure_sublayers(ex, n, repeats)
        attn_ms.append((n, times.attention_ms))
        mlp_samples.append(times.mlp_ms)
    hidden = torch.randn(1, 1, ex.config.hidden_size, dtype=ex.dtype, device=ex.device) * 0.1
    slope, base = _fit_line(attn_ms)
    slope, base = max(0.0, slope), max(1e-6, base)
    head_ms = _time_ms(lambda: ex.logits(hidden), repeats, ex.device)
    verify_points = _verify_points(ex, min(256, ex.max_positions - verify_tokens[-1]),
                                   max(3, repeats // 4), verify_tokens)
    call_ms, row_ms = _batched_ms(ex, min(256, ex.max_positions - 32), max(3, repeats // 4))
    return LatencyModel(ex.num_layers, slope, base, statistics.median(mlp_samples), head_ms,
                        verify_token_ms=(max(0.0, _fit_line(list(verify_points))[0])
                                         if len(verify_points) > 1 else 0.0),
                        verify_points=verify_points, batched_row_ms=row_ms,
                        batched_call_ms=call_ms, key=machine_key(ex))


@torch.inference_mode()
def measure_token_ms(executor: Executor, context_len: int, repeats: int = 10) -> float:
    """Median time of one decoding token through every layer and the output head over
    ``context_len`` cached (random) positions (the cache left as it was), ms."""
    ex = executor
    cache = _filled_cache(ex, context_len, range(ex.num_layers))
    hidden = torch.randn(1, 1, ex.config.hidden_size, dtype=ex.dtype, device=ex.device) * 0.1
    pos = position_block(context_len, 1, ex.device)
    return _time_ms(functools.partial(_step, ex, hidden, pos, cache, head=True), repeats,
                    ex.device)


def _filled_cache(ex: Executor, n: int, layers: range):
    cache = ex.new_cache(capacity=n + 64)
    shape = (1, ex.num_kv_heads, n, ex.head_dim)
    for layer in layers:
        cache.append(layer, torch.randn(shape, dtype=ex.dtype, device=ex.device),
                     torch.randn(shape, dtype=ex.dtype, device=ex.device), 0)
    return cache


def _verify_points(ex: Executor, n: int, repeats: int,
                   verify_tokens: tuple[int, ...] = VERIFY_TOKENS) -> tuple[tuple[int, float], ...]:
    """``((T, ms), ...)`` for ``T`` in ``verify_tokens`` (those the model's positions
    allow): the extra time (fastest of the repeats) of a full forward of ``T`` tokens over
    ``n`` cached positions over one token, made non-decreasing (a forward of more tokens never
    costs less; what is left is noise).

    The sizes are timed in rounds (each size once a round, ``repeats`` rounds), not one size
    after another: a burst of another process then slows one round of every size, which the
    minimum drops, instead of every repeat of the sizes timed during it (which priced
    verification far above its cost and kept n-gram drafting off)."""
    cache = _filled_cache(ex, n, range(ex.num_layers))
    sizes = [t for t in verify_tokens if n + t <= ex.max_positions]
    steps = [functools.partial(
        _step, ex, torch.randn(1, t, ex.config.hidden_size, dtype=ex.dtype, device=ex.device)
        * 0.1, position_block(n, t, ex.device), cache, head=True) for t in sizes]
    for step in steps:  # warm-up
        step()
    best = [math.inf] * len(steps)
    for _ in range(repeats):
        best = [min(b, _once_ms(step, ex.device)) for b, step in zip(best, steps)]
    points, base, floor = [], 0.0, 0.0
    for tokens, ms in zip(sizes, best):
        if tokens == 1:
            base = ms
        floor = max(floor, ms - base)
        points.append((tokens, floor))
    return tuple(points)


def _batched_ms(ex: Executor, n: int, repeats: int) -> tuple[float, float]:
    """``(call_ms, row_ms)``: one read-only ``free`` sub-layer call (attention and MLP
    averaged) on ``rows`` rows, as the DP runs them, costs ``call_ms + rows · row_ms``
    (fitted on 16 and 256 rows). Successive calls go to successive layers, as in the DP, so
    a small model's weights are not timed cache-hot."""
    cache = _filled_cache(ex, n, range(ex.num_layers))
    points = []
    for batch in (1, 16):
        rows = 16
        hidden = torch.randn(batch, rows, ex.config.hidden_size, dtype=ex.dtype,
                             device=ex.device) * 0.1
        pos = position_block(n - rows, rows, ex.device, batch)
        total = 0.0
        for skip_attention in (False, True):
            total += _time_ms(functools.partial(_sublayer_call, ex, hidden, pos, cache,
                                                itertools.count(), skip_attention), repeats,
                              ex.device)
        points.append((batch * rows, total / 2))
    (r0, t0), (r1, t1) = points
    row_ms = max(1e-6, (t1 - t0) / (r1 - r0))
    return max(0.0, t0 - r0 * row_ms), row_ms


def _sublayer_call(ex: Executor, hidden: torch.Tensor, pos: torch.Tensor, cache,
                   calls: Iterator[int], skip_attention: bool) -> None:
    """One read-only free call (``score_layers_free``) of the attention (or MLP) sub-layer of
    the next layer (``next(calls) mod L``: successive calls stream successive layers'
    weights)."""
    layer = next(calls) % ex.num_layers
    plan = (SkipPlan(skip_attention=frozenset({layer})) if skip_attention
            else SkipPlan(skip_mlp=frozenset({layer})))
    ex.score_layers_free(hidden, pos, layer, layer + 1, cache, plan)


def latency_path(executor: Executor, home: Path) -> Path:
    """``home/latency/<key>.json``: where :func:`cached_latency` keeps ``executor``'s model."""
    return home / "latency" / f"{machine_key(executor)}.json"


def cached_latency(executor: Executor, home: Path, remeasure: bool = False) -> LatencyModel:
    """The latency model of ``executor`` on this machine, measured once and kept in
    ``home/latency/<key>.json`` (a changed model, dtype, thread count or processor is a new
    key; a corrupt file is measured again). ``remeasure=True`` measures and replaces the file
    (for a model measured while the machine was busy: it steers ``auto`` and ``knapspec``
    for as long as it is kept)."""
    path = latency_path(executor, home)
    try:
        if not remeasure:
            return LatencyModel.from_json(path.read_text())
    except (OSError, ValueError, TypeError) as err:
        if path.exists():
            logger.warning("re-measuring latencies: %s is unreadable (%s)", path, err)
    model = measure_latency(executor)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(model.to_json())
    tmp.replace(path)
    return model
