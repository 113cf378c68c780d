"""Row layouts of checkpoint-fused matrices, as their checkpoints store them and as selfspec
multiplies them (plain tensor reshapes; the executor and the GGUF mapping both read them).

GPT-NeoX's ``query_key_value`` holds each head's q, k and v rows in turn
(``[h0 q, h0 k, h0 v, h1 q, ...]``, ``hd`` rows each: transformers' modeling_gpt_neox
``GPTNeoXAttention.forward`` views its output as ``[..., Hq, 3 · hd]`` and chunks it in 3);
selfspec and llama.cpp's ``gptneox`` GGUFs (``GPTNeoXModel.modify_tensors``) use q, k, v
blocks.
"""

from __future__ import annotations

import torch


def reorder_interleaved(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of GPT-NeoX's ``query_key_value`` (weight ``[3 · Hq · hd, H]`` or bias
    ``[3 · Hq · hd]``) from its per-head order ``[h0 q, h0 k, h0 v, h1 q, ...]`` (each
    ``hd`` rows; transformers' ``GPTNeoXAttention.forward`` views the output as
    ``[..., Hq, 3 · hd]`` and chunks it in 3) into q, k, v blocks (a contiguous copy)."""
    blocks = t.detach().unflatten(0, (heads, 3, -1))                # [Hq, 3, hd, ...]
    return blocks.transpose(0, 1).flatten(0, 2).contiguous()       # [3 · Hq · hd, ...]


def interleave_blocks(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`reorder_interleaved`: q, k, v row blocks back into the per-head
    order ``[h0 q, h0 k, h0 v, h1 q, ...]`` (a contiguous copy)."""
    blocks = t.detach().unflatten(0, (3, heads, -1))                # [3, Hq, hd, ...]
    return blocks.transpose(0, 1).flatten(0, 2).contiguous()
