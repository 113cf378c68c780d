"""Sub-layer and layer-skip drafts re-chosen during generation: KnapSpec (``step``), CLaSp
(``clasp``) and DEL (``dynamic_exit``)."""
