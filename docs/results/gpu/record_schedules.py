"""Record the schedules scripts/gpu_check.py replays on a GPU (docs/gpu.md): SmolLM2-135M
bf16 on this machine's CPU, greedy, 128 new tokens, two prompts, four methods.

    PYTHONPATH=src python docs/results/gpu/record_schedules.py
"""

from pathlib import Path

import selfspec
from selfspec.bench.schedule import record_schedule

OUT = Path(__file__).parent / "schedules"
PROMPTS = {
    "quicksort": 'def quicksort(items):\n    """Sort a list of integers."""\n',
    "fizzbuzz": "def fizzbuzz(n):\n    # Return the FizzBuzz strings for 1..n\n",
}

engine = selfspec.load("smollm2-135m-instruct", dtype="bf16", device="cpu", show_progress=False)
for method in ("ar", "ngram", "layerskip", "dv"):
    for label, prompt in PROMPTS.items():
        schedule = record_schedule(engine, prompt, method, max_new_tokens=128)
        path = schedule.save(OUT / f"smollm2-{method}-{label}.json")
        print(f"{path.name}: {len(schedule.steps)} steps, {len(schedule.output_ids)} tokens, "
              f"{schedule.tokens_per_s:.1f} tok/s on {schedule.recorded_on}")
