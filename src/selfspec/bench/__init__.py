"""``selfspec bench``: methods against transformers' own decoding on real prompts.

spec (method specs, sweeps) → runners (selfspec methods, hf-* baselines) → harness
(warm-up, interleaved runs) → accuracy → metrics → report / plots; ``pipeline`` wires
them, ``outdir`` keeps the output folder (journal, resume, no silent overwrite), ``cli``
is the command. The core never imports this package.
"""
