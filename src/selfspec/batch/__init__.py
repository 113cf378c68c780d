"""``selfspec batch``: offline generation of a JSONL file of prompts into a JSONL file of
results, in this process or on Ray Data (one engine per actor), resumable by request id.

Modules: :mod:`~selfspec.batch.jobs` (a request line and a result record),
:mod:`~selfspec.batch.results` (the resumable output file), :mod:`~selfspec.batch.local`
(the in-process runner), :mod:`~selfspec.batch.ray_data` (the Ray Data runner),
:mod:`~selfspec.batch.cli` (the command line).
"""
