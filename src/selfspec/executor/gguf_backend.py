"""The ``gguf`` matrix backend: every projection and ``lm_head`` on the GGUF file's own blocks.

``--dtype gguf`` (``decode_kernel="gguf"``) runs the model with the weights as published:
:func:`gguf_copies` pairs each of the executor's matrices with the blocks
:func:`selfspec.models.gguf_weights.read_gguf_weights` read for it, as a
:class:`~selfspec.executor.gguf_rows.GgufMatrix` (q/k/v and gate/up as segments of one
product, each of its own block type), and :class:`GgufRows` serves them through the
backend seam (:class:`~selfspec.executor.backends.MatrixBackend`). Decoding, verification and
prefill all run on the blocks, activations quantized per block as llama.cpp quantizes them, and
each row of a call is computed as it would be alone, so a verification block equals
one-token decoding bit for bit and every lossless method stays exact relative to the GGUF
model. Embeddings, norms and attention keep the model's dtype (bf16 hidden states and KV);
decoding and verification blocks run on the fused sub-layers
(:mod:`selfspec.executor.fused_layers`, ``selfspec_gguf_attention`` / ``_mlp``), fp32 between
the products.

Kernel ``"gguf+dense"`` (:class:`GgufRows` with ``prefill="dense"``) keeps decoding and
verification on the blocks but runs prefill, and every other block that need not match
one-token decoding (:meth:`~selfspec.executor.executor.LayerExecutor.is_free_block`), on the
dense weights in the bulk format (oneDNN's AMX bf16 kernel where the CPU has one): the dense
weights are the blocks as transformers de-quantized them, rounded to the model's dtype, so
the prompt's KV then differs from the blocks' in the last bits (as bf16 differs from the
blocks' own products). Every lossless method stays exact relative to it (all share one
prefill); with AMX a long prompt fills several times faster than on the blocks. Where bf16
is emulated the dense prefill is slower than the blocks'.

A matrix of the model with no blocks is an error at attach time, never a silent fallback to
the dense weights (:func:`gguf_copies`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from selfspec.errors import UnsupportedArchitectureError

if TYPE_CHECKING:
    from selfspec.executor.gguf_rows import GgufMatrix
    from selfspec.executor.linear import Linear
    from selfspec.executor.weights import LayerWeights
    from selfspec.models.gguf_weights import GgufTensor, GgufWeights


class GgufRows:
    """Decoding, verification and bulk products of each matrix on its GGUF blocks.

    Args:
        copies: the :class:`GgufMatrix` of each of the executor's matrices, keyed by its dense
            weight's ``data_ptr()`` (:func:`gguf_copies`).
        prefill: ``"blocks"``: bulk calls (prefill) run on the blocks too, as in llama.cpp;
            ``"dense"``: they stay on the dense weights (:class:`~selfspec.executor.linear.Linear`
            routes them there), kernel ``"gguf+dense"``.

    Attributes:
        serves_bulk: whether bulk calls come to :meth:`bulk` (``prefill == "blocks"``).

    Raises:
        ValueError: ``prefill`` is neither.
    """

    def __init__(self, copies: Mapping[int, GgufMatrix], prefill: str = "blocks") -> None:
        if prefill not in ("blocks", "dense"):
            raise ValueError(f"prefill must be 'blocks' or 'dense', got {prefill!r}")
        self._copies = dict(copies)
        self.prefill = prefill
        self.serves_bulk = prefill == "blocks"

    def prepack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> GgufMatrix | None:
        """The blocks of ``weight`` (one of the model's matrices), or ``None`` for a matrix
        that is not the model's (a head, a reduced-vocabulary ``lm_head`` for drafting: it
        keeps its own product)."""
        return self._copies.get(weight.data_ptr())

    def __call__(self, x: torch.Tensor, packed: GgufMatrix) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in ``x``'s dtype, each row as computed alone."""
        return packed(x)

    def bulk(self, x: torch.Tensor, packed: GgufMatrix) -> torch.Tensor:
        """The same product (bulk and decoding rows agree bit for bit)."""
        return packed(x)

    def decode_bytes(self, packed: GgufMatrix, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> int:
        """Bytes of blocks (and bias) one call reads."""
        return packed.nbytes


def _segments(tensors: Sequence[GgufTensor]) -> list[Any]:
    from selfspec.executor.gguf_rows import GgufSegment

    return [GgufSegment(t.type, t.data) for t in tensors]


def _bias(own: torch.Tensor | None, lin: Linear) -> torch.Tensor | None:
    """The GGUF's fp32 bias where it has one, else the dense matrix's (as fp32)."""
    if own is not None:
        return own
    return None if lin.bias is None else lin.bias.detach().float().cpu()


def gguf_copies(layers: Sequence[LayerWeights], lm_head: Linear,
                weights: GgufWeights) -> dict[int, GgufMatrix]:
    """Each of the executor's matrices (``layers``' four, ``lm_head``) paired with its blocks.

    Returns:
        ``{dense weight data_ptr: GgufMatrix}`` for :class:`GgufRows`.

    Raises:
        UnsupportedArchitectureError: the GGUF has another number of layers, or a matrix's
            shape differs from its blocks'.
        InvalidArgumentError: a block type the kernels do not take (the message names the
            tensor and its type).
    """
    from selfspec.errors import InvalidArgumentError
    from selfspec.executor.gguf_rows import GgufMatrix

    if len(layers) != len(weights.layers):
        raise UnsupportedArchitectureError(
            f"{weights.path.name} has {len(weights.layers)} layers, the model {len(layers)}")
    copies: dict[int, GgufMatrix] = {}

    def pair(lin: Linear, tensors: Sequence[GgufTensor], bias: torch.Tensor | None) -> None:
        rows = sum(t.rows for t in tensors)
        if (rows, tensors[0].in_features) != tuple(lin.weight.shape):
            raise UnsupportedArchitectureError(
                f"{weights.path.name}: {', '.join(t.name for t in tensors)} hold a "
                f"[{rows}, {tensors[0].in_features}] matrix, the model's is "
                f"{list(lin.weight.shape)}")
        try:
            matrix = GgufMatrix(_segments(tensors), tensors[0].in_features, bias=bias)
        except InvalidArgumentError as err:
            names = ", ".join(f"{t.name} ({t.type.name})" for t in tensors)
            raise type(err)(f"{weights.path.name}: {names}: {err}") from err
        copies[lin.weight.data_ptr()] = matrix

    for w, g in zip(layers, weights.layers):
        pair(w.qkv, g.qkv, _bias(g.qkv_bias, w.qkv))
        pair(w.o, (g.o,), _bias(None, w.o))
        pair(w.gate_up, g.gate_up, _bias(None, w.gate_up))
        pair(w.down, (g.down,), _bias(None, w.down))
    pair(lm_head, (weights.output,), _bias(None, lm_head))
    return copies
