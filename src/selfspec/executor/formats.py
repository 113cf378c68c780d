"""The number formats, decoding kernels and draft views of one executor.

:class:`WeightFormats` is the collaborator :class:`~selfspec.executor.executor.LayerExecutor`
holds for everything that switches or holds how its matrices compute: the bulk format and the
decoding kernel (:func:`selfspec.executor.cpu.choose_formats`, the backends of
:mod:`selfspec.executor.backends`), the GGUF blocks of the ``"gguf"`` kernels, and the draft
views (the executor on quantized copies of its matrices, :mod:`selfspec.executor.quant`). The
executor keeps one-line delegates of its public entry points (``set_bulk``,
``set_decode_kernel``, ``backend``, ``fp16_rows``, ``draft_view``, ``fastest_draft_format``,
``measured_draft_format``; docs/design.md "Executor contract").

What the layers read on every call stays on the executor, written here when it changes:
``formats`` (:meth:`LayerExecutor.is_bulk`), ``gguf_weights`` and the fused sub-layers
(``_fused``, rebuilt after a kernel switch), so running layers costs no lookup through this
object.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.errors import InvalidArgumentError
from selfspec.executor.backends import BackendCache, assign, draft_copies
from selfspec.executor.cpu import GGUF_ROWS, ComputeFormats, choose_formats
from selfspec.executor.fp16_rows import Fp16Rows

if TYPE_CHECKING:
    from collections.abc import Callable

    from selfspec.executor.backends import MatrixBackend
    from selfspec.executor.contract import Executor
    from selfspec.executor.quant import FormatTiming

logger = logging.getLogger(__name__)


class WeightFormats:
    """The formats, kernels and draft views of ``executor``.

    Args:
        executor: the executor whose matrices (``layer_weights``, ``output_weights``) this
            formats; it must have ``dtype``, ``device``, ``name``, ``config``, ``model`` and
            ``num_layers`` set.
        backends: the kept backends of the executor's device
            (:class:`~selfspec.executor.backends.BackendCache`); a draft view shares its
            executor's.
        gguf: where the GGUF file the model was converted from is (a path, or a function
            returning it, called at the first request of a ``"gguf"`` kernel), or ``None``.

    Attributes:
        executor: as given.
        backends: as given.
        draft_views: format name → the draft view built for it (kept).
        backend: the backend of decoding and verification products (``None``: every matrix
            on the weights' own product).
        formats: the formats chosen last, ``None`` before the first :meth:`set_bulk`.
    """

    def __init__(self, executor: Executor, backends: BackendCache,
                 gguf: str | Path | Callable[[], Path] | None = None) -> None:
        self.executor = executor
        self.backends = backends
        self.gguf_source = gguf
        self.formats: ComputeFormats | None = None
        self.backend: MatrixBackend | None = None
        self.bulk_request = "auto"
        self.rows_request = "auto"
        self.fastest_draft: FormatTiming | None = None
        self.draft_views: dict[str, Executor] = {}

    # ---------------------------------------------------------------- formats and kernels
    def set_bulk(self, bulk: str = "auto", rows: str | None = None) -> ComputeFormats:
        """Choose the bulk format (``"auto"``, ``"weights"``, ``"bf16"``, ``"fp16"`` or
        ``"fp32"``; see :func:`selfspec.executor.cpu.choose_formats`) and, given ``rows``, the
        decoding kernel (``None`` keeps the current one); set the executor's ``formats`` and
        return them. The decoding kernel's backend is
        :func:`selfspec.executor.backends.select_backend` of the executor's device and
        ``formats.rows``; each matrix prepacks its copy once; a kernel switch drops the
        executor's fused sub-layers (rebuilt at their next use).

        Raises:
            InvalidArgumentError: an unknown format.
        """
        ex = self.executor
        if rows is None:
            rows = self.rows_request
        largest = max((lin.weight.numel() * lin.weight.element_size()
                       for w in ex.layer_weights for lin in w.matrices), default=None)
        formats = choose_formats(ex.dtype, ex.device, bulk, rows, largest)
        if formats.rows in GGUF_ROWS and not self.backends.has("gguf"):
            self.attach_gguf()
        self.bulk_request, self.rows_request = bulk, rows
        previous = self.formats
        changed = previous is None or (
            (formats.rows, formats.rows_min_bytes) != (previous.rows, previous.rows_min_bytes))
        if changed:
            self.backend = self.backends.get(formats.rows, formats.rows_min_bytes)
            ex._fused = []
        matrices = [lin for w in ex.layer_weights for lin in w.matrices]
        matrices.append(ex.output_weights)
        assign(matrices, formats.bulk if formats.upcast else None, self.backend, changed)
        self.formats = ex.formats = formats
        return formats

    def attach_gguf(self) -> None:
        """Read the GGUF file's blocks, check them against the model's weights, keep the
        ``"gguf"`` backends (:mod:`selfspec.executor.gguf_backend`) and set the executor's
        ``gguf_weights``.

        Raises:
            InvalidArgumentError: no GGUF file is known for this model.
            CorruptModelFileError, UnsupportedArchitectureError: see
                :func:`selfspec.models.gguf_weights.read_gguf_weights` and
                :func:`~selfspec.models.gguf_weights.check_against_model`.
        """
        from selfspec.executor.gguf_backend import GgufRows, gguf_copies
        from selfspec.models.gguf_weights import check_against_model, read_gguf_weights

        ex = self.executor
        source = self.gguf_source
        if source is None:
            raise InvalidArgumentError(
                f"{ex.name}: decoding on GGUF blocks needs the GGUF file the model was "
                "converted from; load a registry model or a local .gguf file (--model "
                "FILE.gguf) with --dtype gguf")
        path = Path(source() if callable(source) else source)
        weights = read_gguf_weights(path, ex.config)
        check_against_model(weights, ex.model)
        copies = gguf_copies(ex.layer_weights, ex.output_weights, weights)
        # Both kernels share the blocks (one GgufMatrix per matrix); they differ in where
        # bulk calls (prefill) run.
        self.backends.provide("gguf", GgufRows(copies))
        self.backends.provide("gguf+dense", GgufRows(copies, prefill="dense"))
        ex.gguf_weights = weights

    def set_decode_kernel(self, rows: str) -> str:
        """Switch the decoding kernel (as :meth:`set_bulk`'s ``rows``), keeping the bulk
        format; return the previous request, to switch back. A kernel's weight copies are
        built at its first use and kept, so switching back and forth costs nothing after that
        (the benchmark runs ``ar`` on bf16 and on int4 weights in one run this way).

        Raises:
            InvalidArgumentError: an unknown kernel or one unavailable here.
        """
        previous = self.rows_request
        self.set_bulk(self.bulk_request, rows)
        return previous

    @property
    def fp16_rows(self) -> Fp16Rows | None:
        """The fp16-weight decoding kernel in use, or ``None``."""
        return self.backend if isinstance(self.backend, Fp16Rows) else None

    # ---------------------------------------------------------------- draft views
    def draft_view(self, fmt: str) -> Executor:
        """The executor on quantized copies of every decoder layer's linears and of
        ``lm_head`` (``fmt="auto"``: the format :meth:`fastest_draft_format` measures fastest
        here), for drafting only: everything else (embedding, norms, RoPE, the KV cache
        layout) is shared, and its KV writes are meant to be dropped (verification recomputes
        them with the full weights). Built once per format and kept (one extra quantized copy
        of the weights: about 1/2 for int8, 1/4 for int4). A view has its own
        :class:`WeightFormats` (no views of its own, the same kept backends), its own fused
        sub-layers and no CUDA graphs (graphs capture the full weights).

        Raises:
            InvalidArgumentError: an unknown format or one without a kernel here
                (:func:`selfspec.executor.quant.check_draft_weights`).
        """
        from selfspec.executor.quant import check_draft_weights

        ex = self.executor
        if fmt == "auto":
            fmt = self.fastest_draft_format().fastest
        fmt = check_draft_weights(fmt, ex.device)
        view = self.draft_views.get(fmt)
        if view is None:
            copies = draft_copies(ex.layer_weights, ex.output_weights, fmt)
            view = copy.copy(ex)
            view.layer_weights = copies.layers
            view.output_weights = copies.lm_head
            view.draft_weights = fmt
            view._weight_formats = self._for_view(view)
            view._fused = []
            view.graphs = None
            self.draft_views[fmt] = view
        return view

    def _for_view(self, view: Executor) -> WeightFormats:
        """A copy of this state for a draft view: the same requests, backend, kept backends
        and measured timing, no draft views."""
        mine = copy.copy(self)
        mine.executor = view
        mine.draft_views = {}
        return mine

    def fastest_draft_format(self) -> FormatTiming:
        """The draft weight format whose one-row products run fastest for this model on this
        machine (:func:`selfspec.executor.quant.fastest_format` over two of its layers'
        linears, a second or two), measured once.

        Raises:
            InvalidArgumentError: no quantized kernel in this torch build.
        """
        from selfspec.executor.quant import fastest_format

        if self.fastest_draft is None:
            ex = self.executor
            sample = {0, ex.num_layers // 2}
            weights = [(lin.weight, lin.bias) for i in sorted(sample)
                       for lin in ex.layer_weights[i].matrices]
            self.fastest_draft = fastest_format(weights, ex.dtype, device=ex.device)
            logger.info("draft weights: %s fastest here (%s)", self.fastest_draft.fastest,
                        ", ".join(f"{k} {v:.2f} ms" for k, v in self.fastest_draft.ms.items()))
        return self.fastest_draft
