"""SpecEE's per-layer exit decision as one compiled call (``executor/kernels/specee_predict.cpp``).

At a feature layer :class:`~selfspec.decoding.specee.step.PredictorScan` needs the model's final
norm of the state, the optional head lens, the candidates' logits, local probabilities and
their change (:func:`~selfspec.heads.predictor.candidate_features`) and, where a predictor
runs, its MLP (:meth:`~selfspec.heads.predictor.ExitPredictors.prob`). In torch that is ~30
small operations whose dispatch costs far more than their arithmetic, a noticeable share of
verified SpecEE's time. The kernel does all of it in one ``ctypes`` call on bf16 models.

Numbers: the kernel rounds where torch rounds (the norm and the bf16 products to bf16) and
sums in fp32 in its own order, so its features and predictor outputs agree with the torch
path to fp32 rounding, not bit for bit; a threshold decision can differ only when a
predictor's output is within that rounding of the threshold. Verified SpecEE stays lossless
either way (verification decides), and the predictors were trained on torch's features.

:func:`layer_decision` and :func:`candidate_kernel` check the kernels against the torch path
on the model's own weights before it is used and returns ``None`` (torch path) where it cannot
run: not bf16, not an x86 CPU with AVX2, no C++ compiler, a final norm that is not the plain
RMSNorm, or a failed check.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor, native
from selfspec.heads.modules import LightweightHead
from selfspec.heads.predictor import (
    STATE_SCALE,
    CandidateScores,
    ExitPredictors,
    candidate_features,
)

logger = logging.getLogger(__name__)

SOURCE = "specee_predict.cpp"
_CHECK_TOL = 2e-2  # features and logits: bf16 rounding of a product may land one step apart


class _PredictArgs(ctypes.Structure):
    """Mirror of ``PredictArgs`` in ``specee_predict.cpp``."""

    _fields_ = [("hidden", ctypes.c_void_p), ("norm_weight", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("H", ctypes.c_int64), ("lens", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("k", ctypes.c_int64),
                ("previous", ctypes.c_void_p), ("features", ctypes.c_void_p),
                ("fc1", ctypes.c_void_p), ("b1", ctypes.c_void_p), ("w2", ctypes.c_void_p),
                ("b2", ctypes.c_float), ("mean", ctypes.c_void_p), ("std", ctypes.c_void_p),
                ("hidden_units", ctypes.c_int64), ("state_dim", ctypes.c_int64),
                ("state_scale", ctypes.c_float), ("logit", ctypes.c_void_p)]


@cache
def _library() -> native.Kernel:
    return native.load(SOURCE, "selfspec_specee_predict", [ctypes.c_void_p], lambda fn: "")


def kernel_unavailable_reason() -> str:
    """Why the compiled kernel cannot run here (``""`` when it can)."""
    return _library().reason


@dataclass(frozen=True)
class LayerDecision:
    """What one feature layer gives the scan.

    Attributes:
        scores: the candidates' :class:`~selfspec.heads.predictor.CandidateScores`.
        prob: the layer's predictor output in [0, 1], or ``None`` where none ran.
    """

    scores: CandidateScores
    prob: float | None


class TorchLayerDecision:
    """The per-layer exit decision in torch operations (the reference; any dtype and device).

    Args:
        executor: the model's executor (its final norm).
        predictors: the per-layer predictors.
        lenses: ``{ℓ: lens(normed [1, 1, H]) -> [1, 1, H]}``, the head lens at ``ℓ``.
    """

    def __init__(self, executor: LayerExecutor, predictors: ExitPredictors,
                 lenses: Mapping[int, object]) -> None:
        self.executor = executor
        self.predictors = predictors
        self.lenses = dict(lenses)

    def __call__(self, layer: int, hidden: torch.Tensor, rows: torch.Tensor,
                 bias: torch.Tensor | None, previous: torch.Tensor | None,
                 predict: bool) -> LayerDecision:
        """Features at ``layer`` from ``hidden`` ``[1, 1, H]`` for candidates ``rows``
        ``[k, H]`` (``bias`` ``[k]``), against ``previous`` ``[k]`` probabilities; the
        predictor too when ``predict``."""
        normed = self.executor.final_norm(hidden)
        lens = self.lenses.get(layer)
        read = normed if lens is None else lens(normed)
        normed, read = normed[0, 0], read[0, 0]
        scores = candidate_features(read, rows, bias, previous)
        prob = (float(self.predictors.prob(layer, scores.features, normed))
                if predict else None)
        return LayerDecision(scores, prob)


class KernelLayerDecision:
    """The per-layer exit decision in one call of the compiled kernel (module doc).

    Build it with :func:`layer_decision`, which checks it first.

    Args:
        executor: the model's executor (bf16; its final norm an RMSNorm with a weight).
        predictors: the per-layer predictors (fp32).
        transforms: ``{ℓ: T}``, ``[H, H]`` bf16, the head lens at ``ℓ``.

    Raises:
        RuntimeError: the kernel is not available here.
    """

    def __init__(self, executor: LayerExecutor, predictors: ExitPredictors,
                 transforms: Mapping[int, torch.Tensor]) -> None:
        lib = _library()
        if lib.call is None:
            raise RuntimeError(f"the SpecEE kernel is not available: {lib.reason}")
        self._fn = lib.call
        self._norm_weight = executor.norm.weight.detach().contiguous()
        eps = _norm_eps(executor.norm)
        k = predictors.num_candidates
        # Two output buffers, alternating: one layer's probabilities are the next one's
        # ``previous`` while the next writes its own.
        self._out = [torch.empty(3 * k), torch.empty(3 * k)]
        self._scores = [CandidateScores(out[:k], out[k:2 * k], out) for out in self._out]
        self._turn = 0
        self._logit = ctypes.c_float()
        self._keep = [self._norm_weight]
        # Per layer: its arguments with the predictor and without (features only).
        self._args: dict[int, tuple[_PredictArgs, _PredictArgs]] = {}
        fc1, b1, w2 = (predictors.fc1_weight.detach(), predictors.fc1_bias.detach(),
                       predictors.fc2_weight.detach())
        for layer in predictors.layers:
            i = predictors.index(layer)
            a = _PredictArgs()
            a.norm_weight = self._norm_weight.data_ptr()
            a.eps = eps
            a.H = self._norm_weight.shape[0]
            a.k = k
            if layer in transforms:
                t = transforms[layer].detach().contiguous()
                self._keep.append(t)
                a.lens = t.data_ptr()
            features_only = _PredictArgs()
            ctypes.pointer(features_only)[0] = a
            tensors = [fc1[i].to(torch.bfloat16).contiguous(), b1[i].contiguous(),
                       w2[i].contiguous()]
            a.fc1, a.b1, a.w2 = (t.data_ptr() for t in tensors)
            a.b2 = float(predictors.fc2_bias[i])
            if predictors.state_dim:
                stats = [predictors.feature_mean[i].detach().contiguous(),
                         predictors.feature_std[i].detach().contiguous()]
                a.mean, a.std = (t.data_ptr() for t in stats)
                tensors += stats
            self._keep += tensors
            a.hidden_units = predictors.hidden
            a.state_dim = predictors.state_dim
            a.state_scale = STATE_SCALE
            a.logit = ctypes.addressof(self._logit)
            self._args[layer] = (a, features_only)

    def __call__(self, layer: int, hidden: torch.Tensor, rows: torch.Tensor,
                 bias: torch.Tensor | None, previous: torch.Tensor | None,
                 predict: bool) -> LayerDecision:
        """As :meth:`TorchLayerDecision.__call__`; ``hidden`` bf16 with a contiguous last
        dimension, ``rows`` bf16 contiguous. The scores are views of a buffer that the call
        after next overwrites (clone what is kept longer)."""
        a = self._args[layer][0 if predict else 1]
        turn = self._turn
        self._turn ^= 1
        if hidden.dtype != torch.bfloat16 or hidden.stride(-1) != 1:
            hidden = hidden.to(torch.bfloat16).contiguous()
        a.hidden = hidden.data_ptr()
        a.rows = rows.data_ptr()
        a.bias = None if bias is None else bias.data_ptr()
        a.previous = None if previous is None else previous.data_ptr()
        scores = self._scores[turn]
        a.features = scores.features.data_ptr()
        self._fn(ctypes.byref(a))
        if not predict:
            return LayerDecision(scores, None)
        z = self._logit.value
        return LayerDecision(scores, 1.0 / (1.0 + math.exp(-z)) if z > -80 else 0.0)


KERNEL_CHOICES = ("auto", "kernel", "torch")


def layer_decision(executor: LayerExecutor, predictors: ExitPredictors,
                   lenses: Mapping[int, LightweightHead], kernel: str = "auto"
                   ) -> TorchLayerDecision | KernelLayerDecision:
    """The per-layer exit decision for :class:`~selfspec.decoding.specee.step.PredictorScan`.

    Args:
        executor: the model's executor.
        predictors: the per-layer predictors.
        lenses: ``{ℓ: head}``, the lightweight exit head whose lens the predictors read at
            ``ℓ`` (the card's ``lens_layers``).
        kernel: ``"auto"``: the compiled kernel where it runs and agrees with the torch path
            on this model (:func:`kernel_check`), else torch; ``"kernel"``: the kernel or an
            error; ``"torch"``: torch operations.

    Raises:
        InvalidArgumentError: an unknown ``kernel``, or ``"kernel"`` where it cannot run
            (the message says why).
    """
    _check_choice(kernel)
    torch_path = TorchLayerDecision(
        executor, predictors, {layer: head.transform_normed for layer, head in lenses.items()}
    )
    if kernel == "torch":
        return torch_path

    def build() -> tuple[KernelLayerDecision, str]:
        fused = KernelLayerDecision(executor, predictors,
                                    {layer: head.transform for layer, head in lenses.items()})
        return fused, kernel_check(torch_path, fused, executor, predictors)

    reason = kernel_unavailable_reason() or _unsupported(executor, lenses)
    return _fused_or_none(kernel, "predictor", reason, build) or torch_path


def _check_choice(kernel: str) -> None:
    if kernel not in KERNEL_CHOICES:
        raise InvalidArgumentError(
            f"specee: kernel must be one of {', '.join(KERNEL_CHOICES)}, got {kernel!r}")


def _fused_or_none(kernel: str, what: str, reason: str,
                   build: Callable[[], tuple[object, str]]) -> object | None:
    """``build()``'s kernel where ``reason`` is empty and its check (``build``'s second
    value) passes; else ``None`` (torch), logged, or with ``kernel="kernel"`` an
    :class:`InvalidArgumentError` naming the reason."""
    fused = None
    if not reason:
        fused, reason = build()
    if not reason:
        return fused
    if kernel == "kernel":
        raise InvalidArgumentError(f"specee: the {what} kernel cannot run here: {reason}; "
                                   f"use kernel=auto or kernel=torch")
    logger.info("SpecEE's %s runs in torch: the kernel %s", what, reason)
    return None


def _norm_eps(norm: torch.nn.Module) -> float | None:
    """An RMSNorm module's epsilon (HF's ``variance_epsilon`` or torch's ``eps``), or ``None``."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return None if eps is None else float(eps)


def _unsupported(executor: LayerExecutor, lenses: Mapping[int, LightweightHead]) -> str:
    """Why the kernel does not apply to this model (``""`` when it does)."""
    norm = executor.norm
    weight = getattr(norm, "weight", None)
    if executor.device.type != "cpu":
        return f"runs on the CPU (the model is on {executor.device.type})"
    if (weight is None or weight.dtype != torch.bfloat16
            or executor.lm_head.weight.dtype != torch.bfloat16):
        return "needs a bf16 model"
    if _norm_eps(norm) is None or getattr(norm, "bias", None) is not None:
        return f"knows RMSNorm, not {type(norm).__name__}"  # GPT-NeoX's LayerNorm has a bias
    if executor.architecture.norm_kind == "rms_offset":
        return "computes w · x̂ norms, not Gemma's x̂ · (1 + w)"
    if any(head.transform.dtype != torch.bfloat16 for head in lenses.values()):
        return "needs bf16 head lenses"
    return ""


def kernel_check(reference: TorchLayerDecision, fused: KernelLayerDecision,
                 executor: LayerExecutor, predictors: ExitPredictors) -> str:
    """Compare the kernel with the torch path on this model's weights: a random state at
    every predictor layer (lens layers included), real ``lm_head`` rows, with and without
    ``previous``; ``""`` when features and predictor outputs agree within bf16 rounding,
    else what differs (a norm the kernel does not compute, such as Gemma's ``1 + w``)."""
    gen = torch.Generator().manual_seed(0)
    k = predictors.num_candidates
    hidden_size = executor.lm_head.weight.shape[1]
    rows = executor.lm_head.weight[torch.randperm(executor.vocab_size, generator=gen)[:k]]
    rows = rows.detach().contiguous()
    bias = executor.lm_head.bias
    bias = None if bias is None else bias.detach()[:k].float().contiguous()
    previous = None
    for layer in predictors.layers:
        hidden = (torch.randn(1, 1, hidden_size, generator=gen) * 4).to(torch.bfloat16)
        want = reference(layer, hidden, rows, bias, previous, True)
        got = fused(layer, hidden, rows, bias, previous, True)
        if not torch.allclose(got.scores.features, want.scores.features,
                              rtol=_CHECK_TOL, atol=_CHECK_TOL):
            err = (got.scores.features - want.scores.features).abs().max().item()
            return f"features differ from torch's by {err:.3g} at layer {layer}"
        if abs(got.prob - want.prob) > _CHECK_TOL:
            return (f"predictor output differs from torch's by {abs(got.prob - want.prob):.3g} "
                    f"at layer {layer}")
        previous = want.scores.probs.clone()
    return ""


class _CandidateArgs(ctypes.Structure):
    """Mirror of ``CandidateArgs`` in ``specee_predict.cpp``."""

    _fields_ = [("previous", ctypes.c_void_p), ("embedding", ctypes.c_void_p),
                ("H", ctypes.c_int64), ("drafter_eps", ctypes.c_float), ("fc", ctypes.c_void_p),
                ("fc_bias", ctypes.c_void_p), ("norm_weight", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("rows", ctypes.c_void_p), ("row_bias", ctypes.c_void_p),
                ("R", ctypes.c_int64), ("k", ctypes.c_int64), ("top", ctypes.c_void_p)]


class CandidateKernel:
    """The feature drafter's top-``k`` for one token in one call of the compiled kernel:
    :class:`~selfspec.heads.drafter.FeatureDrafter`, the final norm, the draft vocabulary's
    ``lm_head`` rows and their top ``k`` (:class:`~selfspec.decoding.specee.step.DrafterCandidates`'
    work; ~20 torch operations otherwise). Build it with :func:`candidate_kernel`.

    Args:
        executor: the model's executor (bf16).
        drafter: the drafter, bf16 (after ``prepare_inference``).
        rows: ``[R]`` int64 vocabulary ids it scores (the draft vocabulary), or ``None``
            (all ``V``).
        k: number of candidates.

    Raises:
        RuntimeError: the kernel is not available here.
    """

    def __init__(self, executor: LayerExecutor, drafter: torch.nn.Module,
                 rows: torch.Tensor | None, k: int) -> None:
        lib = _library()
        if lib.call is None:
            raise RuntimeError(f"the SpecEE kernel is not available: {lib.reason}")
        fn = lib.library.selfspec_specee_candidates
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p]
        self._fn = fn
        weight, bias = executor.lm_head.weight.detach(), executor.lm_head.bias
        if rows is not None:
            weight = weight[rows].contiguous()
            bias = None if bias is None else bias.detach()[rows]
        norm = executor.norm
        self._keep = [weight, norm.weight.detach().contiguous(),
                      drafter.fc_weight.detach().contiguous(),
                      drafter.fc_bias.detach().float().contiguous()]
        if bias is not None:
            self._keep.append(bias.float().contiguous())
        self.top = torch.empty(k, dtype=torch.int64)
        a = self._args = _CandidateArgs()
        a.H = weight.shape[1]
        a.drafter_eps = float(torch.finfo(torch.float32).eps)  # F.rms_norm's default
        a.fc, a.fc_bias = self._keep[2].data_ptr(), self._keep[3].data_ptr()
        a.norm_weight = self._keep[1].data_ptr()
        a.eps = _norm_eps(norm)
        a.rows = weight.data_ptr()
        a.row_bias = None if bias is None else self._keep[4].data_ptr()
        a.R = weight.shape[0]
        a.k = k
        a.top = self.top.data_ptr()

    def __call__(self, previous: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """``[k]`` int64 indices into the scored rows, highest logit first, for the previous
        position's state and the current token's embedding (each ``[1, 1, H]`` bf16). A
        buffer the next call overwrites."""
        if previous.dtype != torch.bfloat16 or not previous.is_contiguous():
            previous = previous.to(torch.bfloat16).contiguous()
        a = self._args
        a.previous = previous.data_ptr()
        a.embedding = embedding.data_ptr()
        self._fn(ctypes.byref(a))
        return self.top


def candidate_kernel(executor: LayerExecutor, drafter: torch.nn.Module,
                     output: object, rows: torch.Tensor | None, k: int,
                     kernel: str = "auto") -> CandidateKernel | None:
    """The compiled drafter candidates for
    :class:`~selfspec.decoding.specee.step.DrafterCandidates`,
    or ``None`` (torch operations): as :func:`layer_decision`'s ``kernel``.

    Args:
        executor, drafter, rows, k: see :class:`CandidateKernel`.
        output: the torch path's ``output(hidden [1, 1, H]) -> logits [1, 1, R]`` (checked
            against).
        kernel: ``"auto"``, ``"kernel"`` or ``"torch"``.

    Raises:
        InvalidArgumentError: an unknown ``kernel``, or ``"kernel"`` where it cannot run.
    """
    _check_choice(kernel)
    if kernel == "torch":
        return None

    def build() -> tuple[CandidateKernel, str]:
        fused = CandidateKernel(executor, drafter, rows, k)
        return fused, _check_candidates(fused, executor, drafter, output)

    reason = kernel_unavailable_reason() or _unsupported(executor, {})
    if not reason and drafter.fc_weight.dtype != torch.bfloat16:
        reason = "needs a bf16 drafter"
    return _fused_or_none(kernel, "candidate", reason, build)


def _check_candidates(fused: CandidateKernel, executor: LayerExecutor,
                      drafter: torch.nn.Module, output: object) -> str:
    """``""`` when the kernel's top ``k`` scores equal torch's top ``k`` logits (within bf16
    rounding: ties may order differently) on random states and real embeddings."""
    gen = torch.Generator().manual_seed(1)
    hidden_size = executor.lm_head.weight.shape[1]
    k = fused.top.numel()
    for token in torch.randint(0, executor.vocab_size, (3,), generator=gen).tolist():
        previous = (torch.randn(1, 1, hidden_size, generator=gen) * 4).to(torch.bfloat16)
        embedding = executor.embed(torch.tensor([[token]]))
        logits = output(drafter(previous, embedding).to(previous.dtype))[0, -1].float()
        want = torch.topk(logits, k).values
        got = logits[fused(previous, embedding)]
        if not torch.allclose(got, want, rtol=_CHECK_TOL, atol=_CHECK_TOL):
            return (f"top-{k} logits {got.tolist()} differ from torch's {want.tolist()}")
    return ""
