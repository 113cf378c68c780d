"""``auto``: per-step choice between drafters and plain decoding by predicted tokens per second
(``step``), and ragged batches that share forwards across rows (``batch``).

The top of ``selfspec.decoding``: composes the other packages."""
