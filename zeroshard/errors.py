"""Exception types that are zeroshard's and DeepSpeed's at once.

[Note: DeepSpeed's exception types]
DeepSpeed refuses many misuses with ``assert`` (they arrive as ``AssertionError``) and config problems with
``DeepSpeedConfigError``, ``assert`` or pydantic's ``ValidationError`` (a ``ValueError``). zeroshard raises
``ValueError``, ``TypeError`` or ``RuntimeError`` with a message naming the argument, its value and what is
allowed, and never ``assert`` on user input (``python -O`` strips it). So that code written against
DeepSpeed behaves the same here (``except AssertionError``, ``except deepspeed.DeepSpeedConfigError``,
``pytest.raises(AssertionError)`` in a test suite), an error raised where DeepSpeed raises one of those is
an instance of zeroshard's type *and* of DeepSpeed's: the classes below derive from both. A handler for
zeroshard's type still catches it, and ``python -O`` changes nothing.

Where each is raised (DeepSpeed 0.19.8's type in brackets):

- :class:`ArgumentError` (``ValueError``) [``AssertionError``]: ``initialize()`` without a model; checkpoint
  tags that differ across ranks under ``checkpoint.tag_validation: FAIL``; ``engine.scale`` given something
  other than a scalar loss that requires grad.
- :class:`UsageError` (``RuntimeError``) [``AssertionError``]: ``engine.no_sync()`` at ZeRO stage 2 or 3,
  entered again inside itself, or ``engine.step()`` inside it; ``engine.scale``, ``backward`` or ``step``
  without an optimizer.
- :class:`ArgumentTypeError` (``TypeError``) [``ValueError``]: ``save_checkpoint(save_dir=None)``; a
  scheduler or optimizer parameter that is not a number (``warmup_num_steps=None``).
- ``zeroshard.config.ConfigError`` (``ValueError``) [:class:`DeepSpeedConfigError`, ``AssertionError``]: every
  config problem (``config/errors.py``).
"""

from __future__ import annotations

__all__ = ["ArgumentError", "ArgumentTypeError", "DeepSpeedConfigError", "UsageError"]


class DeepSpeedConfigError(Exception):
    """DeepSpeed's config error type: ``deepspeed.DeepSpeedConfigError`` (and
    ``deepspeed.runtime.config.DeepSpeedConfigError``) under ``import deepspeed`` on zeroshard.

    zeroshard raises its subclass ``zeroshard.config.ConfigError`` for every config problem.
    """


class ArgumentError(ValueError, AssertionError):
    """An argument value zeroshard refuses where DeepSpeed refuses it with ``assert``.

    The message names the argument, the value and what is allowed.
    """


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type where DeepSpeed raises ``ValueError`` (``None`` for a path)."""


class UsageError(RuntimeError, AssertionError):
    """An engine method called in a state that does not allow it, where DeepSpeed refuses it with ``assert``.

    The message says what to do instead.
    """
