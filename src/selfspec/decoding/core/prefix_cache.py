"""Prefix caching: the KV of earlier prompts, kept under a byte budget and copied into a later
prompt's cache when it starts with the same tokens, so that only the rest is prefilled (a chat
resends its system prompt and history every turn; ``selfspec serve --prefix-cache-mib``,
``selfspec.load(..., prefix_cache_mib=...)``).

**Design: hashed blocks chained by their prefix** (vLLM's automatic prefix caching), not a
radix tree (SGLang's RadixAttention). A prompt is cut into blocks of ``block_size`` tokens;
a block is known by its parent block and its own tokens, so its key stands for the whole
prefix up to it, and a lookup is one dictionary probe per block from the first. Why blocks:

* a block is the executor's **prefill chunk** (:data:`~selfspec.executor.plan.PREFILL_CHUNK`,
  256 positions; :meth:`~selfspec.executor.LayerExecutor.prefill`), the only places where a
  prefill can resume bit for bit (below); reuse is in whole chunks whatever the index, so a
  radix tree's token-exact matches would buy nothing;
* selfspec's :class:`~selfspec.executor.cache.KVCache` is one contiguous buffer per layer
  and row, not pages that attention reads through a table, so a hit is *copied* into the
  row's own cache (sharing pages, a radix tree's other strength, has no pages to share);
* every block is one tensor of one size, so the byte count is exact (the sum of the kept
  tensors' ``numel() * element_size()``) and eviction a constant-time pop; a radix tree's
  node split copies a node's KV or leaves two nodes aliasing one storage;
* keys are exact: ``(parent block's id, the block's token ids)`` in a ``dict``, which
  compares the tuple itself on a hash match, so a collision can never hand one prompt
  another's KV (ids are never reused: a key naming an evicted parent matches nothing).

The blocks form a forest, one root per ``namespace`` (the model, its number formats and its
prefill chunk: KV computed otherwise rounds differently). **Eviction** is least recently
used, leaves first: a lookup or a store touches the blocks of its path from the deepest to
the root, so a parent is always more recent than each of its children and the least
recently used block is always a leaf (evicting an inner block would strand its descendants,
whose keys name it). Only a prompt's full blocks are kept, copied out right after its prefill
(every layer then holds exactly the prompt, no masked position) before decoding touches the
cache; generated tokens are not kept (their KV comes from the decoding and verification
paths, and a speculative method's layers hold different lengths).

A hit copies whole chunks, at most ``len(prompt) - 1`` positions: the last prompt token always
runs (its logits give the first new token), so a prompt that is wholly kept reruns its last
chunk.

**Numerics: bit for bit a full prefill.** A matrix kernel chooses its blocking by the call's
row count, SDPA by the query count, so a position computed in a call of another size rounds
differently. Measured on a Xeon with AMX (SmolLM2-135M, suffix after 1,024 positions): in
fp32 (MKL) calls of up to 8 rows round rows differently from the prompt's 1,044-row call; in
native bf16 (oneDNN) ``down_proj`` (``K = 1,536``) does in calls of 16-128 rows at one thread
and 200-256 at two; and with every product padded to the prompt's row count, 3 of 12
prompt/prefix lengths still came out differently (what is left is attention under an
explicit mask over the cache, not the prefill's ``is_causal`` call). Running the rest of a
prompt in one call on top of 1,040 cached positions gave logits 0.25 off in bf16 (2.5e-5 in
fp32), and greedy bf16 text then differed from ``ar``'s on 5 of 8 MT-Bench turns within 32
tokens (changing only the prefill's thread count flipped 3 of 8: bf16 greedy decoding of
this model meets exact ties). So the executor prefills every prompt in calls over fixed chunks of
absolute positions
``[k·C, (k+1)·C)``, cache or not: a position's KV comes from the same calls on the same
inputs however long the prompt is, and a hit that copies whole chunks and resumes at a chunk
boundary computes exactly what a prefill from 0 computes. Logits and KV are bit-identical
(tests/decoding/test_prefix_cache.py on tiny fp32/bf16 models and real fp32 SmolLM2;
``scripts/prefix_cache_ttft.py`` in bf16 and fp32). The chunks cost a cold prefill 8-15% at
300-2,000 tokens and 27% at 4,000 (bf16, one thread: smaller products, and the explicit
mask each later chunk's attention reads over the whole cache).

**Not used** (the prompt is prefilled whole, and still kept) when the prefill has an
observer: KnapSpec, CLaSp and SpecEE with its drafter record the prompt's residual stream
during the prefill, which a cached prefix would hide from them.

**n-gram history.** The n-gram drafters already see every prompt this cache keeps: a row's
own prompt is its prompt-lookup source, shared prefix included, and a finished (or cancelled)
row's prompt and output join the engine's suffix automaton
(:class:`~selfspec.decoding.memory.EngineMemory`) when it leaves. Adding prompts here as well
would count each one twice in the automaton's continuation counts.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from selfspec.executor import KVCache
from selfspec.executor.plan import PREFILL_CHUNK
from selfspec.validation import check_float, check_int

logger = logging.getLogger(__name__)

#: Tokens per block: the executor's prefill chunk (a hit is reused only in whole chunks, see
#: the module doc); a block of SmolLM2-135M in bf16 is 5.6 MiB.
DEFAULT_BLOCK_SIZE = PREFILL_CHUNK
MIB = 1 << 20


@dataclass
class PrefixCacheStats:
    """What a :class:`PrefixCache` did since it was built.

    Attributes:
        lookups: prompts looked up.
        hits: lookups that reused at least one position.
        reused_tokens: positions copied into prompts' caches instead of prefilled.
        stored_blocks: blocks kept.
        evicted_blocks: blocks dropped to stay under the budget.
    """

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0


class _Block:
    """One kept block: ``kv`` ``[2, L, B, H_kv, block_size, head_dim]`` (keys, values)."""

    __slots__ = ("uid", "key", "kv", "nbytes")

    def __init__(self, uid: int, key: tuple[int, tuple[int, ...]], kv: torch.Tensor) -> None:
        self.uid = uid
        self.key = key  # (parent's uid, token ids)
        self.kv = kv
        self.nbytes = kv.numel() * kv.element_size()


class PrefixCache:
    """The KV of earlier prompts' full blocks, keyed by their prefix (see the module doc).

    One instance serves one model (an engine, or a server's scheduler); it is thread-safe.

    Args:
        budget_bytes: the most bytes of KV kept (>= 0; 0 keeps nothing). Counted exactly: the
            sum of the kept tensors' ``numel() * element_size()``.
        block_size: tokens per block (>= 1).

    Raises:
        InvalidArgumentError: a negative budget or a block size below 1.
    """

    def __init__(self, budget_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.budget_bytes = check_int("budget_bytes", budget_bytes, low=0)
        self.block_size = check_int("block_size", block_size, low=1)
        self.stats = PrefixCacheStats()
        self._lock = threading.Lock()
        self._next_uid = 0
        self._roots: dict[Hashable, int] = {}            # namespace -> root uid (no KV)
        self._index: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()  # uid -> block, oldest first
        self._children: dict[int, int] = {}              # uid -> kept children
        self._bytes = 0

    @classmethod
    def from_mib(cls, mib: float, block_size: int = DEFAULT_BLOCK_SIZE) -> PrefixCache:
        """A cache of ``mib`` MiB (``2**20`` bytes each, rounded down to whole bytes).

        Raises:
            InvalidArgumentError: a negative or non-numeric size; see the class.
        """
        return cls(int(check_float("prefix_cache_mib", mib, low=0) * MIB), block_size)

    @property
    def bytes(self) -> int:
        """Bytes of KV kept now (exact; at most ``budget_bytes``)."""
        return self._bytes

    @property
    def num_blocks(self) -> int:
        """Blocks kept now."""
        return len(self._lru)

    def clear(self) -> None:
        """Drop every block (the statistics stay)."""
        with self._lock:
            self._index.clear()
            self._lru.clear()
            self._children.clear()
            self._bytes = 0

    # ------------------------------------------------------------------ lookup
    def _path(self, tokens: Sequence[int], namespace: Hashable) -> list[_Block]:
        """The kept blocks along ``tokens``' full blocks, from the first, up to the first
        block not kept."""
        parent = self._roots.get(namespace)
        path: list[_Block] = []
        if parent is None:
            return path
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = self._index.get((parent, tuple(tokens[start:start + size])))
            if block is None:
                break
            path.append(block)
            parent = block.uid
        return path

    def _touch(self, path: list[_Block]) -> None:
        """Most recently used: deepest first, so each parent ends more recent than its
        children (the least recently used block is then always a leaf)."""
        for block in reversed(path):
            self._lru.move_to_end(block.uid)

    def _reusable(self, path: list[_Block], tokens: Sequence[int], align: int | None) -> int:
        """Positions of ``path`` a prompt of ``tokens`` may reuse: at most ``len - 1``, a
        multiple of ``align`` (default: the block size)."""
        align = self.block_size if align is None else align
        count = min(len(path) * self.block_size, len(tokens) - 1)
        return max(count, 0) // align * align

    def match(self, tokens: Sequence[int], namespace: Hashable, align: int | None = None) -> int:
        """Positions of ``tokens`` a :meth:`load` would copy now; changes nothing."""
        with self._lock:
            return self._reusable(self._path(tokens, namespace), tokens, align)

    def load(self, tokens: Sequence[int], cache: KVCache, namespace: Hashable,
             align: int | None = None) -> int:
        """Copy the KV of the longest kept prefix of ``tokens`` into ``cache``, leaving at
        least the last token to prefill.

        Args:
            tokens: the prompt's token ids.
            cache: the prompt's cache, empty in every layer.
            namespace: what else the KV depends on (the model, its formats, its chunks).
            align: the positions copied are a multiple of it (the executor's prefill chunk,
                where a prefill may resume bit for bit); default the block size.

        Returns:
            Positions copied (``0``: nothing kept matches); the prefill starts there.

        Raises:
            AssertionError: ``cache`` is not empty.
            CacheFullError: a fixed cache too small for the copy.
        """
        with self._lock:
            self.stats.lookups += 1
            path = self._path(tokens, namespace)
            count = self._reusable(path, tokens, align)
            if count <= 0:
                return 0
            needed = -(-count // self.block_size)  # blocks holding the first `count` positions
            path = path[:needed]
            self._touch(path)
            # [2, L, B, H_kv, count, hd]: one pass over the blocks, one more into the cache.
            kv = torch.cat([b.kv for b in path], dim=4)[..., :count, :]
            self.stats.hits += 1
            self.stats.reused_tokens += count
        cache.copy_in(kv[0], kv[1], start=0)
        logger.debug("prefix cache: %d of %d prompt positions reused", count, len(tokens))
        return count

    # ------------------------------------------------------------------ store
    def store(self, tokens: Sequence[int], cache: KVCache, namespace: Hashable) -> int:
        """Keep the KV of ``tokens``' full blocks that are not kept yet, copied from
        ``cache`` (which holds at least those positions in every layer, none masked: call it
        right after the prefill), then evict least recently used blocks down to the budget.

        Args:
            tokens: the prompt's token ids (``cache`` holds their KV at ``0 .. len - 1``).
            cache: the prompt's cache (read only).
            namespace: as :meth:`load`'s.

        Returns:
            Blocks added (some may have been evicted again when the budget is small).

        Raises:
            AssertionError: ``cache`` holds fewer positions, or masked ones, in the range.
        """
        size = self.block_size
        full = len(tokens) // size
        if full == 0 or self.budget_bytes == 0:
            return 0
        with self._lock:
            root = self._roots.get(namespace)
            if root is None:
                root = self._roots[namespace] = self._new_uid()
            path = self._path(tokens, namespace)
            have = len(path)
            # A block's bytes follow from the cache's geometry; store no more than the budget
            # holds along this path (the rest would be evicted at once).
            shape = cache.shape
            block_bytes = (2 * shape.num_layers * shape.batch_size * shape.num_kv_heads * size
                           * shape.head_dim * torch.empty((), dtype=cache.dtype).element_size())
            full = min(full, self.budget_bytes // block_bytes)
            if full <= have:
                self._touch(path)
                return 0
            keys, values = cache.copy_out(have * size, full * size)  # [L, B, H_kv, n, hd]
            parent = path[-1].uid if path else root
            for j in range(full - have):
                start = (have + j) * size
                span = slice(j * size, (j + 1) * size)
                # Each block owns its storage: its bytes are freed when it alone is evicted.
                kv = torch.stack([keys[..., span, :], values[..., span, :]])
                block = _Block(self._new_uid(), (parent, tuple(tokens[start:start + size])), kv)
                self._index[block.key] = block
                self._lru[block.uid] = block
                self._children[parent] = self._children.get(parent, 0) + 1
                self._bytes += block.nbytes
                path.append(block)
                parent = block.uid
            self._touch(path)
            self.stats.stored_blocks += full - have
            self._evict()
            return full - have

    def _new_uid(self) -> int:
        self._next_uid += 1
        return self._next_uid

    def _evict(self) -> None:
        """Drop least recently used blocks (always leaves) until the budget holds."""
        while self._bytes > self.budget_bytes and self._lru:
            uid, block = self._lru.popitem(last=False)
            assert not self._children.get(uid), "the least recently used block has children"
            self._children.pop(uid, None)
            del self._index[block.key]
            parent = block.key[0]
            left = self._children.get(parent, 0) - 1
            if left > 0:
                self._children[parent] = left
            else:
                self._children.pop(parent, None)
            self._bytes -= block.nbytes
            self.stats.evicted_blocks += 1
