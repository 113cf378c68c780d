#!/usr/bin/env bash
# A/B: the same bench on the code before (main, 78f02d4) and after (restructure), alternating.
set -e
M=ar,auto,ngram,knapspec,adadecode:heads=none,layerskip:exit_layer=24,draft_len=3
for round in 1 2; do
  for side in before after; do
    src=/work/main/src; [ $side = after ] && src=/work/wt/src
    PYTHONPATH=$src python -m selfspec.cli bench --model smollm2-135m-instruct --dataset humaneval \
      --n 8 --max-new-tokens 64 --threads 2 --no-plots --methods $M \
      --out /tmp/ab/$side-$round --overwrite > /tmp/ab/$side-$round.log 2>&1
  done
done
