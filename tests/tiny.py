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
        for _ in range(length):  # every prefix of one length in one batch (256 rows a call)
            prefixes = list(dist)
            nxt = {}
            for start in range(0, len(prefixes), 256):
                chunk = prefixes[start:start + 256]
                ids = torch.tensor([list(prompt) + list(p) for p in chunk])
                positions = torch.arange(ids.shape[1]).expand(len(chunk), -1)
                logits = executor.forward(ids, positions, executor.new_cache(len(chunk)),
                                          last_only=True)[:, -1]
                for prefix, row in zip(chunk, logits):
                    probs = logits_to_probs(row, config)
                    for tok in torch.nonzero(probs).flatten().tolist():
                        nxt[prefix + (tok,)] = dist[prefix] * float(probs[tok])
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


def write_tiny_gguf(model, path, types=None, arch=None, qk_permuted=None, head="output"):
    """Write ``model``'s matrices as a GGUF file of quantized blocks (selfspec's reference
    quantizer) and set the model's weights to what those blocks stand for, as if the model had
    been converted from the file (what a registry model is). ``types``: block type per
    matrix kind (``q k v o gate up down output``), Q4_K-family defaults mixed as Q4_K_M
    mixes them. A ``llama`` file stores q/k rows permuted as llama.cpp's converter does.
    ``head``: ``lm_head``'s tensor name (``token_embd`` for tied embeddings, as llama.cpp
    writes them).

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
    put(head, model.lm_head, "output")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------- end-to-end sampling tests with power
# Bretagnolle-Huber-Carol: N i.i.d. draws over k cells give P(TV(p_hat, p) >= eps/2) <=
# 2^k exp(-N eps^2 / 2). DELTA is the chance, over all positions of one test, that a correct
# sampler fails (the seeds are fixed, so a test is deterministic; DELTA says the seeds are not
# tuned). Cells below MIN_CELL of the exact mass are pooled: TV on a coarser partition is a
# valid (smaller) statistic, and fewer cells give a tighter bound.
SAMPLING_DELTA = 1e-4
MIN_CELL = 0.02


def tv_bound(num_cells: int, num_samples: int, delta: float) -> float:
    """TV an empirical distribution of ``num_samples`` draws over ``num_cells`` cells stays
    under with probability ``>= 1 - delta`` (Bretagnolle-Huber-Carol)."""
    import math

    return math.sqrt(2.0 * (num_cells * math.log(2.0) + math.log(1.0 / delta))
                     / num_samples) / 2.0


def position_marginals(dist: dict, positions) -> list[dict]:
    """``[{token: probability}]`` per position of ``positions``, from ``{tokens: prob}``."""
    out = [{} for _ in positions]
    for tokens, mass in dist.items():
        for m, j in zip(out, positions):
            m[tokens[j]] = m.get(tokens[j], 0.0) + mass
    return out


def pooled_tv(counts: dict, exact: dict, num_samples: int) -> tuple[float, int]:
    """(TV, cells) between ``counts`` (of ``num_samples``) and ``exact`` on the partition
    of the cells of mass ``>= MIN_CELL`` plus one pool of the rest."""
    big = {c for c, mass in exact.items() if mass >= MIN_CELL}
    pool_exact = sum(mass for c, mass in exact.items() if c not in big)
    pool_seen = sum(n for c, n in counts.items() if c not in big)
    tv = abs(pool_seen / num_samples - pool_exact)
    tv += sum(abs(counts.get(c, 0) / num_samples - exact[c]) for c in big)
    return tv / 2.0, len(big) + (pool_exact > 0 or pool_seen > 0)


class VerifyLog:
    """Records ``(drafted, accepted)`` of every ``verify_sampling`` call the Steps make
    (whatever function is there: a planted wrong rule is recorded too), as a context
    manager."""

    def __enter__(self):
        import pytest

        from selfspec.decoding.core import speculative
        from selfspec.decoding.ngram import batch

        self.calls = []
        self._patch = pytest.MonkeyPatch()
        for module in (speculative, batch):
            self._patch.setattr(module, "verify_sampling", self._wrap(module.verify_sampling))
        return self

    def _wrap(self, verify):
        def recorded(*args, **kwargs):
            out = verify(*args, **kwargs)
            self.calls.append((out.num_drafted, out.num_accepted))
            return out
        return recorded

    def __exit__(self, *exc):
        self._patch.undo()

    @property
    def rejections(self) -> int:
        """Drafts with a rejected token."""
        return sum(a < d for d, a in self.calls)

    @property
    def full_accepts(self) -> int:
        """Drafts of >= 2 tokens accepted whole (the bonus token drawn after them)."""
        return sum(a == d >= 2 for d, a in self.calls)


def assert_samples_follow_target(executor, prompt, config, generate, num_samples: int,
                                 new_tokens: int = 6, power_config=None):
    """The end-to-end check of a sampling method (Leviathan et al. 2023 §2.3: speculative
    sampling emits the target's distribution whatever the draft).

    ``generate(seeds) -> [[token]]`` generates ``new_tokens`` tokens after ``prompt`` once per
    seed with ``SamplingConfig`` ``config`` and ``seed=None`` (the rejection-sampling rule),
    after ``torch.manual_seed(seed)`` (a batch: once for the batch; the global RNG drives the
    draws). Asserts, for the marginal of every generated token after the first (the first
    comes from the prefill): TV(empirical, exact) below the BHC bound; the draws had both
    rejected drafts and drafts of >= 2 tokens accepted whole; and power: the bound is below
    the TV between the exact marginals and those under ``power_config`` (default: ``top_k``
    one less: a sampler dropping the last kept token), so a sampler that much off would
    fail. Returns the VerifyLog."""
    import dataclasses

    positions = range(1, new_tokens)
    exact = position_marginals(exact_prefix_distribution(executor, prompt, config, new_tokens),
                               positions)
    power_config = power_config or dataclasses.replace(config, top_k=config.top_k - 1)
    wrong = position_marginals(exact_prefix_distribution(executor, prompt, power_config,
                                                         new_tokens), positions)
    counts = [{} for _ in positions]
    with VerifyLog() as log:
        for tokens in generate(range(num_samples)):
            assert len(tokens) == new_tokens
            for c, j in zip(counts, positions):
                c[tokens[j]] = c.get(tokens[j], 0) + 1
    delta = SAMPLING_DELTA / len(positions)
    report, power = [], 0.0
    for j, c, e, w in zip(positions, counts, exact, wrong):
        tv, cells = pooled_tv(c, e, num_samples)
        bound = tv_bound(cells, num_samples, delta)
        report.append(f"token {j}: TV {tv:.3f} < {bound:.3f}?")
        assert tv < bound, "; ".join(report)
        power = max(power, pooled_tv({k: v * num_samples for k, v in w.items()}, e,
                                     num_samples)[0] - bound)
    assert power > 0, f"no power: {power_config} is within the bounds ({'; '.join(report)})"
    assert log.rejections > 0 and log.full_accepts > 0, log.calls
    return log


def global_rng(seed: int) -> None:
    """Seed torch's global generator with ``seed`` and return ``None``, for
    ``SamplingConfig(..., seed=global_rng(seed))``: a seeded config takes the position-keyed
    Gumbel-max rule (exact-match verification), so an end-to-end test of the rejection rule
    (Leviathan et al. 2023) must pass ``seed=None`` and draw from the global generator.
    (The CPU generator alone: ``torch.manual_seed`` also queues lazy seeding of every
    accelerator backend, ~0.5 ms a call, which thousands of samples pay for nothing.)"""
    torch.default_generator.manual_seed(seed)


def seeded_runs(runs: PrefillOnce, step, config, new_tokens: int = 6):
    """``generate`` for :func:`assert_samples_follow_target`: one :meth:`PrefillOnce.run` per
    seed, after ``torch.manual_seed(seed)``; the generated tokens of each."""
    def generate(seeds):
        for seed in seeds:
            global_rng(seed)
            state = runs.run(step, max_new_tokens=new_tokens, sampling=config)
            yield state.tokens[len(runs.prompt):]
    return generate


def sampling_model(arch: str = "llama", seed: int = 1, num_layers: int = 4, vocab: int = 32,
                   late_scale: float = 0.7):
    """A tiny model for the sampling tests: ``vocab`` tokens (few cells, an exact
    distribution cheap to enumerate), no EOS, and the output projections of the layers after
    the first half scaled by ``late_scale``, so an exit half-way drafts a ``q`` close to
    ``p`` but not equal (drafts both accepted whole and rejected)."""
    model = tiny_model(arch, seed=seed, num_layers=num_layers, vocab_size=vocab,
                       eos_token_id=None, max_position_embeddings=64)
    with torch.no_grad():
        for layer in model.model.layers[num_layers // 2:]:
            layer.self_attn.o_proj.weight.mul_(late_scale)
            layer.mlp.down_proj.weight.mul_(late_scale)
    return model


def assert_speculated(stats, accepts: bool = True, rejects: bool = True) -> None:
    """Assert a lossless-parity run actually speculated, so its equality with plain decoding
    says something: ``stats`` (a ``GenerationStats``, or anything with ``drafted`` and
    ``accepted``) drafted tokens, accepted some when ``accepts`` and rejected some when
    ``rejects`` (``accepted < drafted``: at least one draft token was thrown away)."""
    drafted, accepted = stats.drafted, stats.accepted
    assert drafted > 0, f"no token was drafted ({stats})"
    if accepts:
        assert accepted > 0, f"{drafted} drafted, none accepted"
    if rejects:
        assert accepted < drafted, f"all {drafted} drafted tokens accepted: nothing rejected"


def damp_last_layer(model, scale: float = 0.1):
    """``model`` with its last layer's output projections scaled by ``scale`` (in place;
    returned): an exit before that layer agrees with the full model often but not always, so
    a lossless method on it drafts, accepts and rejects (on a plain random model the
    adaptive methods often choose plain decoding, and a parity test proves nothing)."""
    with torch.no_grad():
        last = model.model.layers[-1]
        last.self_attn.o_proj.weight.mul_(scale)
        last.mlp.down_proj.weight.mul_(scale)
    return model


def steady_latency(engine):
    """``engine`` (returned) with a hand-made latency model in place of the one it would
    measure: verification nearly free (0.05 ms a token), so n-gram and ``auto`` drafting
    decisions do not depend on how loaded the machine was when the model was timed (a
    measurement taken during another worker's burst made n-gram draft nothing for every
    later test of that worker). For tests that need drafts to happen, not tests of the cost
    model."""
    from selfspec.executor.cost_model import LatencyModel

    ex = engine.executor
    key = (ex.draft_weights, ex.formats.rows, ex.formats.rows_min_bytes)
    engine.methods._latency[key] = LatencyModel(ex.num_layers, 0.0, 1.0, 1.0, 1.0,
                                                verify_token_ms=0.05, key="hand-made")
    return engine
