"""DeepSpeed's engine methods that do more than read the config: the batch settings, whether the last step
applied, the module's state dict, the optimizer's per-group values, the dtypes, the ranks.

:class:`DeepSpeedMethods` sits between :class:`~zeroshard.runtime.surface.DeepSpeedSurface` and
:class:`~zeroshard.runtime.queries.DeepSpeedQueries` (DeepSpeed's config queries, made from a table) in
:class:`zeroshard.ZeroshardEngine`'s bases. Each method keeps DeepSpeed 0.19.8's name, signature and result;
where zeroshard's answer differs on purpose the docstring says so.

[Note: changing the batch size]
``set_train_batch_size`` changes the number of micro-batches per step, as DeepSpeed's does. The engine reads
``config.gradient_accumulation_steps`` at every ``backward`` (the loss is divided by it) and at every
``step`` (the boundary), so a new config takes effect at once; what else depends on it is handled here. It
is refused inside an accumulation window (its micro-batches were already divided by the old count) and
where the engine's gradient buffers were built 16-bit because there was no accumulation
(core/precision.py: accumulating over several micro-batches in bf16/fp16 loses what fp32 keeps). Counted
boundaries restart from the current step, ``micro_steps == global_steps * gradient_accumulation_steps``
(as after ``load_checkpoint``), so the next window is exactly the new length; DeepSpeed keeps counting its
micro-steps and can end the first window early.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from zeroshard.core_config import policy_from_config
from zeroshard.runtime.data import ResumableDataLoader
from zeroshard.runtime.surface import DeepSpeedSurface
from zeroshard.zero import GatheredParameters

if TYPE_CHECKING:
    from zeroshard.config import ZeroshardConfig
    from zeroshard.core.stage3.gatherer import ParameterGatherer
    from zeroshard.telemetry import Telemetry

    class _Engine(Protocol):
        """What :class:`DeepSpeedMethods` uses of :class:`zeroshard.ZeroshardEngine` beyond the surface."""

        def gathered_parameters(self) -> AbstractContextManager[None]: ...

        def save_16bit_model(
            self, save_dir: str, save_filename: str = ..., exclude_frozen_parameters: bool = False
        ) -> bool: ...


__all__ = ["DeepSpeedMethods"]

logger = logging.getLogger(__name__)

# DeepSpeed's names of the optimizers it builds itself: a config's "type" naming one is lower-cased.
_DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")


def config_optimizer_name(config: ZeroshardConfig) -> str | None:
    """DeepSpeed's ``optimizer_name`` of a config: its ``optimizer.type``, lower-cased where it names an
    optimizer DeepSpeed builds itself ("adamw", "adam", "lamb", ...); None without an optimizer block."""
    if config.optimizer is None:
        return None
    name = config.optimizer.type
    return name.lower() if name.lower() in _DEEPSPEED_OPTIMIZERS else name


# The frozen parameters a DeepSpeed module checkpoint carries separately (ZeRO stages 2 and 3).
_FROZEN_FRAGMENTS = "frozen_param_fragments"


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}: expected a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{what}: expected a positive integer, got {value}")
    return value


class DeepSpeedMethods(DeepSpeedSurface):
    """DeepSpeed engine methods with behaviour (see the module docstring)."""

    # Set by ZeroshardEngine.__init__.
    micro_steps: int
    skipped_steps: int
    gatherer: ParameterGatherer | None
    telemetry: Telemetry
    training_dataloader: ResumableDataLoader | None
    _backward_since_step: bool
    # (global_steps, micro_steps, applied) when the last accumulation boundary was reported; see
    # was_step_applied.
    _boundary: tuple[int, int, bool] | None = None

    # -- batch settings ------------------------------------------------------------------------------
    def get_batch_info(self) -> tuple[Callable[[], int], Callable[[], int], Callable[[], int]]:
        """DeepSpeed's ``get_batch_info``: ``(train_batch_size, train_micro_batch_size_per_gpu,
        gradient_accumulation_steps)``.

        As in DeepSpeed 0.19.8 these are the engine's bound *methods*, not their values: call each for
        the number (``[f() for f in engine.get_batch_info()]``), so code written against DeepSpeed runs
        unchanged.
        """
        return (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the number of micro-batches per step; the micro-batch
        size stays (DeepSpeed's ``set_train_batch_size``). See [Note: changing the batch size].

        Raises:
            TypeError: ``train_batch_size`` is not an integer.
            ValueError: ``train_batch_size`` is not a positive multiple of ``train_micro_batch_size_per_gpu *
                world_size``, as in DeepSpeed.
            RuntimeError: Called inside an accumulation window, or it would accumulate over several
                micro-batches in the 16-bit gradient buffers of an engine built without accumulation.
        """
        what = f"set_train_batch_size({train_batch_size!r})"
        size = _positive_int(what, train_batch_size)
        micro, world = self.config.train_micro_batch_size_per_gpu, self.comm.world_size
        if size % (micro * world) != 0:
            raise ValueError(
                f"{what}: the train batch size must be a multiple of train_micro_batch_size_per_gpu({micro}) "
                f"* world_size({world}) = {micro * world}; the micro-batch size stays and the number of "
                "micro-batches per step changes"
            )
        gas = size // (micro * world)
        self._refuse_inside_window(what)
        self._refuse_16bit_accumulation(what, gas)
        applied = self.was_step_applied()
        self._set_batch(train_batch_size=size, gradient_accumulation_steps=gas)
        if self._boundary_override is None:  # counted boundaries restart from here (see the Note)
            self.micro_steps = self.global_steps * gas
            if self._boundary is not None:
                self._boundary = (self.global_steps - 1, self.micro_steps - 1, applied)
        if self.training_dataloader is not None:  # a checkpoint may rewind its position over a window
            self.training_dataloader.set_rewind_limit(gas)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch size and with it the global batch size; the accumulation steps stay
        (DeepSpeed's ``set_train_micro_batch_size``). Takes effect for the next step's sample count; the
        loader ``initialize(training_data=...)`` built keeps its batch size, as DeepSpeed's does.

        Raises:
            TypeError: ``micro_batch_size`` is not an integer.
            ValueError: ``micro_batch_size`` is not positive.
        """
        micro = _positive_int(f"set_train_micro_batch_size({micro_batch_size!r})", micro_batch_size)
        gas = self.config.gradient_accumulation_steps
        self._set_batch(
            train_batch_size=micro * gas * self.comm.world_size, train_micro_batch_size_per_gpu=micro
        )

    def _set_batch(self, **update: int) -> None:
        """Replace the (frozen) config by one with ``update``; keeps ``train_batch_size == micro * gas *
        world_size``, which the callers computed."""
        self.config = self.config.model_copy(update=update)
        self.telemetry.train_batch_size = self.config.train_batch_size  # samples/s in the step logs

    def _refuse_inside_window(self, what: str) -> None:
        counted_start = self.micro_steps == self.global_steps * self.config.gradient_accumulation_steps
        after_boundary = self._boundary is not None and (self.global_steps, self.micro_steps) == (
            self._boundary[0] + 1,
            self._boundary[1] + 1,
        )
        if self._backward_since_step or not (counted_start or after_boundary):
            raise RuntimeError(
                f"{what} inside an accumulation window: its micro-batches so far were divided by "
                f"gradient_accumulation_steps={self.config.gradient_accumulation_steps}; call it between "
                "windows: before training or right after the step() that ends a window"
            )

    def _refuse_16bit_accumulation(self, what: str, gas: int) -> None:
        policy = self.units[0].policy if self.units else None
        if gas == 1 or policy is None or policy.accumulate == torch.float32:
            return
        if self.config.data_types.grad_accum_dtype is not None:
            return  # the user chose the accumulation dtype
        raise RuntimeError(
            f"{what} would accumulate {gas} micro-batches in the {policy.accumulate} gradient buffers this "
            "engine built for gradient_accumulation_steps=1, losing the precision a run started with "
            f"{gas} steps keeps (it accumulates in fp32); build the engine with "
            'gradient_accumulation_steps > 1, or with data_types.grad_accum_dtype in the ds_config ("fp32", '
            "or the 16-bit dtype to accept the loss)"
        )

    # -- the last step -----------------------------------------------------------------------------------
    def _report_overflow(self, skipped: bool) -> None:
        # Called at every accumulation boundary (and once by __init__), before the counters advance.
        self._boundary = (self.global_steps, self.micro_steps, not skipped)
        super()._report_overflow(skipped)

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters (DeepSpeed's ``was_step_applied``): False
        before the first step, after a ``step()`` inside an accumulation window and after a step skipped
        for non-finite gradients (fp16 overflow)."""
        if self._boundary is None:
            return False
        steps, micro, applied = self._boundary
        return applied and (self.global_steps, self.micro_steps) == (steps + 1, micro + 1)

    # -- module state ------------------------------------------------------------------------------------
    def module_state_dict(
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The wrapped module's ``state_dict`` (DeepSpeed's ``module_state_dict``), without the frozen
        parameters when ``exclude_frozen_parameters``.

        At ZeRO stage 3 the parameters are gathered for the call and the values are copies (the
        parameters hold placeholders again afterwards; with ``keep_vars`` too), where DeepSpeed returns
        the placeholders. Collective at stage 3: call on all ranks.
        """
        state: dict[str, Any]
        if self.gatherer is None:
            state = (
                self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
                if destination is None
                else self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
            )
        else:
            with cast("_Engine", self).gathered_parameters():
                gathered = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
                copies = OrderedDict(
                    (k, v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in gathered.items()
                )
            state = _merged(destination, copies, getattr(gathered, "_metadata", None))
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def load_module_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        strict: bool = True,
        custom_load_fn: Callable[..., Any] | None = None,
        fetch_z3_params: bool = False,
        z3_params_to_fetch: list[nn.Parameter] | None = None,
        allowed_missing_keys: list[str] | None = None,
    ) -> None:
        """Load ``checkpoint["module"]`` into the wrapped module (DeepSpeed's ``load_module_state_dict``).

        ``module.load_state_dict`` at stage 3 gathers the units the state names and writes the loaded values
        into their master shards ([Note: local state_dict] in state_dict_hooks.py). ``custom_load_fn(src=,
        dst=)`` runs instead when given; at stage 3, as in DeepSpeed, it sees full parameters only for those
        ``fetch_z3_params=True`` (all) or ``z3_params_to_fetch`` gathers, and rank 0's changes to those are
        kept. ``allowed_missing_keys`` tightens a strict load to "no unexpected keys and no missing keys but
        these". Frozen parameters the checkpoint carries separately (``frozen_param_fragments``, DeepSpeed's
        stages 2 and 3) are loaded too. Collective at stage 3: call on all ranks.

        Raises:
            KeyError: ``checkpoint`` has no ``"module"``.
            RuntimeError: A strict load with ``allowed_missing_keys`` found other missing or unexpected
                keys (as DeepSpeed); torch's errors of a strict ``load_state_dict``.
            NotImplementedError: ``frozen_param_fragments`` at ZeRO stage 3: DeepSpeed's per-rank shards
                of those parameters; ``load_checkpoint`` reads them.
        """
        if z3_params_to_fetch is not None:
            fetch = list(z3_params_to_fetch)
        else:
            fetch = list(self.module.parameters()) if fetch_z3_params else []
        with GatheredParameters(fetch, modifier_rank=0):
            state = checkpoint["module"]
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
            else:
                result = self.module.load_state_dict(state, strict=strict and allowed_missing_keys is None)
                if strict and allowed_missing_keys is not None:
                    missing = set(result.missing_keys) - set(allowed_missing_keys)
                    if missing or result.unexpected_keys:
                        raise RuntimeError(
                            "the checkpoint's module state does not match the model beyond "
                            f"allowed_missing_keys: missing={sorted(missing)}, "
                            f"unexpected={sorted(result.unexpected_keys)}"
                        )
        fragments = checkpoint.get(_FROZEN_FRAGMENTS)
        if fragments:
            if self.gatherer is not None:
                raise NotImplementedError(
                    f"load_module_state_dict: the checkpoint's {_FROZEN_FRAGMENTS} are DeepSpeed's "
                    "per-rank ZeRO-3 shards of the frozen parameters; load the checkpoint with "
                    "engine.load_checkpoint()"
                )
            self.module.load_state_dict(dict(fragments), strict=False)

    # -- the optimizer's values per param group ------------------------------------------------------------
    def optimizer_name(self) -> str | None:
        """DeepSpeed's ``optimizer_name``: the config's ``optimizer.type`` (lower-cased where it names an
        optimizer DeepSpeed builds itself: "adamw", "adam", "lamb", ...), else the class name of the
        optimizer given to ``initialize()``, else None. For an optimizer given as a callable it is the
        class of the optimizer the callable built (DeepSpeed names the callable's class)."""
        if self.config.optimizer is not None:
            return config_optimizer_name(self.config)
        return type(self.optimizer).__name__ if self.optimizer is not None else None

    def _per_group(self, key: str) -> list[Any]:
        """``key`` of every param group (0.0 where a group lacks it), as DeepSpeed reports them."""
        if self.optimizer is None:
            return []
        return [group.get(key, 0.0) for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each param group's ``momentum`` for "SGD" and "RMSprop" (by :meth:`optimizer_name`), else its
        ``betas`` (DeepSpeed's ``get_mom``)."""
        return self._per_group("momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas")

    def get_type(self) -> list[Any]:
        """Each param group's ``type`` entry, 0.0 where there is none (DeepSpeed's ``get_type``)."""
        return self._per_group("type")

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(compute dtype, gradient accumulation dtype) (DeepSpeed's ``get_data_types``): the dtypes this
        engine uses (core/precision.py). DeepSpeed reports the compute dtype as the accumulation dtype
        unless ``data_types.grad_accum_dtype`` is set; zeroshard accumulates in fp32 when it accumulates
        16-bit gradients over several micro-batches, and says so here."""
        policy = self.units[0].policy if self.units else policy_from_config(self.config)
        return policy.compute, policy.accumulate

    # -- ranks ---------------------------------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        """This process's rank in the data-parallel group. (DeepSpeed 0.19.8 asserts unless its model
        or expert parallel groups were set up.)"""
        return self.comm.rank

    def get_model_parallel_rank(self) -> int:
        """0: zeroshard has no model parallelism."""
        return 0

    def get_tensor_parallel_rank(self) -> int:
        """0: zeroshard has no tensor parallelism."""
        return 0

    # -- small helpers DeepSpeed has on its engine ---------------------------------------------------------
    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        """Whether ``obj`` has ``__getitem__`` and ``__len__`` (DeepSpeed's test)."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        """Whether ``obj`` is a ``torch.utils.data.IterableDataset``."""
        return isinstance(obj, torch.utils.data.IterableDataset)

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now; returns what ``gc.collect()`` returns (the
        unreachable objects found). Local."""
        return gc.collect()

    def save_fp16_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """DeepSpeed's old name of ``save_16bit_model`` (which see; zeroshard writes safetensors).
        Collective."""
        return cast("_Engine", self).save_16bit_model(save_dir, save_filename)


def _merged(
    destination: dict[str, Any] | None, state: OrderedDict[str, Any], metadata: Any
) -> dict[str, Any]:
    """``state`` as ``module.state_dict(destination=...)`` would have filled ``destination`` (with
    torch's ``_metadata`` where it keeps one)."""
    if destination is None:
        if metadata is not None:
            state._metadata = metadata  # type: ignore[attr-defined]
        return state
    destination.update(state)
    kept = getattr(destination, "_metadata", None)
    if isinstance(kept, dict) and isinstance(metadata, dict):
        kept.update(metadata)
    return destination
