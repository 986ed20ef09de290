"""The value types of ds_config blocks (numbers, booleans, strings, dtype names, "auto") and the ``Block``
base every typed block derives from.

[Note: numbers] JSON configs write big integers as floats (`"reduce_bucket_size": 5e8`), which DeepSpeed
accepts, so integer fields take whole floats. Booleans are not numbers here (`"stage": true` is an error)
and strings are not numbers (`"stage": "3"` is an error). Integers must fit in 64 bits (|n| <= 2**63 - 1,
DeepSpeed's own "unbounded" default is `sys.maxsize`): a larger one is a typo, and torch could not hold it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

__all__ = [
    "INT_MAX",
    "Block",
    "Bool",
    "DtypeName",
    "Float",
    "Int",
    "IntOrAuto",
    "OptBool",
    "OptInt",
    "OptStr",
    "OptStrList",
    "Str",
    "StrList",
    "coerce_int",
    "normalize_dtype",
    "upper",
]


INT_MAX = 2**63 - 1
"""The largest integer a config may hold (see [Note: numbers])."""


def coerce_int(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("zs_type", "expected an integer")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise PydanticCustomError("zs_value", "expected an integer")
        value = int(value)
    if abs(value) > INT_MAX:
        raise PydanticCustomError("zs_value", f"expected an integer between -{INT_MAX} and {INT_MAX}")
    return value


def _float(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("zs_type", "expected a number")
    if not math.isfinite(value):
        raise PydanticCustomError("zs_value", "expected a finite number")
    return float(value)


def _bool(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise PydanticCustomError("zs_type", "expected true or false")


def upper(value: Any) -> Any:
    """Upper-cases strings before a choice check (DeepSpeed reads these settings case-insensitively)."""
    return value.upper() if isinstance(value, str) else value


def _str(value: Any) -> Any:
    if not isinstance(value, str):
        raise PydanticCustomError("zs_type", "expected a string")
    return value


def _str_list(value: Any) -> Any:
    # DeepSpeed's leaf_module accepts a single string where it expects a list of them.
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise PydanticCustomError("zs_type", "expected a list of strings")
    return list(dict.fromkeys(value))


Int = Annotated[int, BeforeValidator(coerce_int)]
"""An integer; whole floats such as 5e8 are accepted, see [Note: numbers]."""
Float = Annotated[float, BeforeValidator(_float)]
"""A finite number, stored as float."""
Bool = Annotated[bool, BeforeValidator(_bool)]
"""true or false (0 and 1 are accepted too, as DeepSpeed's pydantic blocks do)."""
Str = Annotated[str, BeforeValidator(_str)]
"""A string."""
OptStr = Annotated[str | None, BeforeValidator(lambda v: v if v is None else _str(v))]
"""A string or null."""
StrList = Annotated[list[str], BeforeValidator(_str_list)]
"""A list of strings (a single string counts as a list of one); duplicates are dropped."""
OptBool = Annotated[bool | None, BeforeValidator(lambda v: v if v is None else _bool(v))]
"""true, false or null."""
OptInt = Annotated[int | None, BeforeValidator(lambda v: v if v is None else coerce_int(v))]
"""An integer or null."""
OptStrList = Annotated[list[str] | None, BeforeValidator(lambda v: v if v is None else _str_list(v))]
"""A list of strings or null."""
IntOrAuto = Annotated[int | str, BeforeValidator(lambda v: v if v == "auto" else coerce_int(v))]
"""An integer or the string "auto" (for DeepSpeed fields whose own default is "auto")."""
PositiveInt = Annotated[Int, Field(gt=0)]
"""An integer above zero."""


class Block(BaseModel):
    """Base of every config block: frozen, and unknown keys are rejected.

    Attributes:
        input_aliases: Other spellings accepted for a field, see [Note: input aliases].
    """

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    input_aliases: ClassVar[Mapping[str, str]] = {}

    # Read-only dict access, for code written against DeepSpeed's ``engine.config`` (a dict there):
    # ``cfg["zero_optimization"]["stage"]`` is ``cfg.zero_optimization.stage``.
    def __getitem__(self, key: str) -> Any:
        name = self.input_aliases.get(key, key)
        if name not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, name)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.input_aliases.get(key, key) in type(self).model_fields

    def get(self, key: str, default: Any = None) -> Any:
        """``self[key]``, or ``default`` for a key that is not a field."""
        return self[key] if key in self else default

    def keys(self) -> list[str]:
        return list(type(self).model_fields)


_DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def normalize_dtype(value: Any) -> Any:
    """Maps DeepSpeed's dtype spellings ("bfloat16", "torch.float16", "half", ...) to fp32/fp16/bf16.

    Raises:
        PydanticCustomError: For anything else; `keys.translate` turns it into a message.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise PydanticCustomError("zs_type", "expected one of 'fp32', 'fp16', 'bf16'")
    name = _DTYPE_NAMES.get(value.strip().lower())
    if name is None:
        raise PydanticCustomError("zs_value", "expected one of 'fp32', 'fp16', 'bf16'")
    return name


DtypeName = Annotated[str | None, BeforeValidator(normalize_dtype)]
""""fp32", "fp16", "bf16" or None; DeepSpeed's other spellings are normalised to these."""
