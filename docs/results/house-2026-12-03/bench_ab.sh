#!/bin/bash
# A/B of issue 74: same prompts, same latency table, before (e5cc16d) vs after (main).
set -e
L=~/.cache/selfspec/latency
A=$L/smollm2-135m-instruct-30x576x1536x9x3x49152-bfloat16-bf16rows0M-2513276f-t2-x86_64-AMD_EPYC-AVX512-bf16.json
B=${A/2513276f/51e8864a}
cp /work/ab/after-latency.json "$A"
sed 's/2513276f/51e8864a/' /work/ab/after-latency.json > "$B"
M='ar,auto,ngram,knapspec,layerskip:exit_layer=24,draft_len=3'
ARGS="--n 10 --max-new-tokens 64 --threads 2 --no-plots --no-accuracy --overwrite"
for side in after before; do
  if [ $side = after ]; then dir=/work/main; else dir=/work/wt/before; fi
  (cd $dir && PYTHONPATH=$dir/src python -m selfspec.cli bench --methods "$M" $ARGS --out /work/ab/$side) > /work/ab/$side.log 2>&1
done
