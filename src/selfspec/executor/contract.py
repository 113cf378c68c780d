"""The executor contract in code: every public entry point of
:class:`selfspec.executor.executor.LayerExecutor`, as a :class:`typing.Protocol`
(docs/design.md "Executor contract" is its prose; ``tests/executor/test_backends.py`` checks that
the
class, this protocol and that section name the same entry points).

Modules the executor itself imports (:mod:`selfspec.executor.cost_model`) name their executor
argument with :class:`Executor`, so they need not import the executor (no import cycle).
Shapes: ``B`` batch, ``T`` new tokens, ``N`` packed rows, ``H`` hidden size, ``V`` vocabulary,
``L`` decoder layers; positions are int64 absolute token positions; byte counts are bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from selfspec.executor.backends import MatrixBackend
    from selfspec.executor.cache import KVCache
    from selfspec.executor.cpu import ComputeFormats
    from selfspec.executor.fp16_rows import Fp16Rows
    from selfspec.executor.fused_layers import FusedLayers
    from selfspec.executor.linear import PackedRowLimits
    from selfspec.executor.plan import Head, Observer, SkipPlan
    from selfspec.executor.quant import FormatTiming
    from selfspec.executor.rope import RopeTable
    from selfspec.executor.weights import LayerWeights
    from selfspec.models.architecture import Architecture


class Executor(Protocol):
    """What :class:`~selfspec.executor.executor.LayerExecutor` offers (see its docstrings)."""

    # --- the model and its geometry
    model: torch.nn.Module               # the HF *ForCausalLM
    config: Any                          # its config
    architecture: Architecture           # the features its layers compute (models/architecture)
    name: str                            # registry name, directory or hub id
    layers: list[torch.nn.Module]        # the HF decoder layers
    num_layers: int                      # L
    num_heads: int                       # Hq
    num_kv_heads: int                    # Hkv
    head_dim: int                        # hd
    scaling: float                       # the attention softmax scale
    vocab_size: int                      # V
    max_positions: int                   # config.max_position_embeddings
    embed_tokens: torch.nn.Module        # [B, T] → [B, T, H]
    norm: torch.nn.Module                # the final norm
    rotary_emb: torch.nn.Module          # the model's rotary module
    lm_head: torch.nn.Linear             # [V, H] (training and vocab_rows read it)
    # --- where and how it computes
    device: torch.device                 # of the weights: backends are chosen for it
    dtype: torch.dtype                   # weights, KV cache and hidden states
    row_attention_max: int               # longest block attended one token per call
    prefill_chunk: int                   # prefill() runs fixed chunks of this many positions
    row_limits: PackedRowLimits          # the oneDNN packed kernel's row-consistency table
    formats: ComputeFormats              # bulk format and decoding kernel
    layer_weights: list[LayerWeights]    # per layer: norms + qkv, o, gate_up, down
    output_weights: Any                  # lm_head as multiplied ([..., H] → [..., V])
    draft_weights: str | None            # a draft view's weight format, else None
    gguf_weights: Any                    # the GGUF blocks of decode kernel "gguf", else None
    rope: RopeTable                      # cos/sin tables
    layer_ropes: list[RopeTable]         # per layer, its table (Gemma 3: by layer type)
    graphs: Any                          # CudaGraphRunner serving forward(), or None

    # --- formats, kernels, views
    def set_bulk(self, bulk: str = "auto", rows: str | None = None) -> ComputeFormats:
        """Choose the bulk format (and the decoding kernel); return the formats."""
        ...

    def set_decode_kernel(self, rows: str) -> str:
        """Switch the decoding kernel; return the previous request."""
        ...

    @property
    def backend(self) -> MatrixBackend | None:
        """The decoding products' backend, ``None`` = the weights' own product."""
        ...

    @property
    def fp16_rows(self) -> Fp16Rows | None:
        """The FBGEMM fp16 backend in use, or ``None``."""
        ...

    def draft_view(self, fmt: str) -> Executor:
        """This executor on quantized copies of its matrices (drafting only)."""
        ...

    def fastest_draft_format(self) -> FormatTiming:
        """The draft weight format measured fastest here (once)."""
        ...

    @property
    def measured_draft_format(self) -> FormatTiming | None:
        """What :meth:`fastest_draft_format` measured, if anything asked."""
        ...

    def fused_layers(self) -> FusedLayers | None:
        """The layers on fused sub-layer kernels, where they take them."""
        ...

    # --- byte accounting (selfspec.executor.cost_model)
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decoding token's full forward reads."""
        ...

    def decode_layer_bytes(self, layer: int = 0) -> int:
        """Bytes of weights one decoder layer reads per decoding call."""
        ...

    @property
    def output_decode_bytes(self) -> int:
        """Bytes of ``lm_head`` weights one decoding call reads."""
        ...

    # --- cache and primitives
    def new_cache(self, batch_size: int = 1, capacity: int = 256) -> KVCache:
        """An empty KV cache for ``batch_size`` sequences."""
        ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` → ``[B, T, H]``."""
        ...

    def embed_token(self, token_id: int) -> torch.Tensor:
        """One token's embedding ``[1, 1, H]``."""
        ...

    def is_free_block(self, pos0: int, num_new: int, batch: int = 1) -> bool:
        """Whether a block need not match one-token decoding bit for bit."""
        ...

    def is_bulk(self, pos0: int, num_new: int, batch: int = 1) -> bool:
        """Whether a block's products run in the bulk format."""
        ...

    # --- the ways to run layers
    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                   cache: KVCache, skip: SkipPlan | None = None, *,
                   observe: Observer | None = None) -> torch.Tensor:
        """Layers ``[start, end)`` on ``[B, T, H]`` at ``positions`` ``[B, T]``, appending
        their KV (decoding, drafting, verification, a prompt from position 0)."""
        ...

    def score_layers(self, hidden: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                     cache: KVCache, skip: SkipPlan | None = None, *,
                     observe: Observer | None = None) -> torch.Tensor:
        """:meth:`run_layers` with read-only attention over the cache's prefix (nothing
        appended)."""
        ...

    def score_layers_free(self, hidden: torch.Tensor, positions: torch.Tensor, start: int,
                          end: int, cache: KVCache, skip: SkipPlan | None = None, *,
                          observe: Observer | None = None) -> torch.Tensor:
        """:meth:`score_layers` in the bulk format with one attention call (need not match
        decoding)."""
        ...

    def resume_prefill_layers(self, hidden: torch.Tensor, positions: torch.Tensor, start: int,
                              end: int, cache: KVCache, *,
                              observe: Observer | None = None) -> torch.Tensor:
        """Layers ``[start, end)`` on a later chunk of a prompt's prefill, appending its KV."""
        ...

    def run_layers_at(self, hidden: torch.Tensor, pos0: int, start: int, end: int,
                      cache: KVCache) -> torch.Tensor:
        """:meth:`run_layers` for ``[1, T, H]`` from the int position ``pos0``."""
        ...

    def run_rows(self, hidden: torch.Tensor, positions: torch.Tensor, lengths: Sequence[int],
                 start: int, end: int, caches: Sequence[KVCache]) -> torch.Tensor:
        """Layers ``[start, end)`` on a packed ragged batch ``[N, H]``, a cache per row."""
        ...

    def propagate_kv(self, hidden: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                     cache: KVCache) -> None:
        """Fill layers ``[start, end)``'s KV from one hidden state without running them."""
        ...

    # --- outputs and whole-model entries
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm, ``[B, T, H]`` → ``[B, T, H]``."""
        ...

    def logits(self, hidden: torch.Tensor, head: Head | None = None,
               vocab_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, H]`` → ``[B, T, V]`` (``[B, T, R]`` with ``vocab_rows``)."""
        ...

    def project(self, normed: torch.Tensor,
                vocab_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``lm_head`` alone: ``[..., H]`` → ``[..., V]``."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                last_only: bool = False, observe: Observer | None = None) -> torch.Tensor:
        """The full model: ``[B, T]`` ids → ``[B, T, V]`` logits."""
        ...

    def prefill(self, input_ids: torch.Tensor, cache: KVCache, start: int = 0,
                observe: Observer | None = None) -> torch.Tensor:
        """A prompt ``[1, N]`` from ``start`` in fixed chunks of positions → ``[1, V]``."""
        ...

    def forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     lengths: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
        """The full model on a packed ragged batch: ``[N]`` ids → ``[N, V]`` logits."""
        ...
