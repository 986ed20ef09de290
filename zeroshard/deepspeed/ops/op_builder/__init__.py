"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, answering for zeroshard, which compiles no ops.

DeepSpeed builds each of its C++/CUDA ops (ahead of time or just in time) through a builder class; code asks
a builder ``is_compatible()`` (or looks its ``NAME`` up in ``deepspeed.ops.__compatible_ops__``) before it
relies on the op, and ``load()`` returns the compiled module. zeroshard compiles nothing. The optimizers those
ops implement are zeroshard's own PyTorch code (``deepspeed.ops.adam.DeepSpeedCPUAdam`` and ``FusedAdam``,
``deepspeed.ops.lamb.FusedLamb``, ``deepspeed.ops.lion.DeepSpeedCPULion`` and ``FusedLion``,
``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``); what the other ops serve (inference kernels, async I/O,
quantizers, communication kernels, DeepCompile) is not part of zeroshard.

Every builder class of DeepSpeed 0.19.8 is here, with its ``NAME`` and ``BUILD_VAR``. Invariants:

- ``is_compatible()`` is True exactly for the six optimizer ops above (``PROVIDED_BY`` names the class that
  provides each): the feature works here without a build, which is what callers check before they use it.
  It is False for every other op.
- ``load()``, ``jit_load()`` and ``builder()`` raise ``NotImplementedError`` naming the builder: zeroshard has
  no compiled module to return (nor a C++ extension to build). Construct the ``PROVIDED_BY`` class instead.
- :data:`__compatible_ops__` maps every builder's ``NAME`` to its ``is_compatible()``; it is also
  ``deepspeed.ops.__compatible_ops__``.
- ``installed_ops`` of ``deepspeed.git_version_info`` maps every ``NAME`` to False (nothing is prebuilt).
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

from zeroshard.deepspeed import surface

__all__ = [
    "ALL_BUILDERS",
    "AsyncIOBuilder",
    "CCLCommBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "CUDAOpBuilder",
    "DeepCompileBuilder",
    "EvoformerAttnBuilder",
    "FPQuantizerBuilder",
    "FlashAttentionBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
    "GDSBuilder",
    "InferenceBuilder",
    "InferenceCoreBuilder",
    "InferenceCutlassBuilder",
    "NotImplementedBuilder",
    "OpBuilder",
    "PinMemoryBuilder",
    "QuantizerBuilder",
    "RaggedOpsBuilder",
    "RaggedUtilsBuilder",
    "RandomLTDBuilder",
    "ShareMemCommBuilder",
    "SpatialInferenceBuilder",
    "StochasticTransformerBuilder",
    "TransformerBuilder",
    "UtilsBuilder",
    "__compatible_ops__",
]


class OpBuilder:
    """One DeepSpeed op. Subclasses set ``NAME`` (the op's key in ``__compatible_ops__``), ``BUILD_VAR``
    (DeepSpeed's ``DS_BUILD_*`` variable) and, for an op zeroshard provides, ``PROVIDED_BY``."""

    NAME: ClassVar[str] = "op_builder"
    BUILD_VAR: ClassVar[str] = ""
    PROVIDED_BY: ClassVar[str | None] = None
    """The ``deepspeed.ops`` class that does this op's work in zeroshard, or None when nothing does."""

    def __init__(self, name: str | None = None) -> None:
        self.name = self.NAME if name is None else name

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether what this op provides works here: True exactly when ``PROVIDED_BY`` is set."""
        return self.PROVIDED_BY is not None

    def _refuse(self) -> NoReturn:
        instead = (
            f"; {self.PROVIDED_BY} provides this op's optimizer in PyTorch, construct it instead"
            if self.PROVIDED_BY is not None
            else f"; what the {self.NAME!r} op serves is not part of zeroshard"
        )
        raise NotImplementedError(
            f"{type(self).__name__}: zeroshard builds no DeepSpeed ops, so there is no compiled "
            f"{self.NAME!r} module to load{instead}"
        )

    def load(self, verbose: bool = False) -> Any:
        """Raises ``NotImplementedError`` (zeroshard has no compiled op to return)."""
        self._refuse()

    def jit_load(self, verbose: bool = True) -> Any:
        """Raises ``NotImplementedError`` (zeroshard compiles nothing)."""
        self._refuse()

    def builder(self) -> Any:
        """Raises ``NotImplementedError`` (zeroshard has no C++ extension to build)."""
        self._refuse()


class CUDAOpBuilder(OpBuilder):
    """DeepSpeed's base class of the CUDA ops (for ``isinstance`` checks)."""


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"


class CCLCommBuilder(OpBuilder):
    NAME = "deepspeed_ccl_comm"
    BUILD_VAR = "DS_BUILD_CCL_COMM"


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"
    BUILD_VAR = "DS_BUILD_CPU_ADAGRAD"
    PROVIDED_BY = "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad"


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    BUILD_VAR = "DS_BUILD_CPU_ADAM"
    PROVIDED_BY = "deepspeed.ops.adam.DeepSpeedCPUAdam"


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"
    BUILD_VAR = "DS_BUILD_CPU_LION"
    PROVIDED_BY = "deepspeed.ops.lion.DeepSpeedCPULion"


class DeepCompileBuilder(CUDAOpBuilder):
    NAME = "dc"
    BUILD_VAR = "DS_BUILD_DEEP_COMPILE"


class EvoformerAttnBuilder(CUDAOpBuilder):
    NAME = "evoformer_attn"
    BUILD_VAR = "DS_BUILD_EVOFORMER_ATTN"


class FPQuantizerBuilder(CUDAOpBuilder):
    NAME = "fp_quantizer"
    BUILD_VAR = "DS_BUILD_FP_QUANTIZER"


class FlashAttentionBuilder(OpBuilder):
    NAME = "flash_attn"
    BUILD_VAR = "DS_BUILD_FlashAttention"


class FusedAdamBuilder(CUDAOpBuilder):
    NAME = "fused_adam"
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    PROVIDED_BY = "deepspeed.ops.adam.FusedAdam"


class FusedLambBuilder(CUDAOpBuilder):
    NAME = "fused_lamb"
    BUILD_VAR = "DS_BUILD_FUSED_LAMB"
    PROVIDED_BY = "deepspeed.ops.lamb.FusedLamb"


class FusedLionBuilder(CUDAOpBuilder):
    NAME = "fused_lion"
    BUILD_VAR = "DS_BUILD_FUSED_LION"
    PROVIDED_BY = "deepspeed.ops.lion.FusedLion"


class GDSBuilder(AsyncIOBuilder):
    NAME = "gds"
    BUILD_VAR = "DS_BUILD_GDS"


class InferenceBuilder(CUDAOpBuilder):
    NAME = "transformer_inference"
    BUILD_VAR = "DS_BUILD_TRANSFORMER_INFERENCE"


class InferenceCoreBuilder(CUDAOpBuilder):
    NAME = "inference_core_ops"
    BUILD_VAR = "DS_BUILD_INFERENCE_CORE_OPS"


class InferenceCutlassBuilder(CUDAOpBuilder):
    NAME = "cutlass_ops"
    BUILD_VAR = "DS_BUILD_CUTLASS_OPS"


class NotImplementedBuilder(OpBuilder):
    NAME = "deepspeed_not_implemented"
    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"


class PinMemoryBuilder(OpBuilder):
    NAME = "pin_memory"
    BUILD_VAR = "DS_BUILD_PIN_MEMORY"


class QuantizerBuilder(CUDAOpBuilder):
    NAME = "quantizer"
    BUILD_VAR = "DS_BUILD_QUANTIZER"


class RaggedOpsBuilder(CUDAOpBuilder):
    NAME = "ragged_device_ops"
    BUILD_VAR = "DS_BUILD_RAGGED_DEVICE_OPS"


class RaggedUtilsBuilder(CUDAOpBuilder):
    NAME = "ragged_ops"
    BUILD_VAR = "DS_BUILD_RAGGED_OPS"


class RandomLTDBuilder(CUDAOpBuilder):
    NAME = "random_ltd"
    BUILD_VAR = "DS_BUILD_RANDOM_LTD"


class ShareMemCommBuilder(OpBuilder):
    NAME = "deepspeed_shm_comm"
    BUILD_VAR = "DS_BUILD_SHM_COMM"


class SpatialInferenceBuilder(CUDAOpBuilder):
    NAME = "spatial_inference"
    BUILD_VAR = "DS_BUILD_SPATIAL_INFERENCE"


class TransformerBuilder(CUDAOpBuilder):
    NAME = "transformer"
    BUILD_VAR = "DS_BUILD_TRANSFORMER"


class StochasticTransformerBuilder(TransformerBuilder):
    NAME = "stochastic_transformer"
    BUILD_VAR = "DS_BUILD_STOCHASTIC_TRANSFORMER"


class UtilsBuilder(OpBuilder):
    NAME = "utils"
    BUILD_VAR = "DS_BUILD_UTILS"


ALL_BUILDERS: tuple[type[OpBuilder], ...] = tuple(
    value
    for name, value in sorted(globals().items())
    if isinstance(value, type) and issubclass(value, OpBuilder) and value not in (OpBuilder, CUDAOpBuilder)
)
"""Every builder class of DeepSpeed 0.19.8, in order of class name."""

__compatible_ops__: dict[str, bool] = {cls.NAME: cls().is_compatible() for cls in ALL_BUILDERS}
"""Each op's ``NAME`` -> whether what it provides works here (also ``deepspeed.ops.__compatible_ops__``)."""

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
