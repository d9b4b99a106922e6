"""Enumerations shared by the whole library: reduction ops and variable policies."""

from __future__ import annotations

import dataclasses
import enum

from distribute.errors import InvalidArgumentError

__all__ = [
    "REDUCE_OP_NAMES",
    "ReduceOp",
    "StepRunner",
    "VariableAggregation",
    "VariableSpec",
    "VariableSynchronization",
]


class ReduceOp(enum.Enum):
    """How values from several replicas are combined.

    Strings are accepted wherever a `ReduceOp` is, case-insensitively.

    Example:
        >>> import distribute as ds
        >>> ds.ReduceOp.from_value("mean") is ds.ReduceOp.MEAN
        True
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_value(cls, value: ReduceOp | str) -> ReduceOp:
        """Returns the `ReduceOp` for `value` (a `ReduceOp` or a string)."""
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str):
            op = _REDUCE_OPS.get(value.upper())  # not cls[...]: a frame per `reduce`
            if op is not None:
                return op
        raise InvalidArgumentError(
            f"reduce_op must be one of {[m.value for m in cls]} (any case), got {value!r}"
        )


#: ReduceOp by name, for `ReduceOp.from_value`.
_REDUCE_OPS: dict[str, ReduceOp] = {op.name: op for op in ReduceOp}
#: The names `reduce` is most often given ("sum", "SUM", ...), looked up without a
#: call; other spellings go through `ReduceOp.from_value`.
REDUCE_OP_NAMES: dict[str, ReduceOp] = {
    **_REDUCE_OPS,
    **{op.name.lower(): op for op in ReduceOp},
    **{op.name.capitalize(): op for op in ReduceOp},
}


class VariableSynchronization(enum.Enum):
    """When a distributed variable's copies are synchronized.

    `AUTO` and `ON_WRITE` give a `MirroredVariable` (copies kept identical on every
    write); `ON_READ` gives a `SyncOnReadVariable` (copies aggregated when read in
    cross-replica context); `NONE` is not supported under a strategy.

    Example:
        >>> import distribute as ds
        >>> with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        ...     total = ds.Variable(0.0, synchronization=ds.VariableSynchronization.ON_READ,
        ...                         aggregation=ds.VariableAggregation.SUM)
        >>> type(total).__name__
        'SyncOnReadVariable'
    """

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How replica-context writes (or cross-replica reads) of a variable combine.

    Example:
        >>> import distribute as ds
        >>> ds.VariableAggregation.MEAN.name
        'MEAN'
    """

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


class StepRunner(enum.Enum):
    """How `ds.Model`'s loop runs its steps on a strategy's engine
    (`StrategyExtended.step_runner`).

    Example:
        >>> import distribute as ds
        >>> ds.OneDeviceStrategy("cpu").extended.step_runner.name
        'IN_PROCESS'
    """

    IN_PROCESS = "in_process"  # each step is one `strategy.run` in this process
    XLA_EXECUTIONS = "xla_executions"  # steps_per_execution steps as one XLA execution
    COORDINATED = "coordinated"  # closures a ClusterCoordinator runs on the workers


@dataclasses.dataclass(frozen=True)
class VariableSpec:
    """What a variable about to be created is, beside its value (what an engine's
    ``_create_variable`` receives).

    Attributes:
        trainable: whether optimizers train it.
        synchronization: when its copies agree.
        aggregation: how replicas' writes combine.
        is_param: a module's parameter (an ``nn.Parameter`` to ``isinstance``).
        is_buffer: a module's buffer.
        deferred: registered by a module whose code initializes it afterwards; an
            engine may keep it where it is until then.

    Example:
        >>> from distribute._enums import VariableAggregation, VariableSpec, VariableSynchronization
        >>> VariableSpec(True, VariableSynchronization.ON_WRITE, VariableAggregation.NONE)
        VariableSpec(trainable=True, synchronization=<VariableSynchronization.ON_WRITE: 2>, \
aggregation=<VariableAggregation.NONE: 0>, is_param=False, is_buffer=False, deferred=False)
    """

    trainable: bool
    synchronization: VariableSynchronization
    aggregation: VariableAggregation
    is_param: bool = False
    is_buffer: bool = False
    deferred: bool = False
