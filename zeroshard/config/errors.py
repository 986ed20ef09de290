"""Errors and warnings raised while reading a ds_config.

Every problem found in one config is collected first and raised together, one line each, so a user fixes
them in one round instead of one per run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from zeroshard.errors import DeepSpeedConfigError

__all__ = ["ConfigError", "ConfigTypeError", "ConfigWarning", "Problems", "show"]


class ConfigWarning(UserWarning):
    """A config setting that zeroshard accepts but reads differently from what it says (deprecated
    spelling, ignored key, feature without effect)."""


class ConfigError(ValueError, DeepSpeedConfigError, AssertionError):
    """The config cannot be used; the message names each offending key, its value and what is allowed.

    Also DeepSpeed's types for config problems, so code written for DeepSpeed catches it: its
    ``DeepSpeedConfigError`` and ``AssertionError`` (DeepSpeed asserts on many settings, the batch sizes
    among them); see [Note: DeepSpeed's exception types] in zeroshard/errors.py.
    """


class ConfigTypeError(ConfigError, TypeError):
    """Like `ConfigError`, raised when at least one problem is a value of the wrong type.

    It is both a `ValueError` and a `TypeError`, so callers may catch either.
    """


@dataclass
class Problems:
    """Collects user-facing problems and raises them as one error.

    Attributes:
        lines: One message per problem, in the order found.
        has_type_error: Whether any problem is a wrong type (raised as `ConfigTypeError`).
    """

    lines: list[str] = field(default_factory=list)
    has_type_error: bool = False

    def add(self, message: str, *, type_error: bool = False) -> None:
        """Records one problem unless the same message is already recorded."""
        if message not in self.lines:
            self.lines.append(message)
        self.has_type_error = self.has_type_error or type_error

    def __bool__(self) -> bool:
        return bool(self.lines)

    def raise_if_any(self, origin: str) -> None:
        """Raises every recorded problem as one error.

        Args:
            origin: What was being read, e.g. "ds_config ds.json", used in the first line.

        Raises:
            ConfigTypeError: When any problem is a wrong type.
            ConfigError: When there are problems and none is a wrong type.
        """
        if not self.lines:
            return
        noun = "problem" if len(self.lines) == 1 else f"{len(self.lines)} problems"
        message = f"invalid {origin} ({noun}):\n" + "\n".join(f"  - {line}" for line in self.lines)
        if self.has_type_error:
            raise ConfigTypeError(message)
        raise ConfigError(message)


def show(value: Any) -> str:
    """A short JSON-style rendering of a config value for messages (`true`, `"cpu"`, `5`)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
