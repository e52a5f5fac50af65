"""The ``loss_fn_config`` each built-in loss takes, and its defaults. Free of torch, so that the
web process checks a request's config when it arrives (a 400), not when a worker runs it."""

from __future__ import annotations

import math
from collections.abc import Mapping

LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    "stable_reinforce": {"kl_coeff": 0.0, "ratio_cap": 2.0},
}


def loss_config(loss: str, config: Mapping[str, object] | None) -> dict[str, float]:
    """``config`` over ``loss``'s defaults; ValueError naming an unknown key or a value that
    is not a number."""
    defaults = LOSS_CONFIG_DEFAULTS.get(loss, {})
    given = dict(config or {})
    unknown = set(given) - set(defaults)
    if unknown:
        allowed = sorted(defaults) or "none"
        raise ValueError(
            f"loss {loss!r}: unknown loss_fn_config keys {sorted(unknown)}; allowed {allowed}"
        )
    merged: dict[str, float] = dict(defaults)
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ValueError(f"loss {loss!r}: loss_fn_config[{key!r}] must be a number")
        merged[key] = float(value)
    return merged
