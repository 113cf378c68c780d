"""Tiny random Llama and Qwen2 models for logic tests (seconds on a CPU)."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

VOCAB = 256


def tiny_config(arch: str, num_layers: int = 6, **overrides):
    """A small config of family ``arch`` ("llama" or "qwen2") with GQA (4 query, 2 KV heads)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, eos_token_id=VOCAB - 1, bos_token_id=0,
                  pad_token_id=0, tie_word_embeddings=False)
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised tiny causal LM in eval mode.

    The weights are scaled up so the logits are peaked enough for argmax to be stable.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides),
                                             attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    return model.to(dtype).eval().requires_grad_(False)


def tiny_tokenizer():
    """A character-level tokenizer over the tiny models' 256 ids, with a chat template.

    Printable ASCII, newline and tab are one token each; ``<unk>``/``<s>`` and filler tokens
    take the other ids, and ``</s>`` is id ``VOCAB - 1`` (the tiny configs' EOS), so every
    id a tiny model emits decodes.
    """
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    names = chars + ["<unk>", "<s>"]
    names += [f"<x{i}>" for i in range(VOCAB - 1 - len(names))] + ["</s>"]
    backend = Tokenizer(WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tokenizer


def run_step(executor, step, prompt, **options):
    """Run the generation loop with ``step`` on ``prompt`` (token ids) and
    ``DecodeOptions(**options)``; the finished ``DecodeState``."""
    from selfspec.decoding.core import loop
    from selfspec.decoding.core.state import DecodeOptions, DecodeState

    state = DecodeState(executor, prompt, DecodeOptions(**options))
    with torch.inference_mode():
        loop.run(state, step)
    return state


class PrefillOnce:
    """Many generations of one prompt (the statistical sampling tests: one per seed) from
    one prefill: :meth:`run` is :func:`run_step` on ``prompt``, except that the prefill of
    every generation after the first is a copy of the first's (bit for bit: its KV cache,
    its logits, and the residual streams it showed the Step's prefill observer, replayed in
    order). Each generation is therefore exactly what :func:`run_step` would produce; only
    the cost of recomputing the same prompt is saved. The prefill is deterministic and
    consumes no randomness, so seeds drive the same draws.

    A generation whose Step asks for a prefill observer when the recorded one did not (or
    the reverse) gets a real prefill, recorded for the next ones of its kind."""

    def __init__(self, executor, prompt):
        self.executor = executor
        self.prompt = list(prompt)
        self._recorded = {}  # observed? -> (keys, values, logits, observer calls)
        self.replayed = 0

    def state(self, **options):
        """A fresh ``DecodeState`` of the prompt with ``DecodeOptions(**options)`` whose
        ``prefill`` is the shared one (for loops other than :meth:`run`'s: ragged batches)."""
        from selfspec.decoding.core.state import DecodeOptions

        return _replayed_prefill_state()(self, self.executor, self.prompt,
                                         DecodeOptions(**options))

    def run(self, step, **options):
        """:func:`run_step` ``(executor, step, prompt, **options)`` on the shared prefill."""
        from selfspec.decoding.core import loop

        state = self.state(**options)
        with torch.inference_mode():
            loop.run(state, step)
        return state


@functools.cache
def _replayed_prefill_state():
    """The :class:`DecodeState` of :meth:`PrefillOnce.run` (built on first use: tiny.py
    imports selfspec only inside its helpers)."""
    from selfspec.decoding.core.state import DecodeState

    class ReplayedPrefill(DecodeState):
        def __init__(self, once, *args):
            super().__init__(*args)
            self._once = once

        def prefill(self, observe=None):
            once = self._once
            record = once._recorded.get(observe is not None)
            if record is None:
                calls = []

                def recording(layer, sublayer, hidden):
                    calls.append((layer, sublayer, hidden.clone()))
                    observe(layer, sublayer, hidden)

                logits = super().prefill(None if observe is None else recording)
                cache = self.cache
                keys = [cache.get(i)[0].clone() for i in range(cache.num_layers)]
                values = [cache.get(i)[1].clone() for i in range(cache.num_layers)]
                once._recorded[observe is not None] = (keys, values, logits.clone(), calls)
                return logits
            keys, values, logits, calls = record
            for i in range(self.cache.num_layers):
                n = keys[i].shape[2]
                k, v = self.cache.claim(i, 0, n)
                k[:, :, :n].copy_(keys[i])
                v[:, :, :n].copy_(values[i])
            for layer, sublayer, hidden in calls:
                observe(layer, sublayer, hidden.clone())
            once.replayed += 1
            return logits.clone()

    return ReplayedPrefill


def exact_prefix_distribution(executor, prompt, config, length):
    """Exact probability of every ``length``-token continuation of ``prompt`` under the
    target model with sampling transform ``config`` (``{tokens: probability}``)."""
    from selfspec.decoding.core.sampling import logits_to_probs

    dist = {(): 1.0}
    with torch.inference_mode():
        for _ in range(length):
            nxt = {}
            for prefix, mass in dist.items():
                ids = torch.tensor([list(prompt) + list(prefix)])
                logits = executor.forward(ids, torch.arange(ids.shape[1]).unsqueeze(0),
                                          executor.new_cache())[0, -1]
                probs = logits_to_probs(logits, config)
                for tok in torch.nonzero(probs).flatten().tolist():
                    nxt[prefix + (tok,)] = mass * float(probs[tok])
            dist = nxt
    return dist


def save_tiny(path, arch: str = "llama", **model_args):
    """Save a tiny random model and :func:`tiny_tokenizer` to ``path`` with
    ``save_pretrained`` (a local model directory ``--model`` accepts); returns ``path``."""
    tiny_model(arch, **model_args).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def assert_block_equals_one_token_decoding(executor, ids: list[int], prefix: int = 2) -> None:
    """``ids[prefix:]`` verified in one forward after ``ids[:prefix]`` gives each position
    exactly (bit for bit) the logits of decoding it alone."""
    ids_t = torch.tensor([ids])
    with torch.inference_mode():
        cache = executor.new_cache()
        executor.forward(ids_t[:, :prefix], torch.arange(prefix)[None], cache)
        alone = torch.stack([executor.forward(ids_t[:, i:i + 1], torch.tensor([[i]]),
                                              cache)[0, -1] for i in range(prefix, len(ids))])
        cache.truncate(prefix)
        together = executor.forward(ids_t[:, prefix:], torch.arange(prefix, len(ids))[None],
                                    cache)[0]
    assert torch.equal(together, alone)


def assert_lossless_on_rows_kernel(arch: str, rows: str) -> None:
    """On a tiny bf16 model decoding on kernel ``rows`` (``--decode-kernel``): a verification
    block is bit-identical to one-token decoding, and lossless methods (layer skip, Draft &
    Verify, KnapSpec, AdaDecode) give exactly `ar`'s greedy tokens, drafting something."""
    import selfspec

    engine = selfspec.from_pretrained_model(tiny_model(arch, dtype=torch.bfloat16),
                                            tiny_tokenizer(), name=f"tiny-{arch}")
    ex = engine.executor
    assert ex.set_bulk("auto", rows).rows == rows
    assert_block_equals_one_token_decoding(ex, [5, 9, 17, 33, 2, 8, 40, 41, 7])
    prompt = "def add(a, b):\n"
    reference = engine.generate(prompt, max_new_tokens=24).token_ids
    drafted = 0
    for method, options in (("layerskip", {"exit_layer": 3, "draft_len": 4}),
                            ("dv", {"exit_layer": 4}),
                            ("knapspec", {}),
                            ("adadecode", {"heads": "none"})):
        result = engine.generate(prompt, method=method, max_new_tokens=24, **options)
        assert result.token_ids == reference, method
        drafted += result.stats.drafted
    assert drafted > 0


def last_position_states(executor, tokens: list[int]) -> dict[int, torch.Tensor]:
    """``{ℓ: [1, H]}`` the state of the last of ``tokens`` leaving ``ℓ`` layers, for every
    ``ℓ`` in ``[1, L]``, from one forward pass without a prior cache (the reference for what
    decoding computed at that position)."""
    with torch.inference_mode():
        ids = torch.tensor([tokens])
        pos = torch.arange(len(tokens)).unsqueeze(0)
        h = executor.embed(ids)
        cache = executor.new_cache(capacity=len(tokens))
        states = {}
        for layer in range(executor.num_layers):
            h = executor.run_layers(h, pos, layer, layer + 1, cache)
            states[layer + 1] = h[0, -1:].clone()
    return states


def write_tiny_gguf(model, path, types=None, arch=None, qk_permuted=None):
    """Write ``model``'s matrices as a GGUF file of quantized blocks (selfspec's reference
    quantizer) and set the model's weights to what those blocks stand for, as if the model had
    been converted from the file (what a registry model is). ``types``: block type per
    matrix kind (``q k v o gate up down output``), Q4_K-family defaults mixed as Q4_K_M
    mixes them. A ``llama`` file stores q/k rows permuted as llama.cpp's converter does.

    Returns the path."""
    import gguf
    import numpy as np

    from selfspec.executor.gguf_quantize import quantize_blocks

    T = gguf.GGMLQuantizationType
    kinds = {"q": T.Q4_K, "k": T.Q4_K, "v": T.Q6_K, "o": T.Q4_1, "gate": T.Q4_K,
             "up": T.Q5_K, "down": T.Q6_K, "output": T.Q8_0}
    kinds.update(types or {})
    arch = arch or model.config.model_type
    permute = arch == "llama" if qk_permuted is None else qk_permuted
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)

    def put(name, lin, kind, heads=0):
        w = lin.weight.detach().float()
        raw = np.asarray(quantize_blocks(w, kinds[kind]))
        deq = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, kinds[kind]),
                                          dtype=np.float32).reshape(w.shape))
        with torch.no_grad():
            lin.weight.copy_(deq.to(lin.weight.dtype))
        bias = None if getattr(lin, "bias", None) is None else lin.bias.detach().float().numpy()
        if heads and permute:  # llama.cpp's LlamaModel.permute on rows
            order = np.arange(w.shape[0]).reshape(heads, 2, -1).swapaxes(1, 2).reshape(-1)
            raw = raw[order]
            bias = None if bias is None else bias[order]
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(raw), raw_dtype=kinds[kind])
        if bias is not None:
            writer.add_tensor(f"{name}.bias", np.ascontiguousarray(bias))

    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        put(f"blk.{i}.attn_q", a.q_proj, "q", cfg.num_attention_heads)
        put(f"blk.{i}.attn_k", a.k_proj, "k", cfg.num_key_value_heads)
        put(f"blk.{i}.attn_v", a.v_proj, "v")
        put(f"blk.{i}.attn_output", a.o_proj, "o")
        put(f"blk.{i}.ffn_gate", m.gate_proj, "gate")
        put(f"blk.{i}.ffn_up", m.up_proj, "up")
        put(f"blk.{i}.ffn_down", m.down_proj, "down")
    put("output", model.lm_head, "output")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
