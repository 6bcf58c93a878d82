"""What every TOML table of the run config shares: unknown keys are errors, TOML types are not coerced,
and numbers stay within what the device takes (int32, finite float32)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

INT_MAX = 2**31 - 1
"""Largest integer any field takes: counts, steps, token lengths and seeds reach the device as int32."""
FLOAT_MAX = 3.4028234663852886e38
"""Largest float any field takes (float32's): sampling settings reach the device as float32."""


class _Table(BaseModel):
    """Base of every TOML table: unknown keys are errors and TOML types are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _fits_the_device(cls, value: Any) -> Any:
        """Integers within int32 and floats within float32 (TOML integers are unbounded, and inf and nan
        are refused by `allow_inf_nan`): a value past them would overflow where the run uses it."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_MAX:
            raise ValueError(f"{value} is beyond {INT_MAX} (2**31 - 1), the largest integer jaxrl takes")
        if isinstance(value, float) and abs(value) > FLOAT_MAX:
            raise ValueError(f"{value} is beyond float32's range ({FLOAT_MAX:.4g})")
        return value
