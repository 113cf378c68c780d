"""The torch path's attention sub-layer: RMSNorm, the fused qkv product, RoPE, the cache write
(or read-only concatenation), scaled dot-product attention and the output projection.

Only the score computation is selfspec's (SDPA over :class:`KVCache`'s views), which is what
lets layers hold different cache lengths. Two layouts matter for speed and for bit-exactness:

* blocks from position 0 use SDPA's ``is_causal`` (no explicit mask: the CPU flash kernel
  skips the masked blocks);
* blocks of 2..``row_attention_max`` tokens after a prefix (verification, deferred KV fills)
  attend one token per SDPA call, exactly the call one-token decoding makes, so each token's
  output is bit-identical to decoding it alone.

The fused sub-layers (:mod:`selfspec.executor.fused_layers`) replace this module on the paths
that take them; nothing here runs there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from selfspec.executor.cache import KVCache
    from selfspec.executor.weights import LayerWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as the HF Llama/Qwen2 modules do:
    ``[..., H]`` → ``[..., H]`` in ``x``'s dtype (times ``weight`` ``[H]``)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
         weight_fp32: bool = False) -> torch.Tensor:
    """:func:`rms_norm`, or with ``weight_fp32`` OLMo 2's order (``(w · x̂).to(dtype)``, the
    weight multiplied in float32 before the cast back): ``[..., H]`` → ``[..., H]``."""
    if weight_fp32:
        return (weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps)).to(x.dtype)
    return rms_norm(x, weight, eps)


def attention_input(w: LayerWeights, hidden: torch.Tensor) -> torch.Tensor:
    """What a layer's q/k/v projections read: its input norm of ``hidden`` ``[B, T, H]``, or
    ``hidden`` itself where the layer has none (OLMo 2's post-norm layers)."""
    if w.attn_norm is None:
        return hidden
    if w.layer_norm:
        return F.layer_norm(hidden, (hidden.shape[-1],), w.attn_norm, w.attn_norm_bias,
                            w.attn_norm_eps)
    return norm(hidden, w.attn_norm, w.attn_norm_eps, w.norm_weight_fp32)


def mlp_input(w: LayerWeights, hidden: torch.Tensor) -> torch.Tensor:
    """What a layer's MLP reads: its pre-MLP norm of ``hidden`` ``[B, T, H]`` (a LayerNorm
    with bias as ``nn.LayerNorm`` where :attr:`LayerWeights.layer_norm`: GPT-NeoX), or
    ``hidden`` itself where the layer has none."""
    if w.mlp_norm is None:
        return hidden
    if w.layer_norm:
        return F.layer_norm(hidden, (hidden.shape[-1],), w.mlp_norm, w.mlp_norm_bias,
                            w.mlp_norm_eps)
    return norm(hidden, w.mlp_norm, w.mlp_norm_eps, w.norm_weight_fp32)


def rotated_qkv(w: LayerWeights, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                heads: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys (q/k-normed where the layer has those norms, then rotated where it
    applies RoPE) and values of one fused q/k/v product.

    Args:
        w: the layer's weights.
        qkv: ``[B, T, (Hq + 2 Hkv) · hd]`` the product.
        cos / sin: ``[B, T, 1, hd]`` RoPE rows.
        heads: ``(Hq, Hkv, hd)``.

    Returns:
        ``qk`` ``[B, T, Hq + Hkv, hd]`` (queries, then keys) and ``v`` ``[B, T, Hkv, hd]``.
        Qwen3 (per-head norms) and OLMo 2 (norms over the projection) norm before RoPE, as
        their modeling files do; RoPE rows in float32 (OLMo 2's) rotate in float32.
    """
    nq, nkv, hd = heads
    bsz, num_new = qkv.shape[:2]
    if w.q_norm is not None and w.qk_norm_whole:
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        qkv = torch.cat([norm(q, w.q_norm, w.qk_norm_eps, w.norm_weight_fp32),
                         norm(k, w.k_norm, w.qk_norm_eps, w.norm_weight_fp32), v], dim=-1)
    qkv = qkv.view(bsz, num_new, nq + 2 * nkv, hd)
    qk = qkv[:, :, : nq + nkv]
    if w.q_norm is not None and not w.qk_norm_whole:
        qk = torch.cat([norm(qk[:, :, :nq], w.q_norm, w.qk_norm_eps, w.norm_weight_fp32),
                        norm(qk[:, :, nq:], w.k_norm, w.qk_norm_eps, w.norm_weight_fp32)],
                       dim=2)
    if w.rope:
        # OLMo 2's rotary module returns float32 rows: it rotates in float32 and casts back.
        qk = rotate(qk, cos, sin)
        if qk.dtype != qkv.dtype:
            qk = qk.to(qkv.dtype)
    return qk, qkv[:, :, nq + nkv:]


def sublayer_output(w: LayerWeights, out: torch.Tensor, post: torch.Tensor | None) -> torch.Tensor:
    """A sub-layer's output ``[B, T, H]`` as added to the residual stream: through its
    post-norm ``post`` (OLMo 2) and times the residual multiplier (Granite) where the layer
    has them; else ``out`` itself."""
    if post is not None:
        out = norm(out, post, w.post_norm_eps, w.norm_weight_fp32)
    if w.residual_scale != 1.0:
        out = out * w.residual_scale
    return out


def mlp_output(w: LayerWeights, hidden: torch.Tensor, bulk: bool = False) -> torch.Tensor:
    """A layer's MLP sub-layer (gated, or plain where ``w.gated`` is off) on ``hidden``
    ``[B, T, H]`` (its norms and multiplier included, residual not added): ``[B, T, H]`` to
    add to ``hidden``. ``bulk``: the products run in the bulk format."""
    x = mlp_input(w, hidden)
    if not w.gated:  # GPT-NeoX: down(act(up x))
        return sublayer_output(w, w.down(w.act(w.gate_up(x, bulk)), bulk), w.post_mlp_norm)
    gate, up = w.gate_up(x, bulk).chunk(2, dim=-1)
    return sublayer_output(w, w.down(w.act(gate) * up, bulk), w.post_mlp_norm)


def parallel_residual(hidden: torch.Tensor, attn_out: torch.Tensor | None,
                      mlp_out: torch.Tensor | None) -> torch.Tensor:
    """A parallel-residual layer's output (``use_parallel_residual``: GPT-NeoX, Pythia):
    ``hidden + (mlp_out + attn_out)``, bit for bit transformers' ``mlp_output + attn_output
    + hidden_states`` (modeling_gpt_neox.GPTNeoXLayer), where both sub-layers read the
    layer's input ``hidden`` ``[B, T, H]``; a skipped sub-layer's output is ``None``."""
    if attn_out is None or mlp_out is None:
        out = attn_out if mlp_out is None else mlp_out
        return hidden if out is None else hidden + out
    return hidden + (mlp_out + attn_out)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (HF ``rotate_half`` convention) on ``[B, T, heads, head_dim]`` with
    ``cos``/``sin`` ``[B, T, 1, rotary_dim]``: the first ``rotary_dim`` dims of each head
    rotate, the rest pass through (partial rotary, as transformers'
    modeling_phi3.apply_rotary_pos_emb; ``rotary_dim = head_dim``: the whole head)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        rotated = rotate(x[..., :rotary_dim], cos, sin)
        return torch.cat([rotated, x[..., rotary_dim:].to(rotated.dtype)], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def grouped_causal_mask(num_new: int, total: int, groups: int,
                        device: torch.device) -> torch.Tensor | None:
    """Boolean mask ``[G*T, S]`` for ``G`` query heads × ``T`` new queries over ``S`` keys.

    Query ``t`` (at position ``S - T + t``) sees keys ``0 .. S - T + t``; rows are ordered
    (group, token) to match the grouped query layout. A single new token sees everything,
    so no mask is built on the one-token decode path (``None``).
    """
    if num_new == 1:
        return None
    past = total - num_new
    rows = torch.arange(num_new, device=device).unsqueeze(1)
    cols = torch.arange(total, device=device).unsqueeze(0)
    return (cols <= rows + past).repeat(groups, 1)


def window_mask(num_new: int, total: int, groups: int, window: int,
                device: torch.device) -> torch.Tensor:
    """Boolean mask ``[G*T, S]`` of a sliding window: query ``t`` (at position
    ``S - T + t``) sees keys ``k`` with ``S - T + t - W < k <= S - T + t``, as transformers'
    masking_utils ``sliding_window_causal`` (``kv_idx > q_idx - sliding_window`` on top of the
    causal mask); rows ordered (group, token) like :func:`grouped_causal_mask`."""
    past = total - num_new
    rows = torch.arange(num_new, device=device).unsqueeze(1) + past
    cols = torch.arange(total, device=device).unsqueeze(0)
    return ((cols <= rows) & (cols > rows - window)).repeat(groups, 1)


def windowed(mask: torch.Tensor | None, num_new: int, total: int, groups: int,
             window: int | None, device: torch.device) -> torch.Tensor | None:
    """``mask`` (boolean or additive ``[G*T, S]``, or ``None`` = causal) narrowed to a
    layer's sliding window ``window`` (``None``, or a window no query reaches past: unchanged)."""
    if window is None or total <= window:
        return mask
    inside = window_mask(num_new, total, groups, window, device)
    if mask is None:
        return inside
    if mask.dtype == torch.bool:
        return mask & inside
    return mask.masked_fill(~inside, float("-inf"))


@dataclass(frozen=True)
class Attention:
    """The attention geometry of one model, and its torch-path sub-layer.

    Attributes:
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (``Hq`` is a multiple of it).
        head_dim: ``hd``.
        scaling: the softmax scale (the HF module's ``scaling``).
        row_attention_max: blocks of 2..this many new tokens after a prefix attend one token
            per call (0: never).
        groups: query heads per KV head ``G = Hq / Hkv`` (derived).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    row_attention_max: int
    groups: int = field(init=False)  # query heads per KV head, G = Hq / Hkv

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", self.num_heads // self.num_kv_heads)

    def sublayer(self, layer_idx: int, w: LayerWeights, hidden: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, pos0: int,
                 mask: torch.Tensor | None, write_cache: bool = True,
                 bulk: bool = False, free: bool = False) -> torch.Tensor:
        """One attention sub-layer (norm included, residual not added).

        Args:
            layer_idx: the decoder layer (its KV cache layer).
            w: that layer's weights.
            hidden: ``[B, T, H]`` the residual stream entering the sub-layer.
            cos / sin: ``[B, T, 1, hd]`` RoPE rows of the tokens' positions.
            cache: the KV cache; ``write_cache`` appends the new keys and values at ``pos0``,
                else the layer's first ``pos0`` positions plus the new tokens are attended
                to without appending (a batch-1 cache serves ``B`` candidate states).
            pos0: the first new token's position.
            mask: the block's :func:`grouped_causal_mask` (``None`` from position 0 or for
                one token).
            bulk: the products run in the bulk format.
            free: one attention call even for a verification-sized block.

        Returns:
            ``[B, T, H]`` the sub-layer's output (to add to ``hidden``).
        """
        bsz, num_new, _ = hidden.shape
        nq, nkv, hd, groups = self.num_heads, self.num_kv_heads, self.head_dim, self.groups
        qk, v = rotated_qkv(w, w.qkv(attention_input(w, hidden), bulk), cos, sin,
                            (nq, nkv, hd))                     # [B, T, Hq + Hkv, hd]
        new_k, new_v = qk[:, :, nq:].transpose(1, 2), v.transpose(1, 2)
        if write_cache:
            keys, values = cache.append(layer_idx, new_k, new_v, pos0)
            visible = cache.visible(layer_idx)
        else:
            old_k, old_v = cache.get(layer_idx)
            assert old_k.shape[2] >= pos0, (
                f"KV cache layer {layer_idx} holds {old_k.shape[2]} positions; read-only "
                f"attention cannot start after them, at {pos0}")
            old_k, old_v = old_k[:, :, :pos0], old_v[:, :, :pos0]
            if old_k.shape[0] != bsz:  # one cached sequence, B candidate states
                old_k = old_k.expand(bsz, -1, -1, -1)
                old_v = old_v.expand(bsz, -1, -1, -1)
            keys, values = torch.cat([old_k, new_k], dim=2), torch.cat([old_v, new_v], dim=2)
            visible = cache.visible(layer_idx)
            if visible is not None:
                visible = torch.cat([visible[:pos0], visible.new_ones(num_new)])
        window = w.window
        if pos0 == 0 and num_new > 1 and window is not None and num_new > window:
            # A prompt longer than the layer's window: the explicit window mask.
            out = F.scaled_dot_product_attention(
                qk[:, :, :nq].transpose(1, 2), keys, values,
                attn_mask=window_mask(num_new, num_new, 1, window, hidden.device),
                scale=self.scaling, enable_gqa=groups > 1)          # [B, Hq, T, hd]
            return sublayer_output(
                w, w.o(out.transpose(1, 2).reshape(bsz, num_new, nq * hd), bulk),
                w.post_attn_norm)
        if pos0 == 0 and num_new > 1:
            # A block from position 0 sees only itself (all of it visible, as it was just
            # computed): plain causal attention, which SDPA's
            # CPU flash kernel runs in about half the time of the explicit mask (it skips the
            # masked blocks).
            out = F.scaled_dot_product_attention(
                qk[:, :, :nq].transpose(1, 2), keys, values, is_causal=True,
                scale=self.scaling, enable_gqa=groups > 1)          # [B, Hq, T, hd]
            return sublayer_output(
                w, w.o(out.transpose(1, 2).reshape(bsz, num_new, nq * hd), bulk),
                w.post_attn_norm)
        # keys, values: [B, Hkv, S, hd]. Query heads sharing a KV head are stacked along the
        # sequence axis ([B, Hkv, G*T, hd]): plain SDPA on that layout is several times
        # faster on CPU than SDPA's own enable_gqa path.
        q = qk[:, :, :nq].reshape(bsz, num_new, nkv, groups, hd).permute(0, 2, 3, 1, 4)
        out = self.attend(q, keys, values, pos0, mask, visible, per_token=not free,
                          window=window)
        return sublayer_output(
            w, w.o(out.permute(0, 3, 1, 2, 4).reshape(bsz, num_new, nq * hd), bulk),
            w.post_attn_norm)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos0: int,
               mask: torch.Tensor | None, visible: torch.Tensor | None,
               per_token: bool = True, window: int | None = None) -> torch.Tensor:
        """Scores of ``T`` new queries after ``pos0 > 0`` cached positions.

        Args:
            q: ``[B, Hkv, G, T, hd]`` queries (rotated), grouped by KV head.
            keys / values: ``[B, Hkv, pos0 + T, hd]`` (the new tokens' included).
            mask: the grouped causal mask ``[G*T, pos0 + T]`` (``None`` for ``T = 1``).
            visible: ``[pos0 + T]`` bool, False at masked positions, or ``None``.
            per_token: verification-sized blocks attend one token per call (bit-identical
                to decoding each alone); ``False`` = one call.
            window: the layer's sliding window ``W`` (a query at ``p`` sees keys
                ``p - W < k <= p``), or ``None``. One token (and each token of a per-token
                block) reads only its window's keys, a slice; larger calls mask.

        Returns:
            ``[B, Hkv, G, T, hd]``.
        """
        bsz, nkv, groups, num_new, hd = q.shape
        if per_token and 1 < num_new <= self.row_attention_max:
            # Verification-sized blocks: one SDPA call per token, exactly the call decoding
            # that token alone makes. SDPA's CPU kernel rounds differently with more query
            # rows, which in bf16 flips near-tied argmaxes between speculative and
            # autoregressive decoding; per-token calls keep them bit-identical.
            return torch.stack([
                self._one_token(q[:, :, :, t], keys, values, pos0 + t + 1, visible, window)
                for t in range(num_new)], dim=3)                  # [B, Hkv, G, T, hd]
        if num_new == 1 and mask is None:  # one-token decoding: its window is a slice
            return self._one_token(q[:, :, :, 0], keys, values, pos0 + 1, visible,
                                   window).unsqueeze(3)
        mask = windowed(mask, num_new, pos0 + num_new, groups, window, q.device)
        if visible is not None:  # masked positions (SpecEE's skipped layers) stay unread
            mask = visible.unsqueeze(0) if mask is None else mask & visible.unsqueeze(0)
        return F.scaled_dot_product_attention(
            q.reshape(bsz, nkv, groups * num_new, hd), keys, values, attn_mask=mask,
            scale=self.scaling).view(bsz, nkv, groups, num_new, hd)

    def _one_token(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, end: int,
                   visible: torch.Tensor | None, window: int | None) -> torch.Tensor:
        """One query ``q`` ``[B, Hkv, G, hd]`` at position ``end - 1`` over keys
        ``[lo, end)`` (``lo = end - W`` under a window, else 0): ``[B, Hkv, G, hd]``."""
        lo = 0 if window is None else max(0, end - window)
        return F.scaled_dot_product_attention(
            q, keys[:, :, lo:end], values[:, :, lo:end],
            attn_mask=None if visible is None else visible[None, lo:end], scale=self.scaling)
