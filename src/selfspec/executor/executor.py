"""Layer-wise execution of an unmodified Hugging Face decoder (docs/design.md "Executor contract"
lists every public entry point).

The executor drives the model's own modules (embedding, each layer's norms, attention
projections and MLP, the rotary embedding, the final norm and ``lm_head``) so any layer range
can run on any tokens at explicit positions, against selfspec's own :class:`KVCache`.
Nothing is forked from the modeling files: only the attention score computation is done
here (``scaled_dot_product_attention`` over the cache), which is what lets layers hold
different cache lengths.

:class:`LayerExecutor` is the core: it owns the layer ranges, the positions, the KV cache and
RoPE, and delegates the rest, one purpose a module:

* :mod:`~selfspec.executor.rope` — cos/sin rows from a table of the model's rotary module;
* :mod:`~selfspec.executor.attention` — the torch path's attention sub-layer (SDPA layouts,
  per-token attention of verification-sized blocks);
* :mod:`~selfspec.executor.weights` — a layer's matrices, q/k/v and gate/up fused;
* :mod:`~selfspec.executor.backends` — the number format / kernel family of each matrix,
  chosen once per matrix as a function of (device, format); the fused sub-layers; draft copies;
* :mod:`~selfspec.executor.formats` — :class:`~selfspec.executor.formats.WeightFormats`, the
  collaborator that switches and holds the bulk format, the decoding kernel, the GGUF blocks
  and the draft views (the executor's methods of those names delegate to it);
* :mod:`~selfspec.executor.cost_model` — bytes read per call and measured latencies;
* :mod:`~selfspec.executor.plan` — the shared types (:class:`SkipPlan`, ``Observer``, ``Head``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from selfspec.errors import InvalidArgumentError
from selfspec.executor import cost_model
from selfspec.executor.attention import (
    Attention,
    attention_input,
    grouped_causal_mask,
    mlp_output,
    parallel_residual,
    rotated_qkv,
    sublayer_output,
)
from selfspec.executor.backends import BackendCache, fused_backend
from selfspec.executor.cache import CacheShape, KVCache
from selfspec.executor.formats import WeightFormats
from selfspec.executor.linear import Linear, PackedRowLimits
from selfspec.executor.plan import BULK_MIN_ROWS, PREFILL_CHUNK, Head, Observer, SkipPlan
from selfspec.executor.rope import layer_rope_tables
from selfspec.executor.sync import first_position, position_block
from selfspec.executor.weights import LayerWeights, layer_weights, split_checkpoint_fused
from selfspec.models.architecture import Architecture, decoder_modules, describe
from selfspec.models.common import SUPPORTED_MODEL_TYPES
from selfspec.validation import check_int

if TYPE_CHECKING:
    from selfspec.executor.backends import MatrixBackend
    from selfspec.executor.cpu import ComputeFormats
    from selfspec.executor.cuda_graphs import CudaGraphRunner
    from selfspec.executor.fp16_rows import Fp16Rows
    from selfspec.executor.fused_layers import FusedLayers
    from selfspec.executor.quant import FormatTiming
    from selfspec.models.gguf_weights import GgufWeights

__all__ = ["BULK_MIN_ROWS", "PREFILL_CHUNK", "SUPPORTED_MODEL_TYPES", "Head", "LayerExecutor",
           "Observer", "SkipPlan"]


class LayerExecutor:
    """Runs any layer range of a Llama- or Qwen2-family ``*ForCausalLM`` on explicit positions.

    Args:
        model: an unmodified HF causal LM (``model.model.layers``, ``model.model.norm``,
            ``model.model.rotary_emb``, ``model.lm_head``; GPT-NeoX's ``model.gpt_neox``
            parts where :attr:`Architecture.modules` names them). Its q/k/v and gate/up
            weights are re-pointed at fused copies (same values, no extra memory; GPT-NeoX's
            per-head ``query_key_value`` is replaced by its q, k, v blocks,
            :class:`~selfspec.executor.weights.InterleavedQKV`).
        pack_weights: on CPU in bf16/fp16, also keep oneDNN-packed copies of the weights
            (bit-identical results, faster decoding, one extra copy of the weights).
        name: the model's name (registry name, directory or hub id) for messages and for
            finding its default exit heads; default ``config._name_or_path``.
        row_attention_max: blocks of up to this many new tokens after a non-empty prefix
            (verification, deferred KV fills) compute attention one token at a time, so each
            token's attention output is bit-identical to decoding it alone; 0 turns this off.
            Speculative methods refuse drafts longer than ``row_attention_max - 1``.
        bulk: the format of bulk matrix products (:func:`selfspec.executor.cpu.choose_formats`:
            ``"auto"`` = fp32 for bf16 weights on a CPU that emulates bf16). Bulk calls are
            blocks of at least :data:`BULK_MIN_ROWS` rows that start at position 0 (prefill,
            feature extraction) or are longer than ``row_attention_max`` (never verification),
            and ``lm_head`` on more than ``row_attention_max`` rows; everything else, decoding
            included, computes in the weights' format, so verification stays bit-consistent
            with one-token decoding. ``formats`` holds the choice.
        rows: the kernel of decoding and verification products
            (:func:`selfspec.executor.cpu.choose_rows`: ``"auto"`` = FBGEMM's fp16-weight
            kernel for the larger bf16 matrices on a CPU that emulates bf16, which keeps fp16
            copies of them; ``"fp16"`` = every matrix; ``"weights"`` = the weights' own).
        gguf: where the GGUF file the model was converted from is (a path, or a function
            returning it, called at the first request of the ``"gguf"`` kernel: a registry
            model's file is fetched then), or ``None``. Needed by ``rows="gguf"``.
        prefill_chunk: :meth:`prefill` runs a prompt in calls over the absolute positions
            ``[k·C, (k+1)·C)`` of this many tokens ``C``, so that every position's keys and
            values come from the same calls whatever the prompt's length, and a prefix
            cache's copy of them is exactly what a full prefill computes.
        keep_packed: keep the oneDNN-packed copies of the weights while the decoding kernel
            serves every product (``rows="gguf"``, ``"w4a8"``); ``False`` (``--dtype gguf`` /
            ``w4a8``) never builds them then, which saves about the model's size in its
            dtype, and packs a matrix when a kernel that needs its dense product is chosen.

    Attributes:
        device: the device of the model's weights; backends are chosen for it
            (:func:`selfspec.executor.backends.select_backend`).
        dtype: the weights' (and KV cache's, hidden states') dtype.
        layer_weights: one :class:`~selfspec.executor.weights.LayerWeights` per decoder layer
            (a draft view's: quantized copies).
        output_weights: ``lm_head`` as the executor multiplies it.
        rope: the RoPE table (:class:`~selfspec.executor.rope.RopeTable`).

    Raises:
        UnsupportedArchitectureError: ``config.model_type`` is not one of
            :data:`SUPPORTED_MODEL_TYPES`, or a feature it cannot compute (a sliding window
            shorter than the context): :func:`selfspec.models.architecture.describe`.
    """

    def __init__(self, model: torch.nn.Module, pack_weights: bool = True,
                 row_attention_max: int = 64, name: str | None = None,
                 bulk: str = "auto", rows: str = "auto",
                 prefill_chunk: int = PREFILL_CHUNK,
                 gguf: str | Path | Callable[[], Path] | None = None,
                 keep_packed: bool = True) -> None:
        # One description of the features the paths below compute (no model_type tests).
        self.architecture: Architecture = describe(model.config, "the model")
        # A multimodal checkpoint (Gemma 3): its language model, on text.
        config = model.config.get_text_config()
        self.model = model
        self.config = config
        self.name = name or str(getattr(model.config, "_name_or_path", "") or "model")
        parts = decoder_modules(model, self.architecture)  # GPT-NeoX names its own
        self.layers = parts.layers
        if self.architecture.checkpoint_fused:  # Phi-3: q/k/v and gate/up as usual modules
            for layer in self.layers:
                split_checkpoint_fused(layer, config)
        self.num_layers = len(self.layers)
        attn = getattr(self.layers[0], self.architecture.modules.attention)
        self.head_dim = getattr(attn, "head_dim", None) or attn.head_size  # GPT-NeoX's name
        self.num_heads = config.num_attention_heads
        # GPT-NeoX has no grouped-query attention (and no num_key_value_heads)
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.scaling = attn.scaling
        self.embed_tokens = parts.embed
        self.norm = parts.norm
        self.rotary_emb = parts.rotary_emb
        self.lm_head = parts.lm_head
        self.vocab_size = model.lm_head.out_features
        self.row_attention_max = row_attention_max
        self.prefill_chunk = check_int("prefill_chunk", prefill_chunk, low=1)
        self._attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.scaling,
                               row_attention_max)
        param = next(model.parameters())
        self.dtype = param.dtype
        self.device = param.device
        # One row-consistency table for every packed weight (probed per shape, not per layer).
        self.row_limits = PackedRowLimits(max(64, row_attention_max))
        self.layer_weights: list[LayerWeights] = [
            layer_weights(layer, pack_weights, self.row_limits, keep_packed,
                          self.architecture, i)
            for i, layer in enumerate(self.layers)]
        self.output_weights = Linear(model.lm_head.weight, model.lm_head.bias, pack_weights,
                                     row_limits=self.row_limits, keep_packed=keep_packed)
        self.gguf_weights: GgufWeights | None = None  # read at the first "gguf" request
        self._fused: list[FusedLayers | None] = []  # built at first use: [] = not yet
        # Formats, kernels and draft views; it writes formats, gguf_weights and _fused.
        self._weight_formats = WeightFormats(
            self, BackendCache(self.device, max(64, row_attention_max)), gguf)
        self.formats: ComputeFormats = self.set_bulk(bulk, rows)
        self.draft_weights: str | None = None  # set on the views of draft_view()
        # Per layer, its RoPE table: one for all, or its layer type's (Gemma 3's local base);
        # rope is the default table, or the full-attention layers'.
        self._rope_kinds = self.architecture.rope_kinds or ("default",) * self.num_layers
        self.rope, self.layer_ropes = layer_rope_tables(self.rotary_emb, self._rope_kinds)
        self._one_rope = len(set(self._rope_kinds)) == 1  # the fused path's one span a call
        self._fused_scratch: dict[int, torch.Tensor] = {}  # rows -> [1, rows, H] buffer
        self.max_positions = int(config.max_position_embeddings)
        # Captured CUDA graphs of forward() (selfspec.executor.cuda_graphs.attach_graphs).
        self.graphs: CudaGraphRunner | None = None

    # ---------------------------------------------------------------- formats and kernels
    # One-line delegates of the executor's WeightFormats (selfspec.executor.formats), whose
    # methods of the same names document them in full.
    def set_bulk(self, bulk: str = "auto", rows: str | None = None) -> ComputeFormats:
        """Choose the bulk format (``"auto"``, ``"weights"``, ``"bf16"``, ``"fp16"``, ``"fp32"``)
        and, given ``rows``, the decoding kernel (``None`` keeps it); return the formats.

        Raises:
            InvalidArgumentError: an unknown format.
        """
        return self._weight_formats.set_bulk(bulk, rows)

    def set_decode_kernel(self, rows: str) -> str:
        """Switch the kernel of decoding and verification products (one of
        :data:`selfspec.executor.cpu.ROWS_FORMATS`), keeping the bulk format; return the
        previous request, to switch back (a kernel's copies are built once and kept).

        Raises:
            InvalidArgumentError: an unknown kernel or one unavailable here.
        """
        return self._weight_formats.set_decode_kernel(rows)

    @property
    def backend(self) -> MatrixBackend | None:
        """The backend of decoding and verification products (``None``: every matrix on the
        weights' own product)."""
        return self._weight_formats.backend

    @property
    def fp16_rows(self) -> Fp16Rows | None:
        """The fp16-weight decoding kernel in use (heads built for this executor use it too),
        or ``None``."""
        return self._weight_formats.fp16_rows

    def draft_view(self, fmt: str) -> LayerExecutor:
        """This executor on quantized copies of every decoder layer's linears and of
        ``lm_head`` (``fmt="auto"``: the fastest here), for drafting only: everything else is
        shared, and its KV writes are meant to be dropped. Built once per format and kept.

        Raises:
            InvalidArgumentError: an unknown format or one without a kernel here.
        """
        return self._weight_formats.draft_view(fmt)

    def fastest_draft_format(self) -> FormatTiming:
        """The draft weight format whose one-row products run fastest here (measured once).

        Raises:
            InvalidArgumentError: no quantized kernel in this torch build.
        """
        return self._weight_formats.fastest_draft_format()

    @property
    def measured_draft_format(self) -> FormatTiming | None:
        """What :meth:`fastest_draft_format` measured, or ``None`` before anything asked."""
        return self._weight_formats.fastest_draft

    def fused_layers(self) -> FusedLayers | None:
        """The decoder layers as fused sub-layer kernels (:mod:`selfspec.executor.fused_layers`)
        when every projection decodes on one of selfspec's kernels — all on w4a8
        (``--dtype w4a8``, a ``draft_view("w4a8")``) or all on the bf16 kernel (bf16 models
        whose matrices it takes where bf16 is emulated) — and the layers are ones it takes
        (SiLU MLP, RoPE from a table, bf16/fp32, CPU); else ``None``
        (:func:`selfspec.executor.backends.fused_backend`). Non-bulk blocks that write the
        cache (decoding, verification, batched rows) then run on it, so they stay
        bit-consistent with each other. Built at first use."""
        if not self._fused:
            self._fused = [fused_backend(self.layer_weights, self._attn, self.dtype,
                                         self.device, self.rope.dynamic,
                                         self.architecture.activation)]
        return self._fused[0]

    # ---------------------------------------------------------------- byte accounting
    def decode_weight_bytes(self) -> int:
        """:func:`selfspec.executor.cost_model.decode_weight_bytes` of this executor."""
        return cost_model.decode_weight_bytes(self)

    def decode_layer_bytes(self, layer: int = 0) -> int:
        """:func:`selfspec.executor.cost_model.decode_layer_bytes` of this executor."""
        return cost_model.decode_layer_bytes(self, layer)

    @property
    def output_decode_bytes(self) -> int:
        """:func:`selfspec.executor.cost_model.output_decode_bytes` of this executor."""
        return cost_model.output_decode_bytes(self)

    # ------------------------------------------------------------------ cache
    def new_cache(self, batch_size: int = 1, capacity: int = 256) -> KVCache:
        """An empty :class:`KVCache` shaped for this model."""
        shape = CacheShape(self.num_layers, batch_size, self.num_kv_heads, self.head_dim)
        return KVCache(shape, self.dtype, self.device, capacity)

    # ------------------------------------------------------------- primitives
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ``[B, T]`` int64 → ``[B, T, H]`` (times the embedding multiplier
        where the model has one: Granite)."""
        scale = self.architecture.embedding_multiplier
        if scale != 1.0:
            return self.embed_tokens(input_ids) * scale
        gemma_scale = self.architecture.embedding_scale
        if gemma_scale != 1.0:  # sqrt(H) cast to the weights' dtype first, as transformers
            weight = self.embed_tokens.weight
            return F.embedding(input_ids, weight) * torch.tensor(gemma_scale).to(weight.dtype)
        return self.embed_tokens(input_ids)

    def embed_token(self, token_id: int) -> torch.Tensor:
        """One token's embedding ``[1, 1, H]``, equal to ``embed([[token_id]])``: a read-only
        view of the table's row where the embedding is a plain ``nn.Embedding`` lookup (the
        layer-by-layer methods embed each token separately, and the lookup op costs far
        more per call than a view), else :meth:`embed`.

        Raises:
            IndexError: ``token_id`` outside ``[0, V)``.
        """
        emb = self.embed_tokens
        if (type(emb) is torch.nn.Embedding and emb.max_norm is None
                and self.architecture.embedding_multiplier == 1.0
                and self.architecture.embedding_scale == 1.0
                and not emb._forward_hooks and not emb._forward_pre_hooks):
            if not 0 <= token_id < emb.num_embeddings:
                raise IndexError(f"token id {token_id} is outside [0, {emb.num_embeddings})")
            return emb.weight.detach()[token_id].view(1, 1, -1)
        return self.embed(torch.tensor([[token_id]], device=self.device))

    def is_free_block(self, pos0: int, num_new: int, batch: int = 1) -> bool:
        """Whether a block of ``num_new`` tokens from position ``pos0`` need not be
        bit-consistent with one-token decoding (prefill, blocks longer than any
        verification): its matrix products then run in the bulk format, in one call each
        (no row padding or splitting)."""
        return (batch * num_new >= BULK_MIN_ROWS
                and (pos0 == 0 or num_new > self.row_attention_max))

    def is_bulk(self, pos0: int, num_new: int, batch: int = 1) -> bool:
        """Whether a block of ``num_new`` tokens from position ``pos0`` computes its matrix
        products in the bulk format (see the class docstring)."""
        return self.formats.upcast and self.is_free_block(pos0, num_new, batch)

    def _check_range(self, start: int, end: int) -> None:
        if not 0 <= start <= end <= self.num_layers:
            raise InvalidArgumentError(
                f"layer range [{start}, {end}) is outside [0, {self.num_layers}]")

    # ------------------------------------------------------------- running layers
    # Each way to run layers is its own entry; they share the fused loop (_run_fused) and
    # the torch loop (_run_torch), whose arguments say what the entry chose.
    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                   cache: KVCache, skip: SkipPlan | None = None, *,
                   observe: Observer | None = None) -> torch.Tensor:
        """Run layers ``[start, end)`` on ``T`` consecutive tokens, appending their keys and
        values: decoding, drafting, verification, a prompt from position 0.

        Each attention sub-layer appends the tokens' keys and values to its layer of
        ``cache`` and attends to everything that layer holds (causally among the new tokens).
        A block that :meth:`is_free_block` (a prompt from position 0, a block longer than any
        verification) computes its products in the bulk format where that applies; any other
        block of one sequence runs on the fused sub-layers (:meth:`fused_layers`) where they
        take it, so decoding, verification and batched rows stay bit-consistent.

        Args:
            hidden: ``[B, T, H]`` hidden states entering layer ``start``.
            positions: ``[B, T]`` int64 absolute positions, consecutive, the same in every
                row; ``positions[:, 0]`` must equal the cache length of every layer run (no
                gaps).
            start: first layer index to run (0-based, inclusive).
            end: one past the last layer to run (``start <= end <= L``).
            cache: the KV cache to read and append to.
            skip: optional :class:`SkipPlan`; a skipped attention sub-layer writes no KV.
            observe: optional ``observe(layer_idx, sublayer, hidden [B, T, H])`` called after
                each sub-layer (``"attention"``, then ``"mlp"``) with the residual stream;
                a skipped sub-layer passes it unchanged. Free when ``None``.

        Returns:
            ``[B, T, H]`` hidden states leaving layer ``end - 1``.

        Raises:
            InvalidArgumentError: the layer range is outside ``[0, L]``.
        """
        self._check_range(start, end)
        if start == end:
            return hidden
        bsz, num_new, _ = hidden.shape
        pos0 = first_position(positions)  # no sync for positions made by position_block
        skip_attn = skip.skip_attention if skip is not None else ()
        skip_mlp = skip.skip_mlp if skip is not None else ()
        bulk = self.is_free_block(pos0, num_new, bsz)
        if not bulk and bsz == 1:
            fused = self.fused_layers()
            if (fused is not None and hidden.dtype == cache.dtype == fused.dtype
                    and cache.shape.batch_size == 1 and not cache.any_masked(start, end)):
                return self._run_fused(fused, hidden, pos0, start, end, cache, skip_attn,
                                       skip_mlp, observe)
        return self._run_torch(hidden, positions, pos0, start, end, cache, skip_attn, skip_mlp,
                               observe, write_cache=True, bulk=bulk, free=False,
                               additive_mask=False)

    def score_layers(self, hidden: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                     cache: KVCache, skip: SkipPlan | None = None, *,
                     observe: Observer | None = None) -> torch.Tensor:
        """:meth:`run_layers` with read-only attention: each attention sub-layer attends to
        its layer's first ``positions[:, 0]`` positions plus the new tokens and appends
        nothing, so the cache is left exactly as it was, the positions may be ones the cache
        already holds, and a batch-1 cache serves a batch of ``B`` candidate states (KnapSpec
        scores skip plans on recent tokens this way, §3.3; the residual history records
        them). The products run as :meth:`run_layers`' would (bulk only for a free block),
        never on the fused sub-layers.

        Args:
            hidden, start, end, skip, observe: as :meth:`run_layers`'s.
            positions: ``[B, T]`` int64 consecutive positions, the same in every row;
                ``positions[:, 0]`` at most the cache length of every layer run.
            cache: the KV cache to read (batch 1, or ``B``).

        Returns:
            ``[B, T, H]`` hidden states leaving layer ``end - 1``.

        Raises:
            InvalidArgumentError: the layer range is outside ``[0, L]``.
        """
        self._check_range(start, end)
        if start == end:
            return hidden
        bsz, num_new, _ = hidden.shape
        pos0 = first_position(positions)
        return self._run_torch(hidden, positions, pos0, start, end, cache,
                               skip.skip_attention if skip is not None else (),
                               skip.skip_mlp if skip is not None else (), observe,
                               write_cache=False, bulk=self.is_free_block(pos0, num_new, bsz),
                               free=False, additive_mask=False)

    def score_layers_free(self, hidden: torch.Tensor, positions: torch.Tensor, start: int,
                          end: int, cache: KVCache, skip: SkipPlan | None = None, *,
                          observe: Observer | None = None) -> torch.Tensor:
        """:meth:`score_layers` for a block that need not match one-token decoding bit for
        bit (read-only scoring of many candidate rows: KnapSpec's DP over budgets, the
        latency model's per-layer timing): its matrix products run in the bulk format in one
        call each once ``B·T >= BULK_MIN_ROWS``, and its attention in one call, as for
        prefill. On CPUs that emulate bf16 that is several times cheaper per row for the
        DP's hundreds of rows, while for a few rows the per-call cast of the weights costs
        more than it saves. Never for verification.

        Args, Returns, Raises: as :meth:`score_layers`'.
        """
        self._check_range(start, end)
        if start == end:
            return hidden
        bsz, num_new, _ = hidden.shape
        pos0 = first_position(positions)
        bulk = bsz * num_new >= BULK_MIN_ROWS or self.is_free_block(pos0, num_new, bsz)
        return self._run_torch(hidden, positions, pos0, start, end, cache,
                               skip.skip_attention if skip is not None else (),
                               skip.skip_mlp if skip is not None else (), observe,
                               write_cache=False, bulk=bulk, free=True, additive_mask=False)

    def resume_prefill_layers(self, hidden: torch.Tensor, positions: torch.Tensor, start: int,
                              end: int, cache: KVCache, *,
                              observe: Observer | None = None) -> torch.Tensor:
        """Layers ``[start, end)`` on a block that continues a prompt's prefill after the
        ``positions[:, 0]`` positions ``cache`` holds (a later chunk of :meth:`prefill`,
        whose earlier chunks may be a prefix cache's copy), appending its keys and values:
        matrix products in the bulk format when the prompt so far (``positions[:, 0] + T``
        tokens) would take it, attention in one call (the causal mask over the cache, in its
        additive form), never the fused or per-token paths of decoding and verification.

        Args:
            hidden, start, end, cache, observe: as :meth:`run_layers`'s.
            positions: ``[B, T]`` int64 consecutive positions; ``positions[:, 0]`` equal to
                the cache length of every layer run.

        Returns:
            ``[B, T, H]`` hidden states leaving layer ``end - 1``.

        Raises:
            InvalidArgumentError: the layer range is outside ``[0, L]``.
        """
        self._check_range(start, end)
        if start == end:
            return hidden
        bsz, num_new, _ = hidden.shape
        pos0 = first_position(positions)
        # As one prefill of the whole prompt would run these tokens.
        return self._run_torch(hidden, positions, pos0, start, end, cache, (), (), observe,
                               write_cache=True, bulk=self.is_free_block(0, pos0 + num_new, bsz),
                               free=True, additive_mask=True)

    def _run_torch(self, hidden: torch.Tensor, positions: torch.Tensor, pos0: int, start: int,
                   end: int, cache: KVCache, skip_attn: Sequence[int], skip_mlp: Sequence[int],
                   observe: Observer | None, *, write_cache: bool, bulk: bool, free: bool,
                   additive_mask: bool) -> torch.Tensor:
        """The torch path of the entries above (``hidden`` ``[B, T, H]`` → ``[B, T, H]``):
        ``write_cache`` appends the keys and values, ``bulk`` runs the products in the bulk
        format, ``free`` attends in one call (:meth:`Attention.sublayer`),
        ``additive_mask`` builds the causal mask over the cache in its additive form."""
        attn = self._attn
        num_new = hidden.shape[1]
        ropes = self._layer_rows(hidden, positions, start, end)  # [B, T, 1, head_dim] each
        # Blocks from position 0 use SDPA's is_causal and need no explicit mask.
        mask = (grouped_causal_mask(num_new, pos0 + num_new, attn.groups, hidden.device)
                if pos0 > 0 else None)
        if additive_mask and mask is not None:
            # The additive form SDPA would convert the boolean mask to in every layer, made
            # once (the same values: the same results, without a `where` per layer).
            mask = torch.zeros(mask.shape, dtype=hidden.dtype,
                               device=hidden.device).masked_fill_(~mask, float("-inf"))
        for i in range(start, end):
            w = self.layer_weights[i]
            cos, sin = ropes[w.rope_kind]
            if w.parallel:  # use_parallel_residual: both sub-layers read the layer's input
                out = (None if i in skip_attn else
                       attn.sublayer(i, w, hidden, cos, sin, cache, pos0, mask, write_cache,
                                     bulk, free))
                if observe is not None:
                    observe(i, "attention", hidden if out is None else hidden + out)
                hidden = parallel_residual(
                    hidden, out, None if i in skip_mlp else mlp_output(w, hidden, bulk))
                if observe is not None:
                    observe(i, "mlp", hidden)
                continue
            if i not in skip_attn:
                hidden = hidden + attn.sublayer(i, w, hidden, cos, sin, cache, pos0, mask,
                                                write_cache, bulk, free)
            if observe is not None:
                observe(i, "attention", hidden)
            if i not in skip_mlp:
                hidden = hidden + mlp_output(w, hidden, bulk)
            if observe is not None:
                observe(i, "mlp", hidden)
        return hidden

    def run_layers_at(self, hidden: torch.Tensor, pos0: int, start: int, end: int,
                      cache: KVCache) -> torch.Tensor:
        """:meth:`run_layers` for one sequence's ``T`` consecutive tokens from position
        ``pos0`` (an int, not a position tensor), writing ``cache``; the same result bit for
        bit. The entry of :class:`~selfspec.decoding.core.deferred.DeferredLayers`, through which
        SpecEE, AdaDecode and DSSD run a token a layer or a few at a time (~15 calls a
        token): it goes straight to the fused sub-layers where :meth:`run_layers` would, and
        its per-call Python is what those methods pay on top of the layers.

        Args:
            hidden: ``[1, T, H]`` hidden states entering layer ``start``.
            pos0: the first token's position, equal to the cache length of every layer run.
            start / end: the layer range, ``0 <= start <= end <= L``.
            cache: the batch-1 KV cache to read and append to.

        Returns:
            ``[1, T, H]`` hidden states leaving layer ``end - 1``.

        Raises:
            InvalidArgumentError: the layer range is outside ``[0, L]``.
        """
        self._check_range(start, end)
        if start == end:
            return hidden
        num_new = hidden.shape[1]
        fused = self._fused[0] if self._fused else self.fused_layers()
        if (fused is None or hidden.shape[0] != 1 or self.is_free_block(pos0, num_new)
                or not hidden.dtype == cache.dtype == fused.dtype
                or cache.shape.batch_size != 1 or cache.any_masked(start, end)):
            positions = position_block(pos0, num_new, hidden.device)
            return self.run_layers(hidden, positions, start, end, cache)
        return self._run_fused(fused, hidden, pos0, start, end, cache, (), (), None)

    def _run_fused(self, fused: FusedLayers, hidden: torch.Tensor, pos0: int,
                   start: int, end: int, cache: KVCache, skip_attn: Sequence[int],
                   skip_mlp: Sequence[int], observe: Observer | None) -> torch.Tensor:
        """:meth:`run_layers`' and :meth:`run_layers_at`'s fused path: one sequence
        (``hidden`` ``[1, T, H]``, positions from ``pos0``) on fused sub-layers."""
        num_new = hidden.shape[1]
        spans = self._fused_spans(hidden, pos0, num_new, start, end)
        kinds = self._rope_kinds
        cache.reserve(pos0 + num_new)
        h = hidden.contiguous()  # [1, T, H]: the kernels read T rows of H
        scratch = None
        if observe is None:
            # An attention output that only its MLP reads goes to one scratch buffer (an
            # allocation less per layer; the MLP's output is always a new tensor).
            scratch = self._fused_scratch.get(num_new)
            if scratch is None or scratch.dtype != h.dtype:
                scratch = self._fused_scratch[num_new] = torch.empty_like(h)
        for i in range(start, end):
            if i not in skip_attn:
                keys, values = cache.claim(i, pos0, num_new)
                cos, sin = spans[kinds[i]]
                h = fused.attention_at(i, h, cos, sin, keys, values, pos0,
                                       None if i in skip_mlp else scratch)
            if observe is not None:
                observe(i, "attention", h)
            if i not in skip_mlp:
                h = fused.mlp(i, h)
            if observe is not None:
                observe(i, "mlp", h)
        return h

    def _fused_spans(self, hidden: torch.Tensor, pos0: int, num: int, start: int,
                     end: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin ``[num, hd]`` fp32 of positions ``pos0 ..`` for each RoPE table layers
        ``[start, end)`` read (:attr:`LayerWeights.rope_kind`; Gemma 3's local and global
        bases), for the fused path (one span a table)."""
        if self._one_rope:
            return {self._rope_kinds[0]: self.rope.span(hidden, pos0, num)}
        spans: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(start, end):
            kind = self._rope_kinds[i]
            if kind not in spans:
                spans[kind] = self.layer_ropes[i].span(hidden, pos0, num)
        return spans

    def run_rows(self, hidden: torch.Tensor, positions: torch.Tensor, lengths: Sequence[int],
                 start: int, end: int, caches: Sequence[KVCache]) -> torch.Tensor:
        """Run layers ``[start, end)`` on a ragged batch packed row after row: row ``b`` is
        its own sequence with its own KV cache ``caches[b]``, its own positions and its own
        number of new tokens ``lengths[b]`` (no padding).

        The matrix products run once for all ``N = Σ lengths`` tokens (decoding is bound by
        reading the weights, so ``N`` rows cost little more than one); attention runs per row
        against that row's cache, with exactly the call one-row decoding (one token) or
        verification (several) makes, so a row's result does not depend on the other rows up
        to the matrix kernels' rounding (none with the row-consistent fp16 kernel).

        Args:
            hidden: ``[N, H]`` hidden states entering layer ``start``, row 0's tokens first.
            positions: ``[N]`` int64; row ``b``'s are consecutive from its first, which must
                equal ``caches[b]``'s length in every layer run and be ``> 0`` (a row's prompt
                is prefilled alone, with :meth:`forward`).
            lengths: ``[B]`` tokens of each row (>= 1 each), summing to ``N``.
            start / end: the layer range, ``0 <= start <= end <= L``.
            caches: ``B`` batch-1 caches, one per row.

        Returns:
            ``[N, H]`` hidden states leaving layer ``end - 1``.

        Raises:
            InvalidArgumentError: the layer range is outside ``[0, L]``; ``lengths`` and
                ``caches`` do not describe the ``N`` tokens (one cache per row, each row at
                least one token).
        """
        self._check_range(start, end)
        offsets = _row_offsets(hidden.shape[0], lengths, caches)
        starts = positions[offsets[:-1]].tolist()
        assert min(starts) > 0, "run_rows continues sequences; prefill each row with forward()"
        fused = self.fused_layers()
        if (fused is not None and hidden.dtype == fused.dtype
                and all(c.shape.batch_size == 1 and c.dtype == fused.dtype
                        and not c.any_masked(start, end) for c in caches)):
            return self._run_rows_fused(fused, hidden, positions, offsets, starts, start, end,
                                        caches)
        return self._run_rows_torch(hidden, positions, offsets, starts, start, end, caches)

    def _run_rows_fused(self, fused: FusedLayers, hidden: torch.Tensor, positions: torch.Tensor,
                        offsets: list[int], starts: list[int], start: int, end: int,
                        caches: Sequence[KVCache]) -> torch.Tensor:
        """:meth:`run_rows` on the fused kernel (:mod:`selfspec.executor.fused_layers`): each
        row's KV is claimed in its cache and the kernel writes it. ``offsets``: ``[B + 1]``
        row boundaries in ``hidden``; ``starts``: ``[B]`` each row's first position."""
        from selfspec.executor.fused_layers import KVSegment

        lengths = [hi - lo for lo, hi in zip(offsets, offsets[1:], strict=False)]
        rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(start, end):  # cos, sin [N, hd] fp32 per RoPE table read
            if self._rope_kinds[i] not in rows:
                rows[self._rope_kinds[i]] = self.layer_ropes[i].rows(hidden,
                                                                     positions.unsqueeze(0))
        for cache, n, p in zip(caches, lengths, starts, strict=False):
            cache.reserve(p + n)
        h = hidden.contiguous()
        for i in range(start, end):
            segments = []
            for b, cache in enumerate(caches):
                keys, values = cache.claim(i, starts[b], lengths[b])
                segments.append(KVSegment(keys, values, starts[b], offsets[b], lengths[b]))
            cos32, sin32 = rows[self._rope_kinds[i]]
            h = fused.mlp(i, fused.attention(i, h, cos32, sin32, segments))
        return h

    def _run_rows_torch(self, hidden: torch.Tensor, positions: torch.Tensor, offsets: list[int],
                        starts: list[int], start: int, end: int,
                        caches: Sequence[KVCache]) -> torch.Tensor:
        """:meth:`run_rows` in torch operators: the matrix products on all ``N`` tokens,
        attention row by row against its cache (arguments as :meth:`_run_rows_fused`)."""
        num = hidden.shape[0]
        lengths = [hi - lo for lo, hi in zip(offsets, offsets[1:], strict=False)]
        attn = self._attn
        ropes = self._layer_rows(hidden, positions.unsqueeze(0), start, end)  # [1, N, 1, hd]
        masks = [grouped_causal_mask(n, p + n, attn.groups, hidden.device)
                 for n, p in zip(lengths, starts, strict=False)]
        nq, nkv, hd, groups = self.num_heads, self.num_kv_heads, self.head_dim, attn.groups
        hidden = hidden.unsqueeze(0)                                    # [1, N, H]
        for i in range(start, end):
            w = self.layer_weights[i]
            cos, sin = ropes[w.rope_kind]
            qk, v = rotated_qkv(w, w.qkv(attention_input(w, hidden)), cos, sin, (nq, nkv, hd))
            new_k, new_v = qk[:, :, nq:].transpose(1, 2), v.transpose(1, 2)
            q = qk[:, :, :nq].reshape(1, num, nkv, groups, hd).permute(0, 2, 3, 1, 4)
            outs = []
            for b, cache in enumerate(caches):  # [1, Hkv, G, T_b, hd] each
                lo, hi = offsets[b], offsets[b + 1]
                keys, values = cache.append(i, new_k[:, :, lo:hi], new_v[:, :, lo:hi], starts[b])
                outs.append(attn.attend(q[:, :, :, lo:hi], keys, values, starts[b], masks[b],
                                        cache.visible(i), window=w.window))
            out = torch.cat(outs, dim=3)                                # [1, Hkv, G, N, hd]
            attn_out = sublayer_output(
                w, w.o(out.permute(0, 3, 1, 2, 4).reshape(1, num, nq * hd)), w.post_attn_norm)
            if w.parallel:  # use_parallel_residual
                hidden = parallel_residual(hidden, attn_out, mlp_output(w, hidden))
                continue
            hidden = hidden + attn_out
            hidden = hidden + mlp_output(w, hidden)
        return hidden[0]

    def propagate_kv(self, hidden: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                     cache: KVCache) -> None:
        """Fill layers ``[start, end)`` of ``cache`` with keys and values computed from one
        hidden state, without running those layers (CALM's state propagation, Schuster et
        al. 2022 §3.3; SpecEE's skipped layers, KV option (b)).

        Layer ``i`` gets ``k_proj``/``v_proj`` of its own input norm of ``hidden`` (keys with
        rotary embedding at ``positions``): about ``2·H_kv·head_dim / (params of a layer)`` of a
        layer's cost (2% on Qwen2.5-1.5B). Approximate by design: later tokens read these
        instead of the keys and values the skipped layers would have produced.

        Args:
            hidden: ``[B, T, H]`` hidden states leaving layer ``start - 1`` (the exit state).
            positions: ``[B, T]`` consecutive positions; ``positions[:, 0]`` must equal the
                cache length of every layer filled.
            start / end: the layer range to fill, ``0 <= start <= end <= L``.
            cache: the KV cache.

        Raises:
            InvalidArgumentError: the layer range is outside ``[0, L]``.
        """
        self._check_range(start, end)
        if start == end:
            return
        bsz, num_new, _ = hidden.shape
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        pos0 = int(positions[0, 0])
        ropes = self._layer_rows(hidden, positions, start, end)
        for i in range(start, end):
            w = self.layer_weights[i]
            cos, sin = ropes[w.rope_kind]
            x = attention_input(w, hidden)
            if w.q_norm is None:  # the k/v rows of the product alone
                bias = w.qkv.bias
                kv = F.linear(x, w.qkv.weight[nq * hd:], None if bias is None else bias[nq * hd:])
                qk, v = rotated_qkv(w, kv, cos, sin, (0, nkv, hd))
            else:  # q/k norms split the whole product
                qk, v = rotated_qkv(w, w.qkv(x), cos, sin, (nq, nkv, hd))
            cache.append(i, qk[:, :, -nkv:].transpose(1, 2), v.transpose(1, 2), pos0)

    # ------------------------------------------------------------- outputs
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm: ``[B, T, H]`` → ``[B, T, H]``."""
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor, head: Head | None = None,
               vocab_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits from hidden states leaving any layer.

        Args:
            hidden: ``[B, T, H]`` hidden states (before the final norm).
            head: ``None`` = the model's final norm + ``lm_head``; otherwise a callable
                ``head(hidden, vocab_rows=...) -> logits`` (an exit head carries its own norm).
            vocab_rows: optional ``[R]`` int64 vocabulary ids to score (only those rows of the
                output matrix are multiplied).

        Returns:
            ``[B, T, V]`` logits, or ``[B, T, R]`` when ``vocab_rows`` is given.
        """
        if head is not None:
            return head(hidden, vocab_rows=vocab_rows)
        return self.project(self.norm(hidden), vocab_rows)

    def project(self, normed: torch.Tensor, vocab_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The model's ``lm_head`` alone (no norm), through the oneDNN-packed weight.

        Exit heads that share the model's output matrix (AdaDecode's lightweight heads) call
        this so that they reuse the packed copy instead of storing a ``[V, H]`` matrix.

        Args:
            normed: ``[..., H]`` already-normalised hidden states, in the model's dtype.
            vocab_rows: optional ``[R]`` int64 vocabulary ids to score.

        Returns:
            ``[..., V]`` logits (``[..., R]`` with ``vocab_rows``), divided by the model's
            logits divisor where it has one (Granite's ``logits_scaling``). No autograd through the
            packed kernel: call it under ``torch.no_grad()`` or use ``lm_head`` to train.
        """
        if vocab_rows is None:
            rows = normed.numel() // max(normed.shape[-1], 1)
            logits = self.output_weights(
                normed, bulk=rows > max(self.row_attention_max, BULK_MIN_ROWS))
        else:
            bias = self.lm_head.bias
            logits = F.linear(normed, self.lm_head.weight[vocab_rows],
                              None if bias is None else bias[vocab_rows])
        return self._scaled_logits(logits)

    # ------------------------------------------------------------- whole-model entries
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                last_only: bool = False, observe: Observer | None = None) -> torch.Tensor:
        """Full model on ``input_ids`` ``[B, T]`` at ``positions`` ``[B, T]``: a captured CUDA
        graph where one serves the call, else :meth:`run_layers` over every layer
        (``observe``: as its).

        Returns:
            ``[B, T, V]`` logits (``[B, 1, V]`` with ``last_only``).
        """
        if self.graphs is not None:  # a captured graph serves it, or None
            logits = self.graphs.forward(input_ids, positions, cache, last_only, observe)
            if logits is not None:
                return logits
        hidden = self.run_layers(self.embed(input_ids), positions, 0, self.num_layers, cache,
                                 observe=observe)
        if last_only:
            hidden = hidden[:, -1:]
        return self.logits(hidden)

    def prefill(self, input_ids: torch.Tensor, cache: KVCache, start: int = 0,
                observe: Observer | None = None) -> torch.Tensor:
        """A prompt through all layers, filling ``cache``, in calls over fixed chunks of
        absolute positions ``[k·C, (k+1)·C)`` (``C`` = :attr:`prefill_chunk`; the last one
        shorter): the first from position 0 (:meth:`run_layers`), the others as
        :meth:`resume_prefill_layers` blocks.

        Why fixed chunks: a matrix kernel picks its blocking by the call's row count and
        SDPA by the query count, so a position computed in a call of another size rounds
        differently (measured: module doc of :mod:`selfspec.decoding.core.prefix_cache`).
        With the boundaries fixed, a position's keys and values come from the same calls, on
        the same earlier keys and values, however long the prompt is: a prefix cache that
        copies whole chunks of an earlier prompt and runs the rest from ``start`` gives bit
        for bit the logits and cache of a prefill from 0. The price over one call: smaller
        matrix products and an explicit mask in the later chunks.

        Args:
            input_ids: ``[1, N]`` the prompt's token ids.
            cache: a batch-1 cache holding exactly ``start`` positions in every layer.
            start: positions already in ``cache`` (0, or a multiple of ``C`` below ``N``).
            observe: as :meth:`run_layers`'s, called once per chunk and sub-layer with that
                chunk's positions, chunk after chunk.

        Returns:
            ``[1, V]`` logits for the token after the prompt.

        Raises:
            InvalidArgumentError: ``start`` not a multiple of ``C`` in ``[0, N)``.
        """
        total = input_ids.shape[1]
        size = self.prefill_chunk
        if not (0 <= start < total and start % size == 0):
            raise InvalidArgumentError(
                f"a prefill resumes at a multiple of prefill_chunk ({size}) below the prompt's "
                f"{total} tokens; got {start}")
        if self.graphs is not None:  # a prefill never replays a graph: counted as forward's
            self.graphs.stats.fallbacks["prefill"] += 1
        hidden = input_ids  # replaced by the first chunk's output
        for pos0 in range(start, total, size):
            end = min(pos0 + size, total)
            run = self.resume_prefill_layers if pos0 > 0 else self.run_layers
            hidden = run(self.embed(input_ids[:, pos0:end]),
                         position_block(pos0, end - pos0, input_ids.device), 0,
                         self.num_layers, cache, observe=observe)
        return self.logits(hidden[:, -1:])[:, -1]

    def forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     lengths: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
        """The full model on a packed ragged batch (:meth:`run_rows`): ``input_ids`` ``[N]``
        → ``[N, V]`` logits, ``lm_head`` in the decoding kernel (as one-row decoding)."""
        hidden = self.run_rows(self.embed(input_ids), positions, lengths, 0, self.num_layers,
                               caches)
        return self._scaled_logits(self.output_weights(self.norm(hidden), bulk=False))

    def _scaled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``lm_head``'s output as the model returns it: divided by Granite's
        ``logits_scaling``, soft-capped (``c · tanh(x / c)``, modeling_gemma3) where the
        config sets ``final_logit_softcapping``."""
        divisor = self.architecture.logits_divisor
        if divisor != 1.0:
            logits = logits / divisor
        cap = self.architecture.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _layer_rows(self, hidden: torch.Tensor, positions: torch.Tensor, start: int,
                    end: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin ``[B, T, 1, hd]`` of ``positions`` for each RoPE table layers
        ``[start, end)`` read, by :attr:`LayerWeights.rope_kind` (one lookup a table)."""
        rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(start, end):
            kind = self.layer_weights[i].rope_kind
            if kind not in rows:
                rows[kind] = self.layer_ropes[i].lookup(hidden, positions)
        return rows


def _row_offsets(num: int, lengths: Sequence[int], caches: Sequence[KVCache]) -> list[int]:
    """``[B + 1]`` boundaries of the rows of a packed ragged batch of ``num`` tokens
    (:meth:`LayerExecutor.run_rows`). Raises InvalidArgumentError unless there is one cache
    and >= 1 token per row and ``lengths`` sums to ``num``."""
    if len(caches) != len(lengths) or sum(lengths) != num or min(lengths, default=0) < 1:
        raise InvalidArgumentError(
            f"run_rows needs one KV cache and >= 1 token per row, lengths summing to the "
            f"{num} tokens: {len(caches)} caches, lengths {list(lengths)}")
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets

