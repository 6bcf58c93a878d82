"""`ParamSpec`: what a weight's declaration says (shape letters, logical axes, initialiser), read from the
metadata of its `nnx.Param` (`jaxrl.model.modules.param_specs`); from it shardings, byte counts and
restore targets are derived without JAX arrays or Flax."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight: its shape letters, logical axis names (one per letter) and initialiser.

    `init` is "normal" (std 0.02, as HF's `initializer_range`), "ones" or "zeros".
    """

    letters: str
    axes: tuple[str | None, ...]
    init: str = "normal"

    def shape(self, dims: dict[str, int]) -> tuple[int, ...]:
        return tuple(dims[c] for c in self.letters)


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)
