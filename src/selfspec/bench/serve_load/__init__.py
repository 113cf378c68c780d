"""Load tests of ``selfspec serve`` (not unit tests): each starts a server process and drives
it with the official ``openai`` client.

- ``selfspec bench serve-load`` (:mod:`~selfspec.bench.serve_load.run`): streaming clients at
  several concurrency levels, throughput, time to first token and memory.
- ``selfspec bench serve-mix`` (:mod:`~selfspec.bench.serve_load.mix`): the mixed load test,
  every kind of request at once (:mod:`~selfspec.bench.serve_load.kinds`, sent by
  :mod:`~selfspec.bench.serve_load.client`), ``/metrics`` against the clients' counts, SIGTERM
  at the end (:mod:`~selfspec.bench.serve_load.drain`); its report is
  :mod:`~selfspec.bench.serve_load.report`.

:mod:`~selfspec.bench.serve_load.server` starts nothing itself: it holds what both read from
the server (``/health``, resident memory) and the checks made before a run. They need the
``bench`` and ``serve`` extras (``openai``, ``jsonschema``, ``prometheus-client``).
"""
