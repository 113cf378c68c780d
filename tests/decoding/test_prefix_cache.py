"""Prefix caching (decoding/core/prefix_cache.py) over the chunked prefill
(LayerExecutor.prefill): a prompt that starts with a kept prefix copies its KV in whole
chunks and prefills only the rest, with logits and KV bit-identical to a full prefill and
greedy outputs equal (tiny random models, fp32 and bf16, for the logic: partial matches,
block boundaries, a wholly cached prompt, observers, batches, the scheduler, a CUDA-graph
static cache; the real fp32 model once); eviction is least recently used, leaves first, and
the byte count is exact."""

import threading

import pytest
import torch

import selfspec
from selfspec.decoding.core import loop
from selfspec.decoding.core.prefix_cache import PrefixCache
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.errors import InvalidArgumentError
from selfspec.executor import CacheShape, KVCache
from selfspec.serving.scheduler import Request, Scheduler

from tiny import save_tiny, tiny_model, tiny_tokenizer

# The tiny tokenizer is one token a character; the tiny engines prefill in chunks of 16
# positions, so their 16-token blocks are 16 characters.
CHUNK = 16
SYSTEM = "You are a terse assistant; answer in one line, politely and with care. "  # 71 chars
QUESTIONS = ["What is 2+2?", "Name a colour.", "Why is the sky blue?"]
NEW = 16


def _tiny_engine(arch="llama", dtype=torch.float32):
    engine = selfspec.from_pretrained_model(tiny_model(arch, seed=3, dtype=dtype),
                                            tiny_tokenizer(), f"tiny-{arch}")
    engine.executor.prefill_chunk = CHUNK
    return engine


@pytest.fixture(scope="module")
def engine():
    return _tiny_engine()


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy outputs without a prefix cache, per prompt text."""
    memo = {}

    def get(prompt, method="ar", **options):
        key = (prompt, method, tuple(sorted(options.items())))
        if key not in memo:
            saved, engine.prefix_cache = engine.prefix_cache, None
            try:
                memo[key] = engine.generate(prompt, method, max_new_tokens=NEW,
                                            **options).token_ids
            finally:
                engine.prefix_cache = saved
        return memo[key]
    return get


@pytest.fixture
def cached(engine):
    """The engine with a fresh 1 MiB prefix cache, turned off again afterwards."""
    cache = engine.use_prefix_cache(1)
    yield cache
    engine.use_prefix_cache(0)


def test_prompts_sharing_a_prefix_reuse_it_and_keep_their_outputs(engine, reference, cached):
    """Partial matches end at the last full block both prompts share, never past the
    divergence; a prompt that is wholly kept reuses all but its last position; outputs are
    token for token those of a full prefill (ar and a speculative method)."""
    prompts = [SYSTEM + q for q in QUESTIONS]
    size = cached.block_size
    shared = len(engine.encode(SYSTEM)) // size * size  # 71 tokens: 4 full blocks
    cases = [  # (prompt, positions reused)
        (prompts[0], 0),                                         # cold
        (prompts[1], shared),                                    # the shared blocks
        (prompts[0], len(engine.encode(prompts[0])) // size * size),  # its own blocks
        (SYSTEM[:2 * size], size),                               # wholly kept: last chunk reruns
        (SYSTEM[:20] + "#" + SYSTEM[21:], size),                 # diverges inside block 2
        (SYSTEM[:2 * size] + "#", 2 * size),                     # right after block 2
    ]
    for prompt, reused in cases:
        result = engine.generate(prompt, max_new_tokens=NEW)
        assert result.stats.cached_tokens == reused, prompt
        assert result.token_ids == reference(prompt), prompt
    layerskip = {"exit_layer": 3, "draft_len": 3}
    result = engine.generate(prompts[2], "layerskip", max_new_tokens=NEW, **layerskip)
    assert result.stats.cached_tokens == shared and result.stats.verifications
    assert result.token_ids == reference(prompts[2], "layerskip", **layerskip)
    assert cached.stats.hits == 6 and cached.stats.lookups == 7


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16)])
def test_a_resumed_prefill_is_bit_identical_to_a_full_one(arch, dtype):
    """Whole chunks copied in and the rest run from a chunk boundary: the logits and every
    layer's keys and values are those of a prefill from 0, bit for bit (fp32 and bf16)."""
    engine = _tiny_engine(arch, dtype)
    ex = engine.executor
    first, second = (engine.encode(SYSTEM + q) for q in QUESTIONS[:2])
    cache = PrefixCache(1 << 20, block_size=CHUNK)

    def prefill(ids, prefix_cache):
        state = DecodeState(ex, ids, DecodeOptions(max_new_tokens=1), prefix_cache=prefix_cache)
        with torch.inference_mode():
            return state.prefill(), state
    want, full = prefill(second, None)
    prefill(first, cache)
    got, resumed = prefill(second, cache)
    assert resumed.stats.cached_tokens == 64
    assert torch.equal(got, want)
    for layer in range(ex.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(resumed.cache.get(layer),
                                                      full.cache.get(layer)))
    with pytest.raises(InvalidArgumentError, match="multiple of prefill_chunk"):
        ex.prefill(torch.tensor([second]), ex.new_cache(), start=CHUNK + 1)
    with pytest.raises(InvalidArgumentError, match="whole prefill chunks"):
        DecodeState(ex, second, DecodeOptions(), prefix_cache=PrefixCache(1 << 20, 24))


def test_an_observed_prefill_runs_the_whole_prompt_in_chunks(engine, cached):
    """Steps that record the prompt's residual stream (KnapSpec, CLaSp, SpecEE) see every
    position, a chunk per call: no reuse with an observer, but the prompt is still kept; the
    recorder's history of a chunked prefill is the read-only pass's, and KnapSpec (which
    plans on it) stays lossless."""
    from selfspec.decoding.core.history import ResidualRecorder, read_history
    from selfspec.decoding.knapspec.step import KnapSpecConfig, KnapSpecStep
    from selfspec.executor.cost_model import LatencyModel

    ids = engine.encode(SYSTEM + QUESTIONS[0])
    engine.generate(ids, max_new_tokens=2)
    seen = []
    state = DecodeState(engine.executor, ids, DecodeOptions(max_new_tokens=2),
                        prefix_cache=cached)
    with torch.inference_mode():
        state.prefill(observe=lambda layer, sub, hidden: seen.append(hidden.shape[1]))
    chunks = [CHUNK] * (len(ids) // CHUNK) + [len(ids) % CHUNK]
    layers = 2 * engine.executor.num_layers
    assert state.stats.cached_tokens == 0 and seen == [n for n in chunks for _ in range(layers)]
    recorder = ResidualRecorder(24)  # reaches back over a chunk boundary
    state = DecodeState(engine.executor, ids, DecodeOptions(max_new_tokens=2))
    with torch.inference_mode():
        state.prefill(recorder.prefill_observer(state))
        state.commit([1])
        recorded = recorder.history(engine.executor, state, 24)
        read = read_history(engine.executor, state, 24)
    assert torch.equal(recorded.tokens, read.tokens)
    for a, b in zip(recorded.states, read.states):
        assert torch.allclose(a, b, atol=1e-5)
    # A read-only pass too dear to plan on: the first re-optimisation at step 0 plans on
    # the prefill's recording of the prompt's end, whose last 8 positions span two chunks.
    pass_dear = LatencyModel(engine.executor.num_layers, 0.0, 1.0, 1.0, 1e-3,
                             batched_row_ms=1e-5, verify_token_ms=1e3, key="pass-dear")
    step = KnapSpecStep(engine.executor, pass_dear,
                        KnapSpecConfig(reoptimize_every=8, min_history=8, tau=-1.0))
    with torch.inference_mode():
        state = DecodeState(engine.executor, ids, DecodeOptions(max_new_tokens=NEW))
        loop.run(state, step)
    assert len(ids) % CHUNK < 8 and step.history[0].step == 0 and step.history[0].recorded
    engine.use_prefix_cache(0)
    assert state.tokens[len(ids):] == engine.generate(ids, max_new_tokens=NEW).token_ids


def test_batched_rows_and_the_scheduler_reuse_each_others_prompts(engine, reference, cached):
    """Rows of one batch are prefilled in turn, so a later row reuses an earlier one's
    blocks; the server's admission (Scheduler._admit -> begin) reads the engine's cache."""
    prompts = [SYSTEM + q for q in QUESTIONS]
    shared = len(engine.encode(SYSTEM)) // cached.block_size * cached.block_size
    results = engine.generate(prompts[:2], max_new_tokens=NEW)
    assert [r.stats.cached_tokens for r in results] == [0, shared]
    assert [r.token_ids for r in results] == [reference(p) for p in prompts[:2]]
    scheduler = Scheduler(engine, max_batch=2)
    done, states = threading.Event(), []

    def on_done(state, text, error):
        assert error is None
        states.append(state)
        done.set()
    options = engine.decode_options(NEW, 0.0, 0, 1.0, None)
    scheduler.submit(Request(engine.encode(prompts[2]), options, on_done=on_done))
    scheduler.start()
    try:
        assert done.wait(60)
    finally:
        scheduler.close()
    state = states[0]
    assert state.stats.cached_tokens == shared
    assert state.tokens[state.prompt_len:] == reference(prompts[2])


def test_a_cuda_graph_static_cache_takes_the_copy(engine):
    """With a CUDA-graph runner (replay="eager" stands in for a graph on the CPU) the row's
    cache is the runner's fixed one: the kept prefix is copied into it, the rest of the prompt
    runs eagerly (never a captured decoding graph), decoding replays as usual."""
    from selfspec.executor.cuda_graphs import CudaGraphRunner

    prompts = [SYSTEM + q for q in QUESTIONS[:2]]
    shared = len(engine.encode(SYSTEM)) // CHUNK * CHUNK
    runner = CudaGraphRunner(engine.executor, capacity=256, max_tokens=3, replay="eager")
    engine.executor.graphs = runner
    try:
        want = [engine.generate(p, max_new_tokens=NEW).token_ids for p in prompts]
        engine.use_prefix_cache(1)
        got = [engine.generate(p, max_new_tokens=NEW) for p in prompts]
    finally:
        engine.executor.graphs = None
        engine.use_prefix_cache(0)
    assert [g.stats.cached_tokens for g in got] == [0, shared]
    assert [g.token_ids for g in got] == want
    assert runner.stats.replays[1] > 0 and runner.stats.fallbacks["static cache in use"] == 0


SHAPE = CacheShape(num_layers=2, batch_size=1, num_kv_heads=2, head_dim=4)
BLOCK = 4
BLOCK_BYTES = 2 * 2 * 1 * 2 * BLOCK * 4 * 4  # keys+values, L, B, H_kv, block, hd, fp32


def _prefilled(tokens):
    """A cache holding ``tokens``' "KV": every entry of position p is tokens[p] (+0.5 in the
    values), so copies can be checked."""
    cache = KVCache(SHAPE, torch.float32, "cpu", capacity=len(tokens))
    kv = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 2, -1, 4)
    for layer in range(SHAPE.num_layers):
        cache.append(layer, kv, kv + 0.5, start=0)
    return cache


def _store(pc, tokens):
    return pc.store(tokens, _prefilled(tokens), "model")


def _kept_bytes(pc):
    return sum(b.kv.numel() * b.kv.element_size() for b in pc._lru.values())


def test_eviction_is_lru_leaves_first_and_bytes_are_exact():
    pc = PrefixCache(budget_bytes=5 * BLOCK_BYTES, block_size=BLOCK)
    a = list(range(100, 113))      # 3 full blocks + 1 token
    b = a[:4] + list(range(200, 213))  # shares a's first block, then 3 of its own + 1
    assert _store(pc, a) == 3 and pc.bytes == 3 * BLOCK_BYTES == _kept_bytes(pc)
    assert _store(pc, a) == 0       # nothing new
    assert _store(pc, b) == 3       # 6 blocks > 5: the LRU leaf (a's last block) goes
    assert pc.num_blocks == 5 and pc.bytes == 5 * BLOCK_BYTES == _kept_bytes(pc)
    assert pc.stats.evicted_blocks == 1
    assert pc.match(a, "model") == 8 and pc.match(b, "model") == 16
    # Every kept block's parent is kept (or is the root): eviction never strands a block.
    uids = set(pc._lru) | set(pc._roots.values())
    assert all(block.key[0] in uids for block in pc._lru.values())
    # A lookup makes a's path recent: b's deepest block is the next to go.
    target = KVCache(SHAPE, torch.float32, "cpu", capacity=4)
    assert pc.load(a, target, "model") == 8
    keys, values = target.get(1)
    assert keys[0, 0, :, 0].tolist() == a[:8] and torch.equal(values, keys + 0.5)
    _store(pc, list(range(300, 304)))
    assert pc.match(b, "model") == 12 and pc.match(a, "model") == 8
    assert pc.bytes == 5 * BLOCK_BYTES == _kept_bytes(pc)
    # Other namespaces (another model or format) never match; clear frees everything.
    assert pc.match(a, "other") == 0
    pc.clear()
    assert pc.bytes == 0 and pc.num_blocks == 0 and pc.match(a, "model") == 0


def test_budgets_below_a_path_keep_its_first_blocks_and_zero_keeps_nothing():
    pc = PrefixCache(budget_bytes=2 * BLOCK_BYTES + BLOCK_BYTES // 2, block_size=BLOCK)
    assert _store(pc, list(range(12))) == 2  # room for two blocks: the first two
    assert pc.match(list(range(13)), "model") == 8 and pc.bytes == 2 * BLOCK_BYTES
    assert _store(pc, list(range(50, 54))) == 1  # a new path evicts the old one's leaf
    assert pc.match(list(range(13)), "model") == 4 and pc.bytes == 2 * BLOCK_BYTES
    off = PrefixCache(budget_bytes=0, block_size=BLOCK)
    assert _store(off, list(range(12))) == 0 and off.bytes == 0
    assert _store(PrefixCache(BLOCK_BYTES - 1, BLOCK), list(range(12))) == 0


def test_bad_sizes_are_refused(engine):
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(InvalidArgumentError):
            PrefixCache(bad)
    with pytest.raises(InvalidArgumentError):
        PrefixCache(10, block_size=0)
    with pytest.raises(InvalidArgumentError):
        engine.use_prefix_cache(-1)
    assert engine.use_prefix_cache(0) is None and engine.prefix_cache is None
    assert PrefixCache.from_mib(0.5).budget_bytes == 1 << 19


def test_the_prefill_chunk_flag_sets_the_executor_and_the_cache_blocks(tmp_path):
    """``selfspec serve --prefill-chunk 64`` (and ``batch``'s) reaches ``selfspec.load``, so
    the executor prefills in chunks of 64 and the prefix cache keeps 64-token blocks; a warm
    prompt then reuses whole 64-token blocks with logits bit-identical to a cold prefill.
    Bad values are usage errors before anything loads."""
    from selfspec.batch.cli import _run
    from selfspec.cli import build_parser
    from selfspec.serving.cli import _checked

    model = str(save_tiny(tmp_path / "m", seed=3))
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", model, "--dtype", "fp32",
                              "--prefill-chunk", "64", "--prefix-cache-mib", "4"])
    load = _checked(args)[0]
    assert load["prefill_chunk"] == 64
    engine = selfspec.load(**load, show_progress=False)
    assert engine.executor.prefill_chunk == 64 and engine.prefix_cache.block_size == 64
    prompts = [engine.encode(SYSTEM * 2 + q) for q in QUESTIONS[:2]]  # 142 shared tokens
    with torch.inference_mode():
        cold = DecodeState(engine.executor, prompts[1], DecodeOptions()).prefill()
        DecodeState(engine.executor, prompts[0], DecodeOptions(),
                    prefix_cache=engine.prefix_cache).prefill()  # keeps its 2 blocks
        state = DecodeState(engine.executor, prompts[1], DecodeOptions(),
                            prefix_cache=engine.prefix_cache)
        warm = state.prefill()
    assert state.stats.cached_tokens == 128 and torch.equal(warm, cold)

    seen = {}
    batch = parser.parse_args(["batch", "p.jsonl", "--output", "o.jsonl", "--model", model,
                               "--prefill-chunk", "32"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selfspec, "load", lambda **kw: seen.update(kw) or engine)
        mp.setattr("selfspec.batch.local.run_local", lambda *a: None)
        _run(batch, [], None)
    assert seen["prefill_chunk"] == 32
    for bad in ("0", "-4", "1.5", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--prefill-chunk", bad])
    for bad in (0, 1.5, True, "64"):
        with pytest.raises(InvalidArgumentError, match="prefill_chunk"):
            selfspec.load(model, prefill_chunk=bad)


@pytest.mark.real_model
def test_real_model_chat_turns_reuse_the_system_prompt(smollm2_fp32):
    """SmolLM2 in fp32 (real weights), prefilling in chunks of 64 positions for the test's
    short prompts: a second chat turn sharing a ~100-token system prompt reuses its first
    chunk, with the prefill's logits bit-identical and the greedy tokens of a full prefill."""
    engine = smollm2_fp32
    system = ("You are a careful Python reviewer. Read the code the user sends, point out bugs "
              "and unsafe patterns first, then style problems, and suggest a corrected version. "
              "Keep answers short: at most five bullet points and one code block. ") * 2
    chats = [[{"role": "system", "content": system},
              {"role": "user", "content": question}]
             for question in ("def add(a, b): return a - b", "x = eval(input())")]
    prompts = [engine.tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                    return_dict=False) for c in chats]
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    ex = engine.executor
    assert engine.prefix_cache is None
    default, ex.prefill_chunk = ex.prefill_chunk, 64
    try:
        want = engine.generate(prompts[1], max_new_tokens=8).token_ids
        cache = engine.use_prefix_cache(64)
        engine.generate(prompts[0], max_new_tokens=1)  # keeps the first turn's prompt
        got = engine.generate(prompts[1], max_new_tokens=8)
        with torch.inference_mode():
            logits = [DecodeState(ex, prompts[1], DecodeOptions(), prefix_cache=c).prefill()
                      for c in (cache, None)]
    finally:
        engine.use_prefix_cache(0)
        ex.prefill_chunk = default
    assert got.stats.cached_tokens == common // 64 * 64 >= 64
    assert got.token_ids == want
    assert torch.equal(*logits)
