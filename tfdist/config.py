"""`ParallelConfig`: the plain, serialisable description of a distributed run.

Strategies, the command line and the TFJob generator all take one; every entry point
calls `ParallelConfig.validate()` so a bad value is reported the same way everywhere,
before any device is touched or any step runs.
"""

import dataclasses
import json
import os
from typing import Any

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
SCHEDULES = ("gpipe", "1f1b")
ZERO_STAGES = (0, 1, 2)

# Environment variables through which `tfdist launch` and TFJob manifests pass
# settings to every task: the ParallelConfig (as JSON), the log directory, and
# the port of the task's profiler server (for `tfdist profile`).
CONFIG_ENV = "TFDIST_CONFIG"
LOGDIR_ENV = "TFDIST_LOGDIR"
PROFILER_PORT_ENV = "TFDIST_PROFILER_PORT"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a model is spread over devices and how each step is computed.

    Args:
        data: data-parallel replicas (size of the mesh's data axis); None
            (the default) means every device the strategy has, divided by
            `pipeline * tensor`, filled in by `resolve`.
        pipeline: pipeline stages (size of the mesh's pipeline axis).
        tensor: tensor-parallel shards (size of the mesh's tensor axis).
            `data * pipeline * tensor` is the number of devices used.
        microbatches: each per-replica batch is split into this many
            microbatches inside one step; gradients are accumulated locally
            and reduced once per step.
        zero: optimizer-state sharding stage: 0 off, 1 optimizer state
            sharded, 2 optimizer state and gradients sharded.
        precision: "float32", "mixed_float16" or "mixed_bfloat16".
        xla: jit-compile the per-replica compute with XLA.
        schedule: pipeline schedule, "gpipe" or "1f1b".

    Example:

    >>> config = ParallelConfig(data=4, microbatches=2)
    >>> ParallelConfig.from_json(config.to_json()) == config
    True
    >>> ParallelConfig(microbatches=2).resolve(num_devices=8).data
    8
    """

    data: int | None = None
    pipeline: int = 1
    tensor: int = 1
    microbatches: int = 1
    zero: int = 0
    precision: str = "float32"
    xla: bool = False
    schedule: str = "gpipe"

    def __post_init__(self):
        self.validate()

    def validate(self) -> "ParallelConfig":
        """Checks every field; returns the config, so calls can be chained.

        Raises `TypeError` for a value of the wrong type and `ValueError` for
        a value out of range, each naming the argument, the value given and
        what would be valid.

        Example:

        >>> ParallelConfig(data=2).validate().data
        2
        """
        for name in ("data", "pipeline", "tensor", "microbatches", "zero"):
            value = getattr(self, name)
            if name == "data" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"`{name}` must be an int, got {value!r} of type "
                    f"{type(value).__name__}."
                )
        for name in ("data", "pipeline", "tensor", "microbatches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(
                    f"`{name}` must be an int >= 1, got {value!r}."
                )
        if self.zero == 3:
            raise NotImplementedError(
                "`zero=3` (sharded parameters) is not supported yet; use "
                "zero=1 (optimizer state sharded) or zero=2 (optimizer state "
                "and gradients sharded).")
        if self.zero not in ZERO_STAGES:
            raise ValueError(
                f"`zero` must be one of {ZERO_STAGES} (0: off, 1: optimizer "
                f"state sharded, 2: optimizer state and gradients sharded), "
                f"got {self.zero!r}."
            )
        if self.zero and self.data == 1:
            raise ValueError(
                f"`zero={self.zero}` shards optimizer state across the "
                f"data-parallel replicas, but `data=1`: there is nothing to "
                f"shard. Use data >= 2, or zero=0.")
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise ValueError(
                f"`precision` must be one of {PRECISIONS}, got {self.precision!r}."
            )
        if not isinstance(self.xla, bool):
            raise TypeError(
                f"`xla` must be a bool, got {self.xla!r} of type "
                f"{type(self.xla).__name__}."
            )
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise ValueError(
                f"`schedule` must be one of {SCHEDULES}, got {self.schedule!r}."
            )
        return self

    def resolve(self, num_devices: int) -> "ParallelConfig":
        """The config for a mesh of `num_devices` devices, `data` filled in.

        `data * pipeline * tensor` must equal `num_devices`; a `data` of None
        becomes `num_devices / (pipeline * tensor)`.

        Example:

        >>> ParallelConfig().resolve(4).data
        4
        >>> ParallelConfig(data=4).resolve(2)
        Traceback (most recent call last):
        ...
        ValueError: The mesh data=4 x pipeline=1 x tensor=1 needs 4 devices, but there are 2: choose sizes whose product is 2, or omit `data` to use every device.
        """
        groups = self.pipeline * self.tensor
        if self.data is None:
            if num_devices % groups:
                raise ValueError(
                    f"pipeline={self.pipeline} x tensor={self.tensor} needs "
                    f"groups of {groups} devices, which do not divide the "
                    f"{num_devices} devices: choose sizes whose product "
                    f"divides {num_devices}."
                )
            return self.replace(data=num_devices // groups)
        if self.data * groups != num_devices:
            raise ValueError(
                f"The mesh data={self.data} x pipeline={self.pipeline} x "
                f"tensor={self.tensor} needs {self.data * groups} devices, but "
                f"there are {num_devices}: choose sizes whose product is "
                f"{num_devices}, or omit `data` to use every device."
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (JSON-serialisable).

        Example:

        >>> ParallelConfig(data=2).to_dict()["data"]
        2
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ParallelConfig":
        """Builds a config from a dict such as `to_dict()` returns.

        Unknown keys are an error (a typo must not be silently ignored).

        Example:

        >>> ParallelConfig.from_dict({"data": 4, "microbatches": 2}).microbatches
        2
        """
        if not isinstance(values, dict):
            raise TypeError(
                f"`ParallelConfig.from_dict` expects a dict, got "
                f"{type(values).__name__}."
            )
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"Unknown ParallelConfig field(s) {unknown}; valid fields are "
                f"{sorted(known)}."
            )
        return cls(**values)

    def to_json(self) -> str:
        """The config as a JSON string.

        Example:

        >>> ParallelConfig().to_json()[:10]
        '{"data": 1'
        """
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "ParallelConfig":
        """Builds a config from `to_json()`'s output.

        Example:

        >>> ParallelConfig.from_json('{"data": 2}').data
        2
        """
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:  # a ValueError, with the position
            raise json.JSONDecodeError(
                f"ParallelConfig.from_json: `text` is not valid JSON ({error.msg}); "
                f"got {text!r}; expected an object such as '{{\"data\": 2}}'",
                error.doc, error.pos) from error
        return cls.from_dict(values)

    def replace(self, **changes) -> "ParallelConfig":
        """A copy with some fields changed (validated again).

        Example:

        >>> ParallelConfig(data=2).replace(microbatches=4).microbatches
        4
        """
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, default: "ParallelConfig | None" = None) -> "ParallelConfig":
        """The config in `$TFDIST_CONFIG` (JSON), else `default` (else defaults).

        `tfdist launch --config` and TFJob manifests set it on every task, so a
        training script can take its layout from the job that runs it.

        Example:

        >>> os.environ["TFDIST_CONFIG"] = '{"microbatches": 4}'
        >>> ParallelConfig.from_env().microbatches
        4
        >>> del os.environ["TFDIST_CONFIG"]
        """
        text = os.environ.get(CONFIG_ENV)
        if text is None:
            return default if default is not None else cls()
        try:
            return cls.from_json(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"${CONFIG_ENV} is not valid JSON ({error}): {text!r}"
            ) from error
