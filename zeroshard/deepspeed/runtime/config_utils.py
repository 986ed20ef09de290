"""``deepspeed.runtime.config_utils``: DeepSpeed's base class for pydantic config models, and its helpers.

Projects that define their own config models on DeepSpeed's (DeepSpeed-MII, DeepSpeedExamples' scripts,
downstream trainers) subclass :class:`DeepSpeedConfigModel`; it works here as there:

- unknown keys are refused and values are validated, also on assignment (pydantic's ``ValidationError``);
- a field's ``alias`` and its own name are both accepted;
- ``"auto"`` values are dropped before validation unless ``strict=True`` (Hugging Face writes ``"auto"``
  for values it fills in later), so the field keeps its default;
- a field marked deprecated in ``json_schema_extra`` (``{"deprecated": True, "new_param": "a.b",
  "new_param_fn": f, "set_new_param": True, "deprecated_msg": "..."}``) logs a warning when given, and
  hands ``f(value)`` to the field that replaces it (a dotted path reaches into a nested model); giving both
  the old and the new field is refused (``ArgumentError``, also an ``AssertionError`` as DeepSpeed's).

zeroshard's own config (``zeroshard.config.ZeroshardConfig``) does not build on this class: it reads the
whole ds_config at once and reports every problem together.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, field_serializer

from zeroshard.deepspeed import surface
from zeroshard.errors import ArgumentError

__all__ = [
    "DeepSpeedConfigModel",
    "dict_raise_error_on_duplicate_keys",
    "get_config_default",
    "get_dict_param",
    "get_list_param",
    "get_scalar_param",
    "pp_int",
]

log = logging.getLogger(__name__)


class DeepSpeedConfigModel(BaseModel):
    """A pydantic model with DeepSpeed's conventions (see the module docstring).

    Args:
        strict: Keep ``"auto"`` values (they then fail validation unless the field accepts strings).
        **data: The fields, by name or alias.
    """

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {key: value for key, value in data.items() if key == "replace_method" or value != "auto"}
        super().__init__(**data)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated") and name in self.model_fields_set:
                self._replace_deprecated(name, extra)

    def _replace_deprecated(self, name: str, extra: dict[str, Any]) -> None:
        """Warn about the deprecated field ``name`` and move its value to the field replacing it."""
        new_param = str(extra.get("new_param", ""))
        instead = f" use {new_param} instead" if new_param else ""
        note = f". {extra['deprecated_msg']}" if extra.get("deprecated_msg") else ""
        log.warning("Config parameter %s is deprecated%s%s", name, instead, note)
        if not new_param or not extra.get("set_new_param", True):
            return
        convert: Callable[[Any], Any] = extra.get("new_param_fn") or (lambda value: value)
        value = convert(getattr(self, name))
        delattr(self, name)
        *path, leaf = new_param.split(".")
        owner = functools.reduce(getattr, path, self)
        if leaf in owner.model_fields_set:
            raise ArgumentError(
                f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new_param}' together"
            )
        setattr(owner, leaf, value)

    @field_serializer("dtype", check_fields=False)
    def serialize_torch_dtype(dtype: Any) -> str:  # a plain serializer: no self, as DeepSpeed's
        return str(dtype)


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    """The default of ``field_name`` in the model ``config``.

    Raises:
        ArgumentError: No such field, or the field is required (also ``AssertionError``, as DeepSpeed's).
    """
    fields = config.model_fields if isinstance(config, type) else type(config).model_fields
    if field_name not in fields:
        raise ArgumentError(f"'{field_name}' is not a field in {config}")
    if fields[field_name].is_required():
        raise ArgumentError(f"'{field_name}' is a required field and does not have a default value")
    return fields[field_name].get_default(call_default_factory=True)


class pp_int(int):  # DeepSpeed's name
    """An int that prints with thousands separators (``10,000``), or as ``custom_print_str`` when given: for
    config defaults shown in generated documentation."""

    custom_print_str: str | None

    def __new__(cls, val: Any, custom_print_str: str | None = None) -> pp_int:
        made = super().__new__(cls, val)
        made.custom_print_str = custom_print_str
        return made

    def __repr__(self) -> str:
        return self.custom_print_str or f"{self.real:,}"


def get_scalar_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


get_list_param = get_scalar_param
get_dict_param = get_scalar_param


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A dict of ``ordered_pairs`` (``json.load``'s ``object_pairs_hook``); ``ValueError`` naming the keys
    that occur more than once."""
    counts = collections.Counter(key for key, _ in ordered_pairs)
    repeated = [key for key, count in counts.items() if count > 1]
    if repeated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {repeated}")
    return dict(ordered_pairs)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
