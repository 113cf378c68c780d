"""One description of a decoder's architecture, read from its Hugging Face config: every
feature the executor computes, named once, so that the executor's paths read the features
instead of testing ``model_type``.

:func:`describe` maps a config onto :class:`Architecture` and refuses, with one error naming
the feature, whatever selfspec cannot compute yet. The maths of each feature is the
transformers 5.x modeling file of its family (``modeling_<family>.py``): docs/models.md lists
the families, their features and how each is tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from selfspec.errors import UnsupportedArchitectureError

#: Norm kinds: ``"rms"`` = Llama's ``w · x̂.to(dtype)``; ``"rms_weight_fp32"`` = OLMo 2's
#: ``(w · x̂).to(dtype)`` (the weight multiplied before the cast back); ``"rms_offset"`` =
#: Gemma's ``(x̂ · (1 + w)).to(dtype)``, all in float32 (modeling_gemma3.Gemma3RMSNorm).
#: ``"layer"`` = LayerNorm with a bias, ``w · (x - mean) / sqrt(var + eps) + b`` (GPT-NeoX's
#: ``nn.LayerNorm``, ``layer_norm_eps``).
NORM_KINDS = ("rms", "rms_weight_fp32", "rms_offset", "layer")
#: Where a layer's norms sit: ``"pre"`` = before each sub-layer (Llama); ``"post"`` = on each
#: sub-layer's output before the residual add (OLMo 2); ``"both"`` = the two of them, four
#: norms a layer (Gemma 3: input, post_attention, pre_feedforward, post_feedforward).
NORM_PLACEMENTS = ("pre", "post", "both")
#: q/k norms: ``"none"``; ``"head"`` = RMSNorm over each head's ``head_dim`` (Qwen3);
#: ``"projection"`` = over the whole q / k projection (OLMo 2). Both before RoPE.
QK_NORMS = ("none", "head", "projection")


@dataclass(frozen=True)
class ModuleNames:
    """Where a ``*ForCausalLM``'s parts are, by attribute name: ``model.<base>.layers``,
    ``model.<base>.<embed>``, ``model.<base>.<norm>`` (the final norm),
    ``model.<base>.rotary_emb``, ``model.lm_head`` and each layer's ``<attention>`` module."""

    base: str = "model"
    embed: str = "embed_tokens"
    norm: str = "norm"
    attention: str = "self_attn"


#: Llama's names (every family but GPT-NeoX).
LLAMA_MODULES = ModuleNames()
#: transformers' modeling_gpt_neox: ``gpt_neox.embed_in``, ``gpt_neox.final_layer_norm``,
#: ``layers[i].attention`` (its checkpoint's ``embed_out`` is loaded as ``lm_head``).
GPT_NEOX_MODULES = ModuleNames(base="gpt_neox", embed="embed_in", norm="final_layer_norm",
                               attention="attention")


@dataclass(frozen=True)
class Family:
    """What a ``model_type`` fixes (the rest comes from its config's fields)."""

    norm_kind: str = "rms"
    norm_placement: str = "pre"
    qk_norm: str = "none"
    multipliers: bool = False  # Granite's embedding/residual/attention/logits multipliers
    # Phi-3's checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``.
    checkpoint_fused: bool = False
    # One ``sliding_window`` on every layer whenever it is set (Mistral, Phi-3: their modeling
    # files build a sliding-window mask from it alone, without ``use_sliding_window``).
    window_when_set: bool = False
    # Gemma 3: one RoPE table per layer type (rope_parameters[layer_type]: the sliding layers'
    # local base), embeddings times sqrt(hidden_size), query_pre_attn_scalar, softcaps.
    gemma: bool = False
    # A multimodal checkpoint whose language model (config.text_config) runs on text alone.
    text_config: bool = False
    modules: ModuleNames = LLAMA_MODULES
    # GPT-NeoX's ``query_key_value`` holds each head's q, k, v rows in turn
    # ([h0 q, h0 k, h0 v, h1 q, ...]), reordered at load into q, k, v blocks.
    qkv_interleaved: bool = False
    # ``down(act(gate) · up)``; False: ``down(act(up))`` (GPT-NeoX's dense_h_to_4h / _4h_to_h).
    gated_mlp: bool = True


#: The MLP activations the fused sub-layer kernels compute (selfspec.executor.fused_layers
#: .ACTIVATIONS): SiLU and PyTorch's tanh-approximated GELU (Gemma 3's hidden_activation).
FUSED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

#: The families the executor drives, by ``model_type``.
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm="head"),
    "mistral": Family(window_when_set=True),
    "granite": Family(multipliers=True),
    "olmo2": Family(norm_kind="rms_weight_fp32", norm_placement="post", qk_norm="projection"),
    "smollm3": Family(),
    "phi3": Family(checkpoint_fused=True, window_when_set=True),
    "gemma3_text": Family(norm_kind="rms_offset", norm_placement="both", qk_norm="head",
                          gemma=True),
    "gemma3": Family(text_config=True),  # Gemma3ForConditionalGeneration's language model
    # Pythia: LayerNorm, interleaved fused qkv, plain GELU MLP, biases, rotary_pct 0.25;
    # use_parallel_residual is read from the config.
    "gpt_neox": Family(norm_kind="layer", modules=GPT_NEOX_MODULES, qkv_interleaved=True,
                       gated_mlp=False),
}

#: RoPE scaling kinds refused, and why (the rest the model's own rotary module computes).
REFUSED_ROPE: dict[str, str] = {
    "longrope": ("its frequencies switch between the short and long factors by the largest "
                 "position of each call (transformers' longrope_frequency_update), so a "
                 "prefill, a verification block and one-token decoding at the same position "
                 "can rotate differently, and selfspec's RoPE table cannot match transformers"),
}


def family_paths() -> str:
    """One line for ``selfspec info``: which families' layers the fused sub-layer kernels
    compute and which decode on the torch path, and why (from :data:`FAMILIES`; a config's
    own features can add reasons: :meth:`Architecture.fused_reason`)."""
    fused, torch_path = [], []
    for name, fam in FAMILIES.items():
        if fam.text_config:  # its language model's family says
            fused.append(f"{name} (as its text model)")
            continue
        why = [w for w, on in (("q/k norms over each projection", fam.qk_norm == "projection"),
                               ("post-norms without pre-norms", fam.norm_placement == "post"),
                               ("multipliers", fam.multipliers),
                               ("LayerNorm", fam.norm_kind == "layer"),
                               ("plain GELU MLP", not fam.gated_mlp)) if on]
        if why:
            torch_path.append(f"{name} ({', '.join(why)})")
        else:
            fused.append(name)
    return (f"fused sub-layer kernels (bf16 / w4a8 / gguf): {', '.join(fused)} (qwen3 and "
            "gemma3_text with their q/k head norms; gemma3_text's four (1 + w) norms, "
            "GELU-tanh MLP, sliding windows and local RoPE base; SmolLM3 only where every "
            "layer has RoPE; phi3's qkv_proj / gate_up_proj split at load, only where RoPE "
            "spans the whole head: partial_rotary_factor < 1, Phi-4-mini's, runs the torch "
            f"path); torch path: {', '.join(torch_path)} (gpt_neox's query_key_value "
            "reordered at load; a parallel residual where use_parallel_residual, partial "
            "rotary where rotary_pct < 1)")

#: Families refused on purpose, with what to use instead.
REFUSED: dict[str, str] = {
    "qwen3_moe": "mixture-of-experts layers are not supported; use a dense Qwen3",
    "mixtral": "mixture-of-experts layers are not supported; use Mistral (dense)",
    "qwen3_next": "hybrid linear attention is not supported; use a dense Qwen3",
    "granitemoehybrid": "hybrid Mamba attention is not supported; use Granite 3 (dense)",
    "lfm2": "hybrid convolution layers are not supported",
}


@dataclass(frozen=True)
class Architecture:
    """The features of one decoder, as the executor computes them.

    Attributes:
        model_type: the config's ``model_type``.
        num_layers: ``L``.
        norm_kind: one of :data:`NORM_KINDS` (every norm of the model).
        norm_placement: one of :data:`NORM_PLACEMENTS`.
        qk_norm: one of :data:`QK_NORMS`.
        activation: ``config.hidden_act`` (the MLP is gated: ``down(act(gate) · up)``).
        rope_layers: ``[L]`` whether layer ``i`` applies RoPE (SmolLM3's ``no_rope_layers``
            turns it off on some).
        sliding_window: per layer, the attention window ``W`` in positions (a query at
            ``p`` sees keys ``p - W < k <= p``, transformers' ``sliding_window_causal``), or
            ``None`` for full attention; a window at least ``max_position_embeddings`` long
            never binds and is ``None``.
        attention_scale: the softmax scale (``head_dim ** -0.5``; Granite's
            ``attention_multiplier``).
        embedding_multiplier: the token embeddings are multiplied by it (Granite; else 1).
        residual_multiplier: each sub-layer's output is multiplied by it before the residual
            add (Granite; else 1).
        logits_divisor: the logits are divided by it (Granite's ``logits_scaling``; else 1).
        tied_embeddings: ``lm_head`` shares the embedding matrix.
        rope_type: the RoPE scaling kind (``"default"``, ``"llama3"``, ``"yarn"``, ...), which
            the model's own rotary module computes (:data:`REFUSED_ROPE`: refused).
        rotary_fraction: RoPE rotates the first ``int(head_dim · rotary_fraction)`` dims of
            each head and passes the rest through (``partial_rotary_factor``, Phi-4-mini's
            0.75; transformers' modeling_phi3.apply_rotary_pos_emb); 1 = the whole head.
        checkpoint_fused: the checkpoint holds q/k/v as one ``qkv_proj`` and gate/up as one
            ``gate_up_proj`` (Phi-3), split at load into the usual projections
            (:func:`selfspec.executor.weights.split_checkpoint_fused`).
        rope_kinds: per layer, the RoPE table it reads: ``"default"`` (one table), or its
            layer type where the config has ``rope_parameters`` per layer type (Gemma 3:
            ``sliding_attention`` layers rotate with the local base, 10,000).
        embedding_scale: the token embeddings are multiplied by it, cast to the weights'
            dtype first (Gemma's ``sqrt(hidden_size)``, Gemma3TextScaledWordEmbedding); 1.
        final_softcap: logits become ``c · tanh(logits / c)`` (``final_logit_softcapping``),
            or ``None``.
        modules: where the model's parts are (:class:`ModuleNames`).
        qkv_interleaved: one ``query_key_value`` matrix with each head's q, k, v rows in
            turn (GPT-NeoX), reordered at load into q, k, v blocks
            (:func:`selfspec.executor.weights.gpt_neox_layer_weights`).
        gated_mlp: the MLP is ``down(act(gate) · up)``; ``False``: ``down(act(up))`` with
            biases (GPT-NeoX).
        parallel_residual: attention and MLP both read the layer's input and their outputs
            are added to it together, ``x + (mlp(ln2(x)) + attn(ln1(x)))``
            (``use_parallel_residual``: Pythia, GPT-NeoX-20B); ``False``: one after the other.
    """

    model_type: str
    num_layers: int
    norm_kind: str
    norm_placement: str
    qk_norm: str
    activation: str
    rope_layers: tuple[bool, ...]
    sliding_window: tuple[int | None, ...]
    attention_scale: float
    embedding_multiplier: float
    residual_multiplier: float
    logits_divisor: float
    tied_embeddings: bool
    rope_type: str
    rotary_fraction: float
    checkpoint_fused: bool
    rope_kinds: tuple[str, ...] = ()
    embedding_scale: float = 1.0
    final_softcap: float | None = None
    modules: ModuleNames = LLAMA_MODULES
    qkv_interleaved: bool = False
    gated_mlp: bool = True
    parallel_residual: bool = False

    @property
    def plain(self) -> bool:
        """Llama's layer: pre-norms, no q/k norms, RoPE on every layer, no multipliers (the
        fused sub-layer kernels compute more: :meth:`fused_reason`)."""
        return self.unplain_features() == []

    def unplain_features(self) -> list[str]:
        """The features that make this architecture other than Llama's layer, by name."""
        out = []
        if self.norm_kind != "rms":
            out.append(f"norm kind {self.norm_kind}")
        if self.norm_placement != "pre":
            out.append(f"{self.norm_placement}-norms")
        if self.qk_norm != "none":
            out.append(f"q/k norms over each {self.qk_norm}")
        if not all(self.rope_layers):
            out.append("layers without RoPE")
        if self.rotary_fraction != 1.0:
            out.append(f"partial rotary (partial_rotary_factor {self.rotary_fraction})")
        if self.residual_multiplier != 1.0:
            out.append("a residual multiplier")
        windows = sorted({w for w in self.sliding_window if w is not None})
        if windows:
            out.append(f"sliding window {windows[0]}")
        if any(kind != "default" for kind in self.rope_kinds):
            out.append("a RoPE table per layer type")
        if not self.gated_mlp:
            out.append("a plain (non-gated) MLP")
        if self.parallel_residual:
            out.append("parallel attention + MLP residual (use_parallel_residual)")
        return out

    def unfused_features(self) -> list[str]:
        """The features the fused sub-layer kernels do not compute, by name (they compute
        Llama's layer and what Qwen3 and Gemma 3 add: per-head q/k norms, post-norms after
        pre-norms, ``(1 + w)`` norms, sliding windows, a RoPE table per layer type, any
        attention scale, SiLU or GELU-tanh; :func:`selfspec.executor.backends
        .fused_layer_reason` checks the same on each layer's weights)."""
        out = []
        if self.norm_kind == "layer":
            out.append("norm kind layer (LayerNorm)")
        if self.norm_placement == "post":
            out.append("post-norms without pre-norms")
        if self.qk_norm == "projection":
            out.append("q/k norms over each projection")
        if not all(self.rope_layers):
            out.append("layers without RoPE")
        if self.rotary_fraction != 1.0:
            out.append(f"partial rotary (partial_rotary_factor {self.rotary_fraction})")
        if self.residual_multiplier != 1.0:
            out.append("a residual multiplier")
        if not self.gated_mlp:
            out.append("a plain (non-gated) MLP")
        if self.parallel_residual:
            out.append("parallel attention + MLP residual (use_parallel_residual)")
        if self.activation not in FUSED_ACTIVATIONS:
            out.append(f"activation {self.activation}")
        return out

    def fused_reason(self) -> str | None:
        """Why the fused sub-layer kernels cannot run these layers (:meth:`unfused_features`),
        or ``None`` when they can."""
        features = self.unfused_features()
        if not features:
            return None
        return (f"{self.model_type} layers have {', '.join(features)}, which the fused "
                "sub-layer kernels do not compute: decoding runs the torch path")


def _sliding_windows(config: Any, num_layers: int, family: Family) -> list[int | None]:
    """Each layer's attention window (``None``: full attention) as transformers applies it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if family.window_when_set:
        return [window] * num_layers
    if getattr(config, "use_sliding_window", False):
        return [window] * num_layers
    return [None] * num_layers


def _binding_windows(windows: list[int | None], config: Any, source: str) -> list[int | None]:
    """The windows that can bind (shorter than ``max_position_embeddings``; a longer one
    never does: ``None``).

    Raises:
        UnsupportedArchitectureError: an attention layer type other than full or sliding.
    """
    for kind in getattr(config, "layer_types", None) or ():
        if kind not in ("full_attention", "sliding_attention"):
            raise UnsupportedArchitectureError(
                f"{source}: attention layer type {kind!r} is not supported yet")
    context = int(config.max_position_embeddings)
    return [w if w is not None and int(w) < context else None for w in windows]


def _rope_kinds(config: Any, num_layers: int, family: Family) -> tuple[str, ...]:
    """Each layer's RoPE table: its layer type where Gemma 3's rotary module keeps one table
    per layer type (``rope_parameters[layer_type]``), else ``"default"``."""
    if not family.gemma:
        return ("default",) * num_layers
    return tuple(str(kind) for kind in config.layer_types[:num_layers])


def _gemma_features(config: Any, source: str) -> dict:
    """Gemma 3's attention scale, embedding scale and final softcap.

    Raises:
        UnsupportedArchitectureError: an attention logit softcap (SDPA cannot apply it;
            Gemma 3's is None) or bidirectional attention.
    """
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedArchitectureError(
            f"{source}: attn_logit_softcapping is not supported (selfspec's attention is "
            "SDPA, which has no score softcap; Gemma 3 checkpoints leave it null)")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(
            f"{source}: use_bidirectional_attention is not supported (decoding is causal)")
    cap = getattr(config, "final_logit_softcapping", None)
    return {"attention_scale": float(config.query_pre_attn_scalar) ** -0.5,
            "embedding_scale": float(config.hidden_size) ** 0.5,
            "final_softcap": None if cap is None else float(cap)}


def _rope_params(config: Any) -> dict:
    """``rope_parameters`` (transformers 5) or ``rope_scaling`` (before), ``{}`` if neither."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (Gemma 3)
        params = params["full_attention"]
    return params if isinstance(params, dict) else {}


def _rope_type(config: Any, source: str) -> str:
    """The RoPE scaling kind.

    Raises:
        UnsupportedArchitectureError: a kind in :data:`REFUSED_ROPE`.
    """
    params = _rope_params(config)
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind in REFUSED_ROPE:
        raise UnsupportedArchitectureError(
            f"{source}: RoPE scaling {kind!r} is not supported: {REFUSED_ROPE[kind]}")
    return kind


def _rotary_fraction(config: Any) -> float:
    """``partial_rotary_factor`` (in ``rope_parameters`` in transformers 5, on the config
    before), 1.0 when absent."""
    factor = _rope_params(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    return 1.0 if factor is None else float(factor)


def _check_rotary(head_dim: int, fraction: float, source: str) -> None:
    """Refuse a partial rotary over an odd number of dims (``rotate_half`` pairs dim ``j``
    with ``j + rotary_dim / 2``: transformers' own modules would mis-rotate it).

    Raises:
        UnsupportedArchitectureError: ``int(head_dim · fraction)`` is odd or 0.
    """
    dims = int(head_dim * fraction)
    if dims % 2 or dims == 0:
        raise UnsupportedArchitectureError(
            f"{source}: partial rotary over {dims} of {head_dim} dims per head "
            f"(rotary_pct / partial_rotary_factor {fraction}) is not supported: RoPE needs an "
            "even, non-zero number of rotary dims")


def check_model_type(model_type: str | None, source: str) -> Family:
    """The :class:`Family` of ``model_type``.

    Raises:
        UnsupportedArchitectureError: a ``model_type`` not in :data:`FAMILIES` (a refused
            one's message says what to use instead).
    """
    family = FAMILIES.get(str(model_type))
    if family is not None:
        return family
    why = REFUSED.get(str(model_type), "selfspec does not drive this architecture yet")
    raise UnsupportedArchitectureError(
        f"{source} has model_type {model_type!r}: {why}. selfspec supports "
        f"{', '.join(FAMILIES)} (`selfspec models list` shows ready ones).")


def describe(config: Any, source: str = "the model") -> Architecture:
    """The :class:`Architecture` of a Hugging Face config.

    Raises:
        UnsupportedArchitectureError: an unsupported ``model_type`` (:func:`check_model_type`),
            an attention layer type other than full or sliding, Gemma's attention logit
            softcap or bidirectional attention, a RoPE scaling kind in :data:`REFUSED_ROPE`
            (``longrope``), or attention / MLP biases where the family has none; the message
            names the feature.
    """
    family = check_model_type(config.model_type, source)
    if family.text_config:  # a multimodal checkpoint: its language model, on text
        return describe(config.get_text_config(), source)
    num_layers = int(config.num_hidden_layers)
    windows = _binding_windows(_sliding_windows(config, num_layers, family), config, source)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 1 = RoPE, 0 = none
    rope_layers = (tuple(bool(x) for x in no_rope[:num_layers]) if no_rope is not None
                   else (True,) * num_layers)
    multipliers = family.multipliers
    gemma = _gemma_features(config, source) if family.gemma else {}
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act",
                                                                       "silu")
    _check_rotary(head_dim, _rotary_fraction(config), source)
    return Architecture(
        model_type=config.model_type,
        num_layers=num_layers,
        norm_kind=family.norm_kind,
        norm_placement=family.norm_placement,
        qk_norm=family.qk_norm,
        activation=str(activation),
        rope_layers=rope_layers,
        sliding_window=tuple(windows),
        attention_scale=gemma.get("attention_scale", (
            float(config.attention_multiplier) if multipliers else float(head_dim) ** -0.5)),
        embedding_multiplier=float(config.embedding_multiplier) if multipliers else 1.0,
        residual_multiplier=float(config.residual_multiplier) if multipliers else 1.0,
        logits_divisor=float(config.logits_scaling) if multipliers else 1.0,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rope_type=_rope_type(config, source),
        rotary_fraction=_rotary_fraction(config),
        checkpoint_fused=family.checkpoint_fused,
        rope_kinds=_rope_kinds(config, num_layers, family),
        embedding_scale=gemma.get("embedding_scale", 1.0),
        final_softcap=gemma.get("final_softcap"),
        modules=family.modules,
        qkv_interleaved=family.qkv_interleaved,
        gated_mlp=family.gated_mlp,
        parallel_residual=bool(getattr(config, "use_parallel_residual", False)),
    )


@dataclass(frozen=True)
class DecoderModules:
    """The HF modules the executor drives (see :class:`ModuleNames`)."""

    layers: list[Any]      # the decoder layers
    embed: Any             # [B, T] int64 -> [B, T, H]
    norm: Any              # the final norm, [..., H] -> [..., H]
    rotary_emb: Any        # rotary_emb(x, position_ids) -> (cos, sin)
    lm_head: Any           # [..., H] -> [..., V]


def decoder_modules(model: Any, arch: Architecture) -> DecoderModules:
    """The parts of ``model`` (a ``*ForCausalLM``) where ``arch.modules`` names them."""
    names = arch.modules
    base = getattr(model, names.base)
    # A multimodal checkpoint (Gemma3ForConditionalGeneration): its language model, on text.
    base = getattr(base, "language_model", base)
    return DecoderModules(list(base.layers), getattr(base, names.embed),
                          getattr(base, names.norm), base.rotary_emb, model.lm_head)
