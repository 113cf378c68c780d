"""SpecEE (Xu et al. 2025): the Step (``step``), its compiled per-layer exit decision
(``kernel``) and the KV policies of skipped layers (``skipped_kv``)."""
