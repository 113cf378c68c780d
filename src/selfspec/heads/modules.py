"""Exit heads: modules mapping the hidden state leaving a layer to next-token logits.

Two kinds (both satisfy the executor's ``Head`` signature
``head(hidden [B, T, H], vocab_rows=None) -> logits [B, T, V]`` and read the hidden state
*before* any final norm; each head carries the norm it needs):

- ``lightweight`` (AdaDecode §2.1): ``E⁽ⁱ⁾ = E*·T⁽ⁱ⁾`` with the model's frozen ``lm_head``
  weight ``E*`` ``[V, H]`` and a trainable ``T⁽ⁱ⁾`` ``[H, H]`` initialised to the identity, so
  ``logits = E* · T · norm(h)``, i.e. in row form ``F.linear(F.linear(norm(h), T), E*)``.
  ``norm`` is a frozen copy of the model's final norm: a trainable norm weight would be
  redundant (``T`` absorbs any per-channel scale, ``T·diag(w)``), and keeping it frozen makes
  the head at initialisation compute exactly the model's own final norm + ``lm_head``.
  One token at inference costs one ``H×H`` matmul plus the ``lm_head`` matmul, which reuses
  the executor's (oneDNN-packed) ``lm_head``: nothing of size ``V`` is stored per head.
- ``full`` (DSSD §3.2): a copy of the final norm (trainable) and its own ``[V, H]`` output
  matrix, initialised from a copy of ``lm_head`` (``init="lm_head"``) or at random
  (``init="random"``: norm weight 1, ``nn.Linear``'s default uniform init); DSSD §4.1
  compares the two.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.errors import InvalidArgumentError
from selfspec.models.architecture import FAMILIES, decoder_modules, describe

HEAD_KINDS = ("lightweight", "full")
FULL_INITS = ("lm_head", "random")


@dataclass(frozen=True)
class OutputLayer:
    """The model's own output layer, shared by every head of that model.

    Attributes:
        norm: the model's final norm module (``model.model.norm``), read-only here.
        weight: ``lm_head`` weight ``[V, H]`` (``E*``), never copied for lightweight heads.
        bias: ``lm_head`` bias ``[V]`` or ``None``.
        fast: ``x [..., H] -> logits [..., V]`` computing ``F.linear(x, weight, bias)`` with
            the executor's oneDNN-packed ``lm_head`` (bit-identical), or ``None``.
    """

    norm: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    fast: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Row subsets of lm_head already packed (reduced draft vocabularies), shared by every
    # lightweight head of the model: one [R, H] copy, not one per head.
    _row_projections: dict[bytes, Callable[[torch.Tensor], torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False)

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def project(self, x: torch.Tensor, vocab_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``lm_head`` without the norm: ``[..., H]`` → ``[..., V]`` (or ``[..., R]`` for
        ``vocab_rows`` ``[R]``). The packed kernel has no autograd, so it is used only when
        no gradient is being recorded."""
        weight, bias = self.weight, self.bias
        if vocab_rows is not None:
            weight = weight[vocab_rows]
            bias = None if bias is None else bias[vocab_rows]
        elif self.fast is not None and not torch.is_grad_enabled() and x.dtype == weight.dtype:
            return self.fast(x)
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(weight.dtype)  # e.g. fp32 trained heads scored against a bf16 lm_head
        return F.linear(x, weight, bias)


    def project_rows(self, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """``lm_head`` restricted to vocabulary ``rows`` ``[R]`` (no norm): ``[..., H]`` →
        ``[..., R]``, packed once per distinct ``rows``."""
        key = rows.cpu().numpy().tobytes()
        if key not in self._row_projections:
            from selfspec.executor.linear import Linear

            self._row_projections[key] = Linear.of_rows(self.weight, self.bias, rows)
        return self._row_projections[key]


def output_layer(source: object) -> OutputLayer:
    """The :class:`OutputLayer` of a ``SelfSpec`` engine, a ``LayerExecutor`` or an HF model.

    Raises:
        InvalidArgumentError: ``source`` is none of those.
    """
    executor = getattr(source, "executor", source)
    if (hasattr(executor, "lm_head") and hasattr(executor, "norm")
            and hasattr(executor, "run_layers")):
        # Sharing the executor's packed lm_head saves a [V, H] copy and runs on its faster
        # packed kernel.
        lm_head = executor.lm_head
        return OutputLayer(executor.norm, lm_head.weight, lm_head.bias, executor.project)
    model = source
    if hasattr(model, "lm_head") and hasattr(getattr(model, "model", None), "norm"):
        return OutputLayer(model.model.norm, model.lm_head.weight, model.lm_head.bias, None)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if hasattr(model, "lm_head") and model_type in FAMILIES:  # GPT-NeoX's own names
        norm = decoder_modules(model, describe(model.config)).norm
        return OutputLayer(norm, model.lm_head.weight, model.lm_head.bias, None)
    raise InvalidArgumentError(
        f"expected a SelfSpec engine, a LayerExecutor or a Hugging Face causal LM, got "
        f"{type(source).__name__}")


class ExitHead(nn.Module):
    """Base class: an exit head at ``layer`` (number of decoder layers run before it).

    Subclasses implement :meth:`forward` ``(hidden [B, T, H], vocab_rows=None) -> [B, T, V]``
    and :meth:`tensors` (what a head file stores).
    """

    kind: str = ""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = int(layer)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The head's own tensors by name (saved in head files; shared model weights excluded)."""
        raise NotImplementedError

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (as produced by :meth:`tensors`) into the head.

        Raises:
            InvalidArgumentError: a missing name or a shape mismatch.
        """
        own = self.tensors()
        for name, dst in own.items():
            src = tensors.get(name)
            if src is None or src.shape != dst.shape:
                got = None if src is None else tuple(src.shape)
                raise InvalidArgumentError(
                    f"{self.kind} head at layer {self.layer}: tensor {name!r} has shape {got}, "
                    f"expected {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(src)

    def prepare_inference(self) -> ExitHead:
        """Switch to inference: eval mode, no gradients (subclasses may pack weights)."""
        self.eval().requires_grad_(False)
        return self

    def bind(self, out: OutputLayer) -> ExitHead:
        """Use ``out`` as the shared output layer (lightweight heads; others own theirs)."""
        return self

    def restricted(self, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """This head scoring only vocabulary ``rows`` ``[R]``: ``hidden [B, T, H]`` →
        ``[B, T, R]``, with the ``[R, H]`` output rows copied once and packed (a reduced
        draft vocabulary, as in FR-Spec, Zhao et al. 2025: the output projection is the
        largest matrix a small model's draft reads)."""
        raise NotImplementedError


class LightweightHead(ExitHead):
    """AdaDecode's lightweight head ``E*·T`` (AdaDecode §2.1, "Lightweight LM head
    implementation"): frozen final-norm copy → trainable ``T`` ``[H, H]`` → shared ``lm_head``.

    Args:
        layer: exit layer in ``[1, L-1]``.
        out: the model's :class:`OutputLayer` (``E*`` is referenced, not copied).
        dtype: dtype of ``T`` and the norm copy (fp32 for training; the model's dtype to infer).
    """

    kind = "lightweight"

    def __init__(self, layer: int, out: OutputLayer, dtype: torch.dtype | None = None) -> None:
        super().__init__(layer)
        self.out = out
        dtype = dtype or out.weight.dtype
        self.norm = copy.deepcopy(out.norm).to(dtype).requires_grad_(False)
        size = out.hidden_size
        self.transform = nn.Parameter(torch.eye(size, dtype=dtype, device=out.weight.device))
        self._fast: Callable[[torch.Tensor], torch.Tensor] | None = None

    def transformed(self, hidden: torch.Tensor) -> torch.Tensor:
        """``T · norm(h)``: ``[B, T, H]`` → ``[B, T, H]`` (packed ``T`` when not training): the
        head's logits are ``lm_head`` of this."""
        if hidden.dtype != self.transform.dtype:
            hidden = hidden.to(self.transform.dtype)
        return self.transform_normed(self.norm(hidden))

    def transform_normed(self, normed: torch.Tensor) -> torch.Tensor:
        """``T · x`` for ``x`` already through the (frozen copy of the) final norm: ``[..., H]`` →
        ``[..., H]``. SpecEE's head lens reads it from the state its features normalise anyway."""
        if normed.dtype != self.transform.dtype:
            normed = normed.to(self.transform.dtype)
        if self._fast is not None and not torch.is_grad_enabled():
            return self._fast(normed)
        return F.linear(normed, self.transform)

    def forward(self, hidden: torch.Tensor, vocab_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, H]`` → logits ``[B, T, V]`` (``[B, T, R]`` with ``vocab_rows`` ``[R]``)."""
        return self.out.project(self.transformed(hidden), vocab_rows)

    def prepare_inference(self) -> LightweightHead:
        """Eval mode, no gradients, and ``T`` oneDNN-packed where that is exact and faster."""
        super().prepare_inference()
        from selfspec.executor.linear import Linear

        linear = Linear(self.transform.detach(), None)
        self._fast = linear if linear.packed is not None else None
        return self

    def bind(self, out: OutputLayer) -> LightweightHead:
        self.out = out
        return self

    def restricted(self, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        project = self.out.project_rows(rows)
        return lambda hidden: project(self.transformed(hidden))

    def tensors(self) -> dict[str, torch.Tensor]:
        own = {"transform": self.transform}
        own.update({f"norm.{k}": v for k, v in self.norm.state_dict(keep_vars=True).items()})
        return own


class FullHead(ExitHead):
    """DSSD's exit head, "identical to the final classification head" (DSSD §3.2): a norm
    and a ``[V, H]`` output matrix of its own.

    Args:
        layer: exit layer in ``[1, L-1]``.
        out: the model's :class:`OutputLayer` (copied for ``init="lm_head"``).
        init: ``"lm_head"`` (copy the final norm and ``lm_head``) or ``"random"``.
        dtype: parameter dtype.
        seed: seed of the random initialisation.

    Raises:
        InvalidArgumentError: unknown ``init``.
    """

    kind = "full"

    def __init__(self, layer: int, out: OutputLayer, init: str = "lm_head",
                 dtype: torch.dtype | None = None, seed: int = 0) -> None:
        super().__init__(layer)
        if init not in FULL_INITS:
            raise InvalidArgumentError(f"full-head init must be one of {FULL_INITS}, got {init!r}")
        dtype = dtype or out.weight.dtype
        device = out.weight.device
        self.norm = copy.deepcopy(out.norm).to(dtype).requires_grad_(True)
        if init == "lm_head":
            weight = out.weight.detach().to(dtype).clone()
            bias = None if out.bias is None else out.bias.detach().to(dtype).clone()
        else:
            generator = torch.Generator().manual_seed(seed)
            bound = out.hidden_size ** -0.5  # nn.Linear's default: U(-1/sqrt(in), 1/sqrt(in))
            weight = (torch.rand(out.weight.shape, generator=generator) * 2 - 1) * bound
            weight = weight.to(dtype=dtype, device=device)
            bias = None if out.bias is None else torch.zeros_like(out.bias, dtype=dtype)
            with torch.no_grad():
                for name, p in self.norm.named_parameters():
                    p.fill_(1.0 if name == "weight" else 0.0)
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self._fast: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _normed(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype != self.weight.dtype:
            hidden = hidden.to(self.weight.dtype)
        return self.norm(hidden)

    def forward(self, hidden: torch.Tensor, vocab_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, H]`` → logits ``[B, T, V]`` (``[B, T, R]`` with ``vocab_rows`` ``[R]``)."""
        x = self._normed(hidden)
        if vocab_rows is not None:
            bias = None if self.bias is None else self.bias[vocab_rows]
            return F.linear(x, self.weight[vocab_rows], bias)
        if self._fast is not None and not torch.is_grad_enabled() and x.dtype == self.weight.dtype:
            return self._fast(x)
        return F.linear(x, self.weight, self.bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        own = {"weight": self.weight}
        if self.bias is not None:
            own["bias"] = self.bias
        own.update({f"norm.{k}": v for k, v in self.norm.state_dict(keep_vars=True).items()})
        return own

    def restricted(self, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        from selfspec.executor.linear import Linear

        project = Linear.of_rows(self.weight, self.bias, rows)
        return lambda hidden: project(self._normed(hidden))

    def prepare_inference(self) -> FullHead:
        """Eval mode, no gradients, and a oneDNN-packed copy of the weight where that is exact
        and faster (bf16/fp16 on CPU; see :mod:`selfspec.executor.linear`)."""
        super().prepare_inference()
        from selfspec.executor.linear import Linear

        linear = Linear(self.weight.detach(), None if self.bias is None else self.bias.detach())
        self._fast = linear if linear.packed is not None else None
        return self


def make_head(kind: str, layer: int, out: OutputLayer, *, init: str = "lm_head",
              dtype: torch.dtype | None = None, seed: int = 0) -> ExitHead:
    """A fresh head of ``kind`` (``"lightweight"`` or ``"full"``) at ``layer``.

    ``init`` applies to full heads only (lightweight ``T`` always starts at the identity,
    as in AdaDecode).

    Raises:
        InvalidArgumentError: unknown ``kind`` or ``init``.
    """
    if kind == "lightweight":
        return LightweightHead(layer, out, dtype)
    if kind == "full":
        return FullHead(layer, out, init=init, dtype=dtype, seed=seed)
    raise InvalidArgumentError(f"head kind must be one of {HEAD_KINDS}, got {kind!r}")
