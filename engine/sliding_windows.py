"""Which layers attend through a sliding window, read from a Hugging Face config.

A window of W tokens means the query at position p sees keys j with p - W < j <= p
(transformers' sliding-window mask). The model, the cost model and the KV budget read the same
per-layer tuple, so attention, the meter and block freeing agree on what a layer sees.
"""

from __future__ import annotations

from typing import Any


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """One entry per decoder layer: its window in tokens, or None for full attention.

    Configs with `layer_types` (Gemma 2/3, Qwen2/3 in transformers 5) name each layer;
    the others (Mistral, Mixtral, Phi-3, Qwen3-MoE) apply `sliding_window` to every layer
    when it is set, as their transformers modelling code does.
    """
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(
            window if kind == "sliding_attention" and window is not None else None
            for kind in layer_types[:num_layers]
        )
    return (window,) * num_layers


def uniform_window(windows: tuple[int | None, ...]) -> int | None:
    """The window every layer shares, or None when some layer sees the whole context (then
    no cache block may be freed before its request finishes)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)  # type: ignore[type-var]


def first_visible_key(position: int, window: int | None) -> int:
    """The first key position the query at `position` sees (0 without a window)."""
    return 0 if window is None else max(0, position - window + 1)
