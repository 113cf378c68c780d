"""``auto``: per-step choice between drafters and plain decoding by predicted tokens per second
(``step``). Its batches run on the ragged-batch engine of :mod:`selfspec.decoding.core.batch`
with the batch steps of plain decoding and n-gram drafts.

The top of ``selfspec.decoding``: composes the other packages."""
