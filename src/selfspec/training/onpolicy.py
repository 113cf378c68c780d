"""Batched greedy generation of on-policy training text (AdaDecode Appendix D).

On-policy text is the model's own greedy answer to real prompts. Generating it one prompt at
a time is what made ``selfspec heads train`` slow: a decode step of a small model is bound by
reading the weights, so 16 sequences per step cost little more than one. Training data need
not be token-exact (only decoding does), so this uses transformers' batched ``generate``
with left padding, several times the single-sequence rate of selfspec's own decoder
(docs/results/timings.md).

A batch is matrix-matrix work: where the CPU emulates bf16 (the executor's bulk format is
fp32), a float32 copy of the model generates instead, made per call and dropped after it, if
memory allows (faster there than emulated bf16; docs/results/timings.md).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

import torch

from selfspec.executor.cpu import available_memory_bytes
from selfspec.training.engine import Engine

logger = logging.getLogger(__name__)

DEFAULT_BATCH = 16


@torch.inference_mode()
def generate_greedy_batch(engine: Engine, prompts: Sequence[Sequence[int]],
                          max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` generated together.

    Args:
        engine: the model (:class:`~selfspec.training.engine.Engine`: ``model``, ``tokenizer``,
            ``eos_token_ids``).
        prompts: token ids per prompt (each non-empty).
        max_new_tokens: length cap per continuation (>= 1).

    Returns:
        One list of new token ids per prompt, ending with the EOS token when the model
        produced one (nothing after it).
    """
    if not prompts:
        return []
    eos = sorted(engine.eos_token_ids)
    pad = engine.tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    model = generation_model(engine)
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts],
                             device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=device)
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=pad,
                         eos_token_id=eos or None, temperature=None, top_p=None, top_k=None)
    stops = set(eos)
    results = []
    for row in out[:, width:].tolist():
        new: list[int] = []
        for tok in row:
            new.append(tok)
            if tok in stops:
                break
        results.append(new)
    return results


def generation_model(engine: Engine) -> torch.nn.Module:
    """The model to run batched generation on: ``engine.model``, or a copy in the executor's
    bulk format (:attr:`LayerExecutor.formats`) when that differs and the copy fits in half
    of the available memory."""
    formats = engine.executor.formats
    if not formats.upcast:
        return engine.model
    params = {id(p): p for p in engine.model.parameters()}.values()  # tied weights once
    need = sum(p.numel() for p in params) * formats.bulk.itemsize
    free = available_memory_bytes()
    if free is not None and need > free // 2:
        logger.info("batched generation stays in %s: a %s copy needs %.1f GB, %.1f GB free",
                    formats.weights, formats.bulk, need / 1e9, free / 1e9)
        return engine.model
    return copy.deepcopy(engine.model).to(formats.bulk)
