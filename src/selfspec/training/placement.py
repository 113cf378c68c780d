"""Where exit heads go: DSSD's uniform placement (eq. 1) and layer validation.

A head's ``layer`` follows the glossary's ``exit_layer`` convention: it is the number of
decoder layers run, i.e. the head reads the hidden state leaving layer ``layer - 1``
(0-based), after layers ``[0, layer)``.
"""

from __future__ import annotations

from collections.abc import Iterable

from selfspec.errors import InvalidArgumentError

DEFAULT_NUM_HEADS = 4  # DSSD §3.2: "In our experiments we set K = 4".


def default_layers(num_layers: int, num_heads: int = DEFAULT_NUM_HEADS) -> list[int]:
    """DSSD eq. (1): ``ℓ_k = ⌊k·L / (K+1)⌋`` for ``k = 1..K`` (DSSD §3.2).

    Args:
        num_layers: ``L``, decoder layers of the model (>= 2).
        num_heads: ``K`` >= 1.

    Returns:
        Distinct increasing layers in ``[1, L-1]`` (duplicates from rounding on very shallow
        models are dropped).

    Raises:
        InvalidArgumentError: ``num_layers < 2`` or ``num_heads < 1``.
    """
    if num_layers < 2:
        raise InvalidArgumentError(f"exit heads need a model with >= 2 layers, got {num_layers}")
    if num_heads < 1:
        raise InvalidArgumentError(f"the number of heads must be >= 1, got {num_heads}")
    layers = [(k * num_layers) // (num_heads + 1) for k in range(1, num_heads + 1)]
    return sorted({layer for layer in layers if 1 <= layer <= num_layers - 1})


def check_layers(layers: Iterable[int], num_layers: int) -> list[int]:
    """Validate head layers and return them sorted.

    Raises:
        InvalidArgumentError: empty list, a duplicate, a non-integer, or a layer outside
            ``[1, L-1]`` (a head after the last layer would duplicate ``lm_head``).
    """
    values = list(layers)
    if not values:
        raise InvalidArgumentError("give at least one head layer")
    for layer in values:
        if (isinstance(layer, bool) or not isinstance(layer, int)
                or not 1 <= layer <= num_layers - 1):
            raise InvalidArgumentError(
                f"head layer {layer!r} is outside [1, {num_layers - 1}] "
                f"for this {num_layers}-layer "
                "model (a head at layer l reads the hidden state after layers [0, l))")
    if len(set(values)) != len(values):
        raise InvalidArgumentError(f"head layers must be distinct, got {values}")
    return sorted(values)
