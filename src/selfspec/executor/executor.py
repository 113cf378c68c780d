"""Layer-wise execution of an unmodified Hugging Face decoder (DESIGN.md "The executor").

The executor drives the model's own modules (embedding, each layer's norms, attention
projections and MLP, the rotary embedding, the final norm and ``lm_head``) so any layer range
can run on any tokens at explicit positions, against selfspec's own :class:`KVCache`.
Nothing is forked from the modeling files: only the attention score computation is done
here (``scaled_dot_product_attention`` over the cache), which is what lets layers hold
different cache lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from selfspec.errors import InvalidArgumentError, UnsupportedArchitectureError
from selfspec.executor.cache import CacheShape, KVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

# A head maps final-layer-style hidden states [B, T, H] to logits; ``vocab_rows`` restricts
# the output to those vocabulary ids. Exit heads (a later issue) implement this signature.
Head = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class SkipPlan:
    """Which sub-layers to skip, per layer (KnapSpec drafts with a subset of sub-layers).

    Attributes:
        skip_attention: layer indices whose attention sub-layer is skipped (writes no KV).
        skip_mlp: layer indices whose MLP sub-layer is skipped.
    """

    skip_attention: frozenset[int] = field(default_factory=frozenset)
    skip_mlp: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_flags(cls, attention: Sequence[bool], mlp: Sequence[bool]) -> SkipPlan:
        """Build a plan from per-layer booleans (True = skip)."""
        return cls(frozenset(i for i, s in enumerate(attention) if s),
                   frozenset(i for i, s in enumerate(mlp) if s))


class LayerExecutor:
    """Runs any layer range of a Llama- or Qwen2-family ``*ForCausalLM`` on explicit positions.

    Args:
        model: an unmodified HF causal LM (``model.model.layers``, ``model.model.norm``,
            ``model.model.rotary_emb``, ``model.lm_head``).

    Raises:
        UnsupportedArchitectureError: ``config.model_type`` is not one of
            :data:`SUPPORTED_MODEL_TYPES`, or some layer uses sliding-window attention.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {config.model_type!r} is not supported; selfspec drives "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} models. Use a model of one of those families.")
        if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            raise UnsupportedArchitectureError(
                "sliding-window attention layers are not supported; load the model with "
                "use_sliding_window=False (Qwen2.5 configs ship it disabled).")
        self.model = model
        self.config = config
        self.layers = list(model.model.layers)
        self.num_layers = len(self.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = attn.scaling
        self.embed_tokens = model.model.embed_tokens
        self.norm = model.model.norm
        self.rotary_emb = model.model.rotary_emb
        self.lm_head = model.lm_head
        self.max_positions = int(config.max_position_embeddings)
        param = next(model.parameters())
        self.dtype = param.dtype
        self.device = param.device

    # ------------------------------------------------------------------ cache
    def new_cache(self, batch_size: int = 1, capacity: int = 256) -> KVCache:
        """An empty :class:`KVCache` shaped for this model."""
        shape = CacheShape(self.num_layers, batch_size, self.num_kv_heads, self.head_dim)
        return KVCache(shape, self.dtype, self.device, capacity)

    # ------------------------------------------------------------- primitives
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ``[B, T]`` int64 → ``[B, T, H]``."""
        return self.embed_tokens(input_ids)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                   cache: KVCache, skip: SkipPlan | None = None) -> torch.Tensor:
        """Run layers ``[start, end)`` on ``T`` consecutive tokens.

        Each attention sub-layer appends the tokens' keys and values to its layer of
        ``cache`` and attends to everything that layer holds (causally among the new tokens).

        Args:
            hidden: ``[B, T, H]`` hidden states entering layer ``start``.
            positions: ``[B, T]`` int64 absolute positions, consecutive; ``positions[:, 0]``
                must equal the cache length of every layer run (no gaps).
            start: first layer index to run (0-based, inclusive).
            end: one past the last layer to run (``start <= end <= L``).
            cache: the KV cache to read and append to.
            skip: optional :class:`SkipPlan`; a skipped attention sub-layer writes no KV.

        Returns:
            ``[B, T, H]`` hidden states leaving layer ``end - 1``.

        Raises:
            InvalidArgumentError: the layer range is outside ``[0, L]``.
        """
        if not 0 <= start <= end <= self.num_layers:
            raise InvalidArgumentError(
                f"layer range [{start}, {end}) is outside [0, {self.num_layers}]")
        if start == end:
            return hidden
        num_new = hidden.shape[1]
        pos0 = int(positions[0, 0])
        cos, sin = self.rotary_emb(hidden, positions)
        mask = _causal_mask(num_new, pos0 + num_new, hidden.device)
        skip_attn = skip.skip_attention if skip is not None else ()
        skip_mlp = skip.skip_mlp if skip is not None else ()
        for i in range(start, end):
            layer = self.layers[i]
            if i not in skip_attn:
                hidden = hidden + self._attention(i, layer.self_attn, layer.input_layernorm(hidden),
                                                  cos, sin, cache, pos0, mask)
            if i not in skip_mlp:
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden

    def _attention(self, layer_idx: int, attn: torch.nn.Module, x: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, pos0: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """One attention sub-layer on normed input ``x`` ``[B, T, H]`` → ``[B, T, H]``."""
        bsz, num_new, _ = x.shape
        q = attn.q_proj(x).view(bsz, num_new, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = cache.append(layer_idx, k, v, pos0)
        # q, keys, values: [B, H(_kv), T(_all), head_dim]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scaling,
            enable_gqa=self.num_kv_heads != self.num_heads)
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, num_new, -1))

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
        weight = self.lm_head.weight if vocab_rows is None else self.lm_head.weight[vocab_rows]
        bias = self.lm_head.bias
        if bias is not None and vocab_rows is not None:
            bias = bias[vocab_rows]
        return F.linear(self.norm(hidden), weight, bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                last_only: bool = False) -> torch.Tensor:
        """Full model on ``input_ids`` ``[B, T]`` at ``positions`` ``[B, T]``.

        Returns:
            ``[B, T, V]`` logits (``[B, 1, V]`` with ``last_only``).
        """
        hidden = self.run_layers(self.embed(input_ids), positions, 0, self.num_layers, cache)
        if last_only:
            hidden = hidden[:, -1:]
        return self.logits(hidden)


def _causal_mask(num_new: int, total: int, device: torch.device) -> torch.Tensor | None:
    """Boolean attention mask ``[T, S]`` for ``T`` new queries over ``S = total`` keys.

    Query ``i`` (at position ``S - T + i``) sees keys ``0 .. S - T + i``. A single query sees
    everything, so no mask is built on the one-token decode path.
    """
    if num_new == 1:
        return None
    past = total - num_new
    rows = torch.arange(num_new, device=device).unsqueeze(1)
    cols = torch.arange(total, device=device).unsqueeze(0)
    return cols <= rows + past
