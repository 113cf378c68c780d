"""What an engine learns across generations, kept for its life (a process or a server).

- ``history``: the suffix automaton of earlier prompts and outputs, the n-gram drafters'
  second source (SuffixDecoding / SAM-Decoding; :mod:`selfspec.decoding.ngram.lookup`).
- ``drafters``: where each of ``auto``'s model drafters ended its last generation — its
  per-token acceptance and its draft token's share of a one-token forward — so the next
  generation starts its TPT choice (KnapSpec eq. 4) from measurements instead of a fixed
  prior, and its first drafts are not capped short while the estimate climbs
  (:mod:`selfspec.decoding.auto.step`), and its acceptance by draft confidence, from which its
  drafts end (:mod:`selfspec.decoding.planning.tpt_stop`).
- ``ngram``: the n-gram drafter's per-token acceptance per (source, match length) at the end
  of the last generation that drafted from it, the next one's priors: a kind of match that
  keeps failing on this workload (short prompt-lookup matches in code completion were
  accepted ~36% on HumanEval) is not tried at the fixed prior again in every generation
  (:mod:`selfspec.decoding.ngram.drafter`).

The outputs never depend on it: every drafter is verified by the full model.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from selfspec.decoding.ngram.lookup import SuffixAutomaton

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterPrior:
    """A model drafter's estimates at the end of its last generation.

    Attributes:
        acceptance: per-token acceptance ``α`` in ``[0, 1]``.
        draft_cost: a draft token's time as a share of a one-token forward of the model.
        by_confidence: its acceptance per bucket of the draft's top-1 probability (bucket
            index of :data:`~selfspec.decoding.planning.tpt_stop.CONFIDENCE_EDGES` -> rate), for the
            buckets it saw.
    """

    acceptance: float
    draft_cost: float
    by_confidence: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))


@dataclass
class EngineMemory:
    """The engine's memory of earlier generations.

    Attributes:
        history: earlier texts (finished prompts + outputs).
        drafters: per model drafter name, its estimates at the end of its last generation.
        ngram: per n-gram acceptance key (source, match-length bucket), its per-token
            acceptance at the end of the last generation that drafted from it.
    """

    history: SuffixAutomaton = field(default_factory=SuffixAutomaton)
    drafters: dict[str, DrafterPrior] = field(default_factory=dict)
    ngram: dict[tuple[str, int], float] = field(default_factory=dict)

    def clear(self) -> None:
        """Forget every earlier generation."""
        self.history.clear()
        self.drafters.clear()
        self.ngram.clear()


class TenantMemories:
    """One :class:`EngineMemory` per tenant (a server's API key, or a key's ``user``), the
    ``max_tenants`` most recently used kept: a request drafts only from its own tenant's
    earlier texts and estimates (docs/serving.md, "Tenants and history").

    Each memory's history is bounded by :class:`SuffixAutomaton`'s own limits; a dropped
    tenant's next request starts from an empty memory (the outputs never depend on it).

    Args:
        max_tenants: memories kept at most (>= 1).

    Raises:
        ValueError: ``max_tenants`` < 1.
    """

    def __init__(self, max_tenants: int) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self._memories: OrderedDict[str, EngineMemory] = OrderedDict()

    def __len__(self) -> int:
        return len(self._memories)

    def get(self, tenant: str) -> EngineMemory:
        """``tenant``'s memory (a new one for a tenant not kept), now the most recent; the
        least recently used is dropped past ``max_tenants``."""
        memory = self._memories.pop(tenant, None)
        if memory is None:
            memory = EngineMemory()
        self._memories[tenant] = memory
        while len(self._memories) > self.max_tenants:
            dropped, _ = self._memories.popitem(last=False)
            logger.debug("dropped tenant %r's memory (%d kept)", dropped, self.max_tenants)
        return memory
