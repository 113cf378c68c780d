#!/usr/bin/env python
"""Each GPT-NeoX feature selfspec computes, switched off in turn: greedy parity with
transformers' ``generate`` must break (it holds with every feature on), so the parity tests
of tests/models/test_families.py would catch a feature left out.

Usage::

    PYTHONPATH=src python scripts/gpt_neox_ablation.py

It builds the tests' tiny random Pythia-like model (parallel residual, ``rotary_pct`` 0.25,
random LayerNorm weights and biases and linear biases: ``_random_neox``), decodes its 3
prompts x 32 tokens with ``ar`` after patching one feature out of the executor's layer
weights, and prints how many prompts still equal transformers. Exits 1 when a feature left
out keeps all 3 (the tests would not see it) or the unpatched run misses one.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models")]  # the tests' tiny model

import test_families as tf  # noqa: E402

import selfspec  # noqa: E402
from selfspec.executor.linear import Linear  # noqa: E402
from selfspec.executor.rope import RopeTable  # noqa: E402
from selfspec.models.layouts import interleave_blocks  # noqa: E402

from tiny import tiny_tokenizer  # noqa: E402


def per_layer(change):
    """A patch replacing each layer's weights by ``change(weights)``."""
    def patch(ex):
        ex.layer_weights = [change(w) for w in ex.layer_weights]
    return patch


def no_bias(w):
    return dataclasses.replace(w, **{k: Linear(getattr(w, k).weight, None, False)
                                     for k in ("qkv", "o", "gate_up", "down")})


def interleaved_qkv(w):  # the checkpoint's per-head rows, as if never reordered
    heads = tf.NEOX_CONFIGS["gpt_neox"]().num_attention_heads
    return dataclasses.replace(w, qkv=Linear(interleave_blocks(w.qkv.weight, heads),
                                             interleave_blocks(w.qkv.bias, heads), False))


def full_rotary(ex):
    hd = ex.head_dim
    ex.rotary_emb.inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    ex.rope = RopeTable(ex.rotary_emb)


ABLATIONS = {
    "all features on": lambda ex: None,
    "LayerNorm -> RMSNorm": per_layer(lambda w: dataclasses.replace(w, layer_norm=False)),
    "LayerNorm biases dropped": per_layer(
        lambda w: dataclasses.replace(w, attn_norm_bias=None, mlp_norm_bias=None)),
    "final LayerNorm bias dropped": lambda ex: ex.norm.bias.data.zero_(),
    "parallel residual off": per_layer(lambda w: dataclasses.replace(w, parallel=False)),
    "query_key_value not reordered": per_layer(interleaved_qkv),
    "linear biases dropped": per_layer(no_bias),
    "RoPE over the whole head (no rotary_pct)": full_rotary,
}


def main() -> int:
    reference = tf._random_neox("gpt_neox", damp=0.3)  # transformers' own, untouched
    want, failed = None, False
    for name, patch in ABLATIONS.items():
        engine = selfspec.from_pretrained_model(tf._random_neox("gpt_neox", damp=0.3),
                                                tiny_tokenizer(), "neox-ablation")
        if want is None:
            want = [tf._hf_tokens(reference, engine, p) for p in tf.PROMPTS]
        patch(engine.executor)
        got = [engine.generate(p, method="ar", max_new_tokens=tf.NEW_TOKENS).token_ids
               for p in tf.PROMPTS]
        same = sum(g == w for g, w in zip(got, want, strict=True))
        print(f"{name:42s} parity with transformers {same}/3")
        failed |= (same == 3) != (name == "all features on")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
