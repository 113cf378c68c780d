"""A GGUF file's own quantized blocks, arranged as the executor multiplies a model's matrices.

``--dtype gguf`` decodes on the weights as published: every projection and ``lm_head`` is
multiplied from the GGUF's blocks (Q4_K, Q6_K, Q4_1, Q8_0, ...), not from the dense copy
transformers de-quantised them into (:mod:`selfspec.executor.gguf_rows` has the kernels).
:func:`read_gguf_weights` reads those blocks and maps them onto the HF model's layers:

* names: GGUF's ``blk.{i}.attn_q`` / ``attn_k`` / ``attn_v`` / ``attn_output`` /
  ``ffn_gate`` / ``ffn_up`` / ``ffn_down`` (``.weight``, and ``.bias`` where the model has
  one), ``output.weight`` or, for tied embeddings, ``token_embd.weight`` (gguf-py's
  ``TENSOR_NAMES``, as llama.cpp reads them);
* order: llama.cpp's converter permutes the rows of a ``llama`` model's q and k
  projections (``LlamaModel.permute``: its RoPE pairs dimension ``i`` with ``i + 1``, HF's
  with ``i + d/2``). Rows are independent in a GGUF tensor (blocks run along the input), so
  the HF order is those rows' bytes put back in place; ``qwen2`` is stored unpermuted;
* fused tensors: a ``gptneox`` file holds q/k/v as one ``attn_qkv`` (llama.cpp's
  ``GPTNeoXModel.modify_tensors`` reorders HF's per-head ``query_key_value`` rows into q, k, v
  blocks, the executor's order: the q, k and v segments are its row ranges) and a plain MLP
  (``ffn_up`` / ``ffn_down``, no ``ffn_gate``); LayerNorms, their biases and the linear
  biases are read from the dense model. A ``phi3`` file keeps HF's fused ``qkv_proj``
  (``attn_qkv``: q, k, v row blocks) and ``gate_up_proj`` (``ffn_up``: gate rows, then up
  rows, which llama.cpp's ``build_ffn`` splits in half for its SwiGLU);
* norms: never read from the file (a ``gemma3`` file stores Gemma's ``1 + w``, llama.cpp's
  ``Gemma3Model.modify_tensors``; transformers' ``Gemma2TensorProcessor`` subtracts the 1):
  the dense model's are used, and a ``gemma3`` file's q/k rows are unpermuted, its
  ``lm_head`` the tied ``token_embd``;
* a check (:func:`check_against_model`): sample rows of every matrix, de-quantised, must
  equal the loaded model's weights to their dtype's rounding, so a GGUF of another model,
  or a mapping gone wrong, is an error before any token, never different weights in silence.

Everything here is plain data (:class:`GgufTensor` rows of bytes); the executor turns it into
kernels. A truncated or damaged file is a :class:`~selfspec.errors.CorruptModelFileError`,
a tensor missing or of the wrong shape an :class:`~selfspec.errors.UnsupportedArchitectureError`,
each naming the tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from selfspec.errors import CorruptModelFileError, UnsupportedArchitectureError
from selfspec.models.architecture import describe
from selfspec.models.layouts import reorder_interleaved

logger = logging.getLogger(__name__)

#: GGUF architectures whose tensors map onto selfspec's layers, and whether llama.cpp's
#: converter permuted their q/k rows.
PERMUTED_QK: dict[str, bool] = {"llama": True, "qwen2": False, "qwen3": False,
                                 "gptneox": False, "gemma3": False, "phi3": False}


@dataclass(frozen=True)
class GgufTensor:
    """One GGUF matrix's rows of blocks, in the HF model's row order.

    Attributes:
        name: the GGUF tensor name (``blk.0.attn_q.weight``), for messages.
        type: its block type (``gguf.GGMLQuantizationType``).
        data: ``[rows, row_bytes]`` uint8, contiguous: row ``n`` holds output ``n``'s
            ``in_features / block_size`` blocks.
        in_features: ``K``, the inputs of a row.
    """

    name: str
    type: gguf.GGMLQuantizationType
    data: torch.Tensor
    in_features: int

    @property
    def rows(self) -> int:
        """``N``, the outputs (rows) of the tensor."""
        return int(self.data.shape[0])

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """``[rows, K]`` fp32: the weights these blocks stand for (gguf-py's reference)."""
        data = self.data if rows is None else self.data[rows]
        return torch.from_numpy(np.ascontiguousarray(
            gguf.quants.dequantize(data.numpy(), self.type), dtype=np.float32))


@dataclass(frozen=True)
class GgufLayer:
    """One decoder layer's matrices, in the executor's fused order
    (:data:`selfspec.executor.weights.MATRICES`).

    Attributes:
        qkv: ``(q, k, v)``: segments of the fused q/k/v product, in output order.
        o: the attention output projection.
        gate_up: ``(gate, up)``, or ``(up,)`` for a plain MLP (GPT-NeoX).
        down: the MLP's down projection.
        qkv_bias: ``[Nq + 2 Nkv]`` fp32 (the GGUF's own f32 biases), or ``None``.
    """

    qkv: tuple[GgufTensor, GgufTensor, GgufTensor]
    o: GgufTensor
    gate_up: tuple[GgufTensor, ...]
    down: GgufTensor
    qkv_bias: torch.Tensor | None


@dataclass(frozen=True)
class GgufWeights:
    """A model's matrices as a GGUF file stores them.

    Attributes:
        path: the file.
        arch: ``general.architecture``.
        layers: one :class:`GgufLayer` per decoder layer.
        output: ``lm_head`` (``output.weight``, or ``token_embd.weight`` when tied).
    """

    path: Path
    arch: str
    layers: list[GgufLayer]
    output: GgufTensor

    def types(self) -> dict[str, int]:
        """How many matrices of each block type (``{"Q4_K": 112, ...}``), for reports."""
        counts: dict[str, int] = {}
        for t in self.tensors():
            counts[t.type.name] = counts.get(t.type.name, 0) + 1
        return counts

    def tensors(self) -> list[GgufTensor]:
        """Every matrix, layer by layer, then ``lm_head``."""
        out = [t for layer in self.layers
               for t in (*layer.qkv, layer.o, *layer.gate_up, layer.down)]
        return [*out, self.output]

    @property
    def nbytes(self) -> int:
        """Bytes of all the matrices' blocks."""
        return sum(t.data.numel() for t in self.tensors())


class _TruncatedError(ValueError):
    """A tensor runs past the end of the file (raised before gguf-py maps it)."""


class _CheckedReader(gguf.GGUFReader):
    """gguf-py's reader, which first checks that every tensor lies inside the file, so a
    truncated file names the tensor cut off (gguf-py fails on a reshape of the short map)."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            try:
                qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                continue  # gguf-py names an unknown type itself
            end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise _TruncatedError(
                    f"tensor {bytes(name).decode('utf-8', 'replace')} ({qtype.name}) needs bytes "
                    f"up to {end}, the file has {size}")
        super()._build_tensors(start_offs, fields)


def open_reader(path: Path) -> gguf.GGUFReader:
    """``path`` parsed, every tensor checked to lie inside the file.

    Raises:
        CorruptModelFileError: unreadable, not a GGUF, or truncated (names the first tensor
            that runs past the end).
    """
    hint = "download the file again, or pass an intact .gguf"
    try:
        return _CheckedReader(path)
    except _TruncatedError as err:
        raise CorruptModelFileError(f"{path} is truncated: {err}: {hint}") from err
    except Exception as err:  # gguf-py raises ValueError/IndexError/struct errors alike
        raise CorruptModelFileError(f"{path} is not a readable GGUF file ({err}): {hint}") from err


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _qk_order(rows: int, heads: int) -> np.ndarray:
    """For each HF row, the GGUF row holding it, for a q or k matrix that llama.cpp's
    converter permuted with ``heads`` heads (``convert_hf_to_gguf.LlamaModel.permute``)."""
    stored = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)
    return np.argsort(stored)  # stored[j] = the HF row at GGUF row j


def _row_segments(whole: GgufTensor, rows: tuple[int, ...]) -> tuple[GgufTensor, ...]:
    """``whole``'s consecutive row ranges of ``rows`` rows each, as tensors of their own
    (views of its bytes: a GGUF tensor's rows are independent, blocks run along the input)."""
    parts, first = [], 0
    for n in rows:
        parts.append(GgufTensor(whole.name, whole.type, whole.data[first:first + n],
                                whole.in_features))
        first += n
    return tuple(parts)


def read_gguf_weights(path: str | Path, config: Any) -> GgufWeights:
    """The blocks of every projection and of ``lm_head`` of the model ``config`` describes,
    read from the GGUF ``path`` (copied into memory, rows in HF order).

    Args:
        path: a ``.gguf`` file.
        config: the HF model's config (``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``, ``hidden_size``, ``intermediate_size``).

    Raises:
        CorruptModelFileError: unreadable, not a GGUF, or truncated.
        UnsupportedArchitectureError: an architecture other than :data:`PERMUTED_QK`'s, a
            layer count that differs from the model's, or a tensor missing or of another shape
            than the model's (the message names it).
    """
    path = Path(path)
    reader = open_reader(path)
    arch = str(_field(reader, "general.architecture") or "")
    if arch not in PERMUTED_QK:
        raise UnsupportedArchitectureError(
            f"{path.name} holds a {arch or 'unnamed'!r} model; decoding on GGUF blocks supports "
            f"{', '.join(PERMUTED_QK)} GGUFs")
    blocks = _field(reader, f"{arch}.block_count")
    if blocks is not None and int(blocks) != config.num_hidden_layers:
        raise UnsupportedArchitectureError(
            f"{path.name} has {blocks} layers, the model {config.num_hidden_layers}: "
            "it is the GGUF "
            "of another model")
    by_name = {t.name: t for t in reader.tensors}
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads  # GPT-NeoX: no GQA
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    permuted = PERMUTED_QK[arch]
    gated = describe(config, path.name).gated_mlp

    def matrix(name: str, rows: int, cols: int, order_heads: int = 0) -> GgufTensor:
        t = by_name.get(name)
        if t is None:
            raise UnsupportedArchitectureError(
                f"{path.name} has no tensor {name}; decoding on its blocks needs every projection")
        # GGUF shapes are [K, N] (ne0 first); the data is [N, row_bytes].
        if [int(d) for d in t.shape] != [cols, rows]:
            raise UnsupportedArchitectureError(
                f"{path.name}: tensor {name} ({t.tensor_type.name}) has shape "
                f"{[int(d) for d in t.shape]}, the model needs [{cols}, {rows}]: it is the GGUF of "
                "another model")
        data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        if order_heads and permuted:
            data = data[_qk_order(rows, order_heads)]
        # A copy (np.array): the reader's arrays are read-only views of the mapped file.
        return GgufTensor(name, gguf.GGMLQuantizationType(int(t.tensor_type)),
                          torch.from_numpy(np.array(data, order="C")), cols)

    def bias(name: str, rows: int, order_heads: int = 0) -> torch.Tensor | None:
        t = by_name.get(name)
        if t is None:
            return None
        values = np.asarray(t.data, dtype=np.float32).reshape(-1)
        if values.shape[0] != rows:
            raise UnsupportedArchitectureError(
                f"{path.name}: tensor {name} has {values.shape[0]} values, the model needs {rows}")
        if order_heads and permuted:
            values = values[_qk_order(rows, order_heads)]
        return torch.from_numpy(np.array(values, order="C"))

    names = gguf.TENSOR_NAMES
    inter = config.intermediate_size
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    layers = []
    for i in range(config.num_hidden_layers):
        def name(kind: gguf.MODEL_TENSOR, suffix: str = "weight", i: int = i) -> str:
            return f"{names[kind].format(bid=i)}.{suffix}"

        T = gguf.MODEL_TENSOR
        if name(T.ATTN_QKV) in by_name:  # gptneox: one q/k/v tensor, q, k, v row blocks
            qkv = matrix(name(T.ATTN_QKV), q_rows + 2 * kv_rows, hidden)
            segments = _row_segments(qkv, (q_rows, kv_rows, kv_rows))
            qkv_bias = bias(name(T.ATTN_QKV, "bias"), q_rows + 2 * kv_rows)
        else:
            segments = (matrix(name(T.ATTN_Q), q_rows, hidden, heads),
                        matrix(name(T.ATTN_K), kv_rows, hidden, kv_heads),
                        matrix(name(T.ATTN_V), kv_rows, hidden))
            biases = [bias(name(T.ATTN_Q, "bias"), q_rows, heads),
                      bias(name(T.ATTN_K, "bias"), kv_rows, kv_heads),
                      bias(name(T.ATTN_V, "bias"), kv_rows)]
            qkv_bias = None
            if any(b is not None for b in biases):
                qkv_bias = torch.cat([b if b is not None else torch.zeros(n) for b, n in
                                      zip(biases, (q_rows, kv_rows, kv_rows))])
        if not gated:
            gate_up: tuple[GgufTensor, ...] = (matrix(name(T.FFN_UP), inter, hidden),)
        elif name(T.FFN_GATE) in by_name:
            gate_up = (matrix(name(T.FFN_GATE), inter, hidden),
                       matrix(name(T.FFN_UP), inter, hidden))
        else:  # phi3: ffn_up holds [gate; up] (HF's gate_up_proj rows, as llama.cpp keeps them)
            gate_up = _row_segments(matrix(name(T.FFN_UP), 2 * inter, hidden), (inter, inter))
        layers.append(GgufLayer(
            qkv=segments, o=matrix(name(T.ATTN_OUT), hidden, q_rows), gate_up=gate_up,
            down=matrix(name(T.FFN_DOWN), hidden, inter), qkv_bias=qkv_bias))
    vocab = config.vocab_size
    head_name = f"{names[gguf.MODEL_TENSOR.OUTPUT]}.weight"
    if head_name not in by_name:
        head_name = f"{names[gguf.MODEL_TENSOR.TOKEN_EMBD]}.weight"  # tied embeddings
    output = matrix(head_name, vocab, hidden)
    weights = GgufWeights(path, arch, layers, output)
    logger.info("%s: %s blocks (%.0f MiB of matrices: %s)", path.name, arch, weights.nbytes / 2**20,
                ", ".join(f"{k} {v}" for k, v in sorted(weights.types().items())))
    return weights


def _gpt_neox_pairs(layer: GgufLayer, hf: torch.nn.Module,
                    i: int) -> list[tuple[GgufTensor, torch.Tensor, str]]:
    """(GGUF segment, the HF weight it must equal, label) of GPT-NeoX layer ``i``: q, k, v
    against the row blocks of ``query_key_value`` in q, k, v order (the executor's
    ``InterleavedQKV``, marked ``qkv_blocks``, holds them so; an untouched module's per-head
    rows are reordered first)."""
    attn, mlp = hf.attention, hf.mlp
    qkv = attn.query_key_value
    weight = (qkv.weight if getattr(qkv, "qkv_blocks", False)
              else reorder_interleaved(qkv.weight, attn.config.num_attention_heads))
    label = f"gpt_neox.layers.{i}"
    blocks = weight.detach().split([t.rows for t in layer.qkv])
    out = [(t, w, f"{label}.attention.query_key_value.weight ({part} rows)")
           for t, w, part in zip(layer.qkv, blocks, "qkv", strict=True)]
    return [*out, (layer.o, attn.dense.weight, f"{label}.attention.dense.weight"),
            (layer.gate_up[0], mlp.dense_h_to_4h.weight, f"{label}.mlp.dense_h_to_4h.weight"),
            (layer.down, mlp.dense_4h_to_h.weight, f"{label}.mlp.dense_4h_to_h.weight")]


def check_against_model(weights: GgufWeights, model: torch.nn.Module, rows: int = 4) -> None:
    """Check that ``weights`` are the blocks ``model``'s weights were de-quantised from: the
    first and last ``rows`` rows of every matrix of the first, middle and last layers and of
    ``lm_head``, de-quantised, equal the model's to its dtype's rounding (one rounding of the
    de-quantised fp32 value; bf16: relative 2⁻⁸).

    Raises:
        UnsupportedArchitectureError: a matrix differs (the message names the GGUF tensor and
            the model's parameter): the GGUF is another model's (or another quantization of
            it), or the mapping is wrong.
    """
    n = len(weights.layers)
    pairs: list[tuple[GgufTensor, torch.Tensor, str]] = []
    arch = describe(model.config, weights.path.name)
    neox = arch.qkv_interleaved  # GPT-NeoX's own module names and fused query_key_value
    hf_layers = getattr(model, arch.modules.base).layers
    for i in sorted({0, n // 2, n - 1}):
        layer, hf = weights.layers[i], hf_layers[i]
        if neox:
            pairs.extend(_gpt_neox_pairs(layer, hf, i))
            continue
        attn, mlp = hf.self_attn, hf.mlp
        for t, lin, label in ((layer.qkv[0], attn.q_proj, "self_attn.q_proj"),
                              (layer.qkv[1], attn.k_proj, "self_attn.k_proj"),
                              (layer.qkv[2], attn.v_proj, "self_attn.v_proj"),
                              (layer.o, attn.o_proj, "self_attn.o_proj"),
                              (layer.gate_up[0], mlp.gate_proj, "mlp.gate_proj"),
                              (layer.gate_up[1], mlp.up_proj, "mlp.up_proj"),
                              (layer.down, mlp.down_proj, "mlp.down_proj")):
            pairs.append((t, lin.weight, f"model.layers.{i}.{label}.weight"))
    pairs.append((weights.output, model.lm_head.weight, "lm_head.weight"))
    for t, w, label in pairs:
        picks = sorted({*range(min(rows, t.rows)), *range(max(0, t.rows - rows), t.rows)})
        got = torch.cat([t.dequantize(slice(p, p + 1)) for p in picks])
        want = w.detach()[picks].float().cpu()
        # Both sides are one rounding of the same value: allow one unit of the model's dtype.
        eps = torch.finfo(w.dtype).eps if w.dtype.is_floating_point else 0.0
        tol = got.abs() * eps + 1e-6
        if not bool(((got.to(w.dtype).float() - want).abs() <= tol).all()):
            worst = float((got - want).abs().max())
            raise UnsupportedArchitectureError(
                f"{weights.path.name}: tensor {t.name} ({t.type.name}) differs from the model's "
                f"{label} (by up to {worst:.3g}): the GGUF holds other weights than the model "
                "(another model or another quantization of it); pass the GGUF the model was "
                "converted from")
