#!/bin/bash
# Interleaved A/B: main vs h-gemma, rounds alternating, each a fresh process.
for model in "$@"; do
  for round in 1 2 3 4; do
    for tree in /tmp/ab/base /work/wt/gemma; do
      (cd /tmp/ab && PYTHONPATH=$tree/src python one.py $model 2>/dev/null | tail -1 | sed "s|^|$(uptime | sed 's/.*load average: //') |")
    done
  done
done
