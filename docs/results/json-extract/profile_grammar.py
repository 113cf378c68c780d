"""CPU-time profile of constrained decoding on json-extract's calibration tasks (never the
reported ones): where the time of ar, ngram and auto goes (full forwards, qspec drafting,
the grammar's masks on verified rows and on model drafts, forced tokens, n-gram proposals).

    PYTHONPATH=src python docs/results/json-extract/profile_grammar.py ar,ngram,auto

CPU time (``time.process_time``, torch on one thread) rather than wall time: the development
machines are shared, and a process's CPU time moves far less with the load than its wall
time. Each method starts with an empty engine memory, as a bench row does.
"""

import collections
import sys
import time

import torch

import selfspec
from selfspec.data.jsonextract import calibration_prompts
from selfspec.decoding.core import grammar, processors
from selfspec.decoding.drafting.exit_drafter import ExitDrafter
from selfspec.decoding.memory import EngineMemory
from selfspec.decoding.ngram import drafter as ngram_drafter
from selfspec.executor.executor import LayerExecutor

SPENT: collections.Counter = collections.Counter()


def timed(cls, name, label):
    """Add the CPU time of every call of ``cls.name`` to ``SPENT[label]``."""
    inner = getattr(cls, name)

    def call(*args, **kwargs):
        start = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] += time.process_time() - start
    setattr(cls, name, call)


def main() -> None:
    torch.set_num_threads(1)
    for cls, name, label in [
            (LayerExecutor, "forward", "full forwards (prefill, ar, verification)"),
            (ExitDrafter, "draft", "model drafts (qspec)"),
            (processors.LogitsProcessor, "apply", "processing verified rows (incl. masks)"),
            (grammar.GrammarMatcher, "masks", "  grammar masks of verified rows"),
            (grammar.DraftGuide, "mask", "  masks of model draft tokens"),
            (grammar.DraftGuide, "forced_tokens", "  forced tokens inside model drafts"),
            (ngram_drafter.NgramDrafter, "proposal", "n-gram proposals (incl. constrain)"),
            (grammar.GrammarMatcher, "forced_tokens", "  forced tokens of n-gram drafts"),
            (grammar.GrammarMatcher, "commit", "matcher commits")]:
        timed(cls, name, label)
    engine = selfspec.load("smollm2-135m-instruct")
    prompts = calibration_prompts()
    formats = [engine.grammar(p.meta["response_format"]) for p in prompts]
    reference = None
    for method in (sys.argv[1] if len(sys.argv) > 1 else "ar,ngram,auto").split(","):
        engine.methods.use_memory(EngineMemory())  # warm-up, then forget it like the bench
        engine.generate(prompts[0].text, chat=True, method=method, max_new_tokens=16,
                        response_format=formats[0])
        engine.methods.use_memory(EngineMemory())
        SPENT.clear()
        outputs, verifications, start = [], 0, time.process_time()
        for prompt, fmt in zip(prompts, formats):
            result = engine.generate(prompt.text, chat=True, method=method,
                                     max_new_tokens=128, response_format=fmt)
            outputs.append(result.token_ids)
            verifications += result.stats.verifications
        total = time.process_time() - start
        tokens = sum(map(len, outputs))
        reference = reference or outputs
        print(f"{method}: {tokens} tokens, {total:.2f} s CPU = {tokens / total:.1f} tokens per "
              f"CPU-second, {verifications} verifications, tokens = the first method's: "
              f"{outputs == reference}")
        for label, spent in sorted(SPENT.items(), key=lambda item: -item[1]):
            print(f"   {label:<44} {spent:7.3f} s  {100 * spent / total:5.1f}%")


if __name__ == "__main__":
    main()
