"""`ParallelConfig`: the plain, serialisable description of a distributed run.

Strategies, the command line and the TFJob generator all take one; every entry point
calls `ParallelConfig.validate()` so a bad value is reported the same way everywhere,
before any device is touched or any step runs.
"""

import dataclasses
import inspect
import json
import os
import re
from typing import Any

from tfdist.pipeline import schedule as pipeline_schedule

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
SCHEDULES = tuple(pipeline_schedule.SCHEDULES)  # names `stage_orders` knows
ZERO_STAGES = (0, 1, 2, 3)
_FIXED_COMPRESSIONS = ("none", "bf16", "fp16", "int8")  # (the others take a parameter)
COMPRESSIONS = _FIXED_COMPRESSIONS + ("topk:<fraction>", "powersgd:<rank>")
# The values a field takes from a fixed list (the command line's choices).
CHOICES = {"precision": PRECISIONS, "schedule": SCHEDULES}
# The strategies a config can be validated for (`validate(strategy=...)`).
STRATEGIES = ("Strategy", "MultiWorkerStrategy", "ParameterServerStrategy", "ChiefStrategy")
# Fields that must keep their default under the asynchronous parameter-server
# strategy, and why.
_NOT_UNDER_PS = {
    "pipeline": (1, "pipeline stages need synchronous steps"),
    "tensor": (1, "tensor shards need synchronous collectives"),
    "zero": (0, "optimizer state already lives, unreplicated, on the ps tasks"),
    "compression": ("none", "gradients go to the ps tasks, not through collectives"),
    "compression_warmup": (0, "gradients go to the ps tasks, not through collectives"),
    "bucket_bytes": (0, "gradients go to the ps tasks, not through collectives"),
}

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
            sharded, 2 optimizer state and gradients sharded, 3 parameters
            too (gathered layer by layer: `tfdist.optim.zero3`).
        precision: "float32", "mixed_float16" or "mixed_bfloat16".
        xla: jit-compile the per-replica compute with XLA.
        schedule: pipeline schedule: "gpipe", "1f1b", "zb1" (zero bubble:
            weight gradients deferred into 1F1B's bubble), "interleaved"
            (Megatron's interleaved 1F1B over `virtual_stages`) or "zbv"
            (zero bubble over two stages per device placed in a V).
        virtual_stages: with schedule "interleaved", the stages per device
            (>= 2): the model is cut into `pipeline * virtual_stages` stages
            and device d runs stages d, d + pipeline, ...; with "zbv", 2
            (device d runs stages d and 2 * pipeline - 1 - d).
        stage_boundaries: with `pipeline` > 1, the names of the first layer
            of each stage after the first (`model_stages - 1` names); default
            (None): stages balanced by estimated compute.
        remat: with `pipeline` > 1, recompute each stage's forward in its
            backward (less activation memory, more compute).
        vocab_parallel_classifier: with `tensor` > 1, split the model's final
            Dense by classes and compute its sparse softmax cross-entropy
            sharded (the model must be compiled with
            `SparseCategoricalCrossentropy(from_logits=True)`).
        zero3_unit_params: with `zero=3`, the fewest parameters a unit (what
            is gathered at once) holds: consecutive layer calls join one unit
            until it has at least this many (FSDP's size-based wrapping);
            0 (the default): one unit per layer call with weights.
        compression: what the gradients cross devices as: "none" (the
            default), "bf16" or "fp16" (each floating gradient cast for the
            step's gradient collective, summed in that dtype, and cast back:
            half the bytes on the wire), "int8" (each block of 256 elements
            as int8 with its own scale, gathered and summed by each
            replica: about a quarter of the bytes), "topk:<fraction>" such as
            "topk:0.01" (each replica sends that fraction of each gradient's
            elements, its largest, as values and indices, and keeps the rest
            as an error-feedback residual added to its next gradient), or
            "powersgd:<rank>" such as "powersgd:4" (each matrix gradient
            all-reduced as two rank-`rank` factors, PowerSGD, with error
            feedback); `tfdist.engine.compression`. Under ZeRO, "bf16",
            "fp16" and "int8" also send the reduce-scatter's gradients and
            zero=3's gathered parameters so (ZeRO++'s qgZ and qwZ for int8).
        compression_warmup: with "topk:..." or "powersgd:...", the first this
            many steps sum the gradients uncompressed, and compression starts
            after them (PyTorch's `start_powerSGD_iter`, Deep Gradient
            Compression's warm-up); 0 (the default): from the first step.
        bucket_bytes: 0 (the default): the step's gradient all-reduce sums
            every gradient of a dtype in one collective; > 0: in buckets of
            consecutive gradients of at most this many bytes each (a larger
            gradient alone), one collective per bucket (PyTorch DDP's
            `bucket_cap_mb`): smaller transient buffers, more collectives.

    Every rule on how the fields combine is checked by `validate`, which
    every entry point runs (the strategies, `tfdist config`, `tfdist launch`,
    `tfdist tfjob`), so a combination is accepted or refused the same way
    everywhere.

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
    virtual_stages: int = 1
    stage_boundaries: tuple[str, ...] | None = None
    remat: bool = False
    vocab_parallel_classifier: bool = False
    zero3_unit_params: int = 0
    compression: str = "none"
    compression_warmup: int = 0
    bucket_bytes: int = 0

    def __post_init__(self):
        if isinstance(self.stage_boundaries, list):  # from JSON: kept immutable
            object.__setattr__(self, "stage_boundaries", tuple(self.stage_boundaries))
        self.validate()

    def validate(self, strategy: str | None = None) -> "ParallelConfig":
        """Checks every field and every rule on how fields combine; returns
        the config, so calls can be chained.

        With `strategy` (one of `STRATEGIES`), also the rules of that
        strategy: `MultiWorkerStrategy` runs pipeline and tensor parallelism
        one at a time; `ParameterServerStrategy` (asynchronous) runs neither,
        nor `zero`; `ChiefStrategy` runs one replica (`data` and `tensor` 1).

        Raises `TypeError` for a value of the wrong type, `ValueError` for a
        value out of range or a combination that cannot work, and
        `NotImplementedError` for a combination this version does not run,
        each naming the arguments, the values given and what would be valid.

        Example:

        >>> ParallelConfig(data=2).validate().data
        2
        >>> ParallelConfig(data=2, tensor=2, xla=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        NotImplementedError: `tensor=2` with `xla=True` is not available: ...
        """
        self._check_types()
        self._check_ranges()
        self._check_combinations()
        if strategy is not None:
            self._check_strategy(strategy)
        return self

    @classmethod
    def field_docs(cls) -> dict:
        """{field name: its description in the class docstring's Args, on one
        line}: the command line's help for each field's flag.

        Example:

        >>> ParallelConfig.field_docs()["pipeline"]
        "pipeline stages (size of the mesh's pipeline axis)."
        """
        args = (inspect.getdoc(cls) or "").partition("Args:\n")[2]  # none under -OO
        docs, name = {}, None
        for line in args.splitlines():
            entry = re.fullmatch(r"    (\w+): (.*)", line)
            if entry:
                name, docs[entry[1]] = entry[1], entry[2]
            elif line.startswith("        ") and name:
                docs[name] += " " + line.strip()
            else:
                break
        return docs

    def _check_types(self):
        for name in ("data", "pipeline", "tensor", "microbatches", "zero", "virtual_stages",
                     "zero3_unit_params"):
            value = getattr(self, name)
            if name == "data" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"`{name}` must be an int, got {value!r} of type "
                    f"{type(value).__name__}."
                )
        for name in ("xla", "remat", "vocab_parallel_classifier"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"`{name}` must be a bool, got {value!r} of type "
                    f"{type(value).__name__}."
                )
        boundaries = self.stage_boundaries
        if boundaries is not None and (
                not isinstance(boundaries, tuple)
                or not all(isinstance(name, str) for name in boundaries)):
            raise TypeError(
                f"`stage_boundaries` must be a list of layer names, got {boundaries!r}.")

    def _check_ranges(self):
        for name in ("data", "pipeline", "tensor", "microbatches", "virtual_stages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(
                    f"`{name}` must be an int >= 1, got {value!r}."
                )
        if self.zero not in ZERO_STAGES:
            raise ValueError(
                f"`zero` must be one of {ZERO_STAGES} (0: off, 1: optimizer "
                f"state sharded, 2: optimizer state and gradients sharded, 3: "
                f"parameters too), "
                f"got {self.zero!r}."
            )
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise ValueError(
                f"`precision` must be one of {PRECISIONS}, got {self.precision!r}."
            )
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise ValueError(
                f"`schedule` must be one of {SCHEDULES}, got {self.schedule!r}."
            )
        if not isinstance(self.compression, str) or (
                self.compression not in _FIXED_COMPRESSIONS and self.topk_fraction is None
                and self.powersgd_rank is None):
            raise ValueError(
                f"`compression` must be one of {COMPRESSIONS} (a fraction in (0, 1), "
                f"such as 'topk:0.01'; a rank >= 1, such as 'powersgd:4'), got "
                f"{self.compression!r}.")

    def _check_combinations(self):
        if self.zero and self.data == 1:
            raise ValueError(
                f"`zero={self.zero}` shards optimizer state across the "
                f"data-parallel replicas, but `data=1`: there is nothing to "
                f"shard. Use data >= 2, or zero=0.")
        if self.bucket_bytes < 0:
            raise ValueError(f"`bucket_bytes` must be an int >= 0, got {self.bucket_bytes!r}.")
        if self.compression_warmup < 0:
            raise ValueError(f"`compression_warmup` must be an int >= 0, got "
                             f"{self.compression_warmup!r}.")
        if self.compression_warmup and not self.keeps_replica_state:
            raise ValueError(
                f"`compression_warmup={self.compression_warmup}` delays Top-K or PowerSGD "
                f"compression, but `compression={self.compression!r}`: use "
                f"'topk:<fraction>' or 'powersgd:<rank>', or drop it.")
        if self.zero3_unit_params < 0:
            raise ValueError(
                f"`zero3_unit_params` must be an int >= 0, got {self.zero3_unit_params!r}.")
        if self.zero3_unit_params and self.zero != 3:
            raise ValueError(
                f"`zero3_unit_params={self.zero3_unit_params}` sizes the units `zero=3` "
                f"gathers, but `zero={self.zero}`: use zero=3, or drop it.")
        if self.zero == 3 and (self.xla or (self.tensor > 1 and self.pipeline > 1)):
            raise NotImplementedError(
                f"`zero=3` with {' and '.join(self.changed('pipeline', 'tensor', 'xla'))} is not "
                f"supported in this version: zero=3 runs on data parallelism with "
                f"pipeline stages or tensor groups (and microbatches, precision). Use "
                f"zero=2 with those options, or drop one.")
        if self.zero == 3 and self.pipeline > 1 and not self.remat:
            raise ValueError(
                f"`zero=3` with `pipeline={self.pipeline}` needs `remat=True`: each "
                f"stage's parameters are gathered for its forward and again for its "
                f"backward, which recomputes the forward (what the forward used is "
                f"not kept).")
        if self.compression == "int8" or self.keeps_replica_state:
            self._check_gathered_compression()
        if self.zero3_unit_params and self.pipeline > 1:
            raise ValueError(
                f"`zero3_unit_params={self.zero3_unit_params}` sizes units, but with "
                f"`pipeline={self.pipeline}` zero=3 gathers each stage's parameters "
                f"as one unit: drop it, or use pipeline=1.")
        if self.pipeline == 1 and (self.stage_boundaries is not None or self.remat):
            raise ValueError(
                "`stage_boundaries` and `remat` apply to pipeline stages, but "
                "`pipeline=1`: use pipeline >= 2, or drop them.")
        self._check_interleaving()
        if self.stage_boundaries is not None:
            check_boundary_count(list(self.stage_boundaries), self.model_stages)
        if self.vocab_parallel_classifier and self.tensor == 1:
            raise ValueError(
                "`vocab_parallel_classifier=True` splits the final classifier "
                "over a tensor group, but `tensor=1`: use tensor >= 2.")
        if self.tensor > 1 and self.xla:
            # TensorFlow: "Collectives are not yet implemented for CPU devices
            # when compiling with XLA".
            raise NotImplementedError(
                f"`tensor={self.tensor}` with `xla=True` is not available: the "
                f"tensor-parallel layers all-reduce inside the compiled computation, "
                f"and TensorFlow cannot compile collectives with XLA on CPU devices. "
                f"Use xla=False with tensor parallelism.")

    def _check_interleaving(self):
        virtual = self.schedule in pipeline_schedule.VIRTUAL
        needed = pipeline_schedule.VIRTUAL.get(self.schedule)
        if virtual != (self.virtual_stages > 1) or needed not in (None, self.virtual_stages):
            raise ValueError(
                f"`virtual_stages` must be >= 2 with schedule='interleaved', 2 with "
                f"schedule='zbv' (two stages per device, in a V) and 1 with the other "
                f"schedules, got virtual_stages={self.virtual_stages} with "
                f"schedule={self.schedule!r}.")
        if virtual and self.pipeline == 1:
            raise ValueError(
                f"schedule={self.schedule!r} places several stages on each pipeline "
                f"device: it needs pipeline >= 2, got pipeline=1.")
        if self.schedule == "interleaved" and (
                self.pipeline == 1 or self.microbatches % self.pipeline):
            raise ValueError(
                f"schedule='interleaved' runs microbatches in groups of `pipeline` "
                f"through each device's stages: it needs pipeline >= 2 and "
                f"`microbatches` a multiple of `pipeline`, got pipeline={self.pipeline}, "
                f"microbatches={self.microbatches}.")

    @property
    def model_stages(self) -> int:
        """The stages the model is cut into: `pipeline * virtual_stages`.

        Example:

        >>> ParallelConfig(pipeline=2, microbatches=4, schedule="interleaved",
        ...                virtual_stages=2).model_stages
        4
        """
        return self.pipeline * self.virtual_stages

    @property
    def shards_state(self) -> bool:
        """Whether the step holds some of the model's state as shards (any
        `zero`, `tensor` or `pipeline`): the scope creates it as shards, and
        `BackupAndRestore` keeps sharded backups.

        Example:

        >>> ParallelConfig(data=4, zero=1).shards_state, ParallelConfig(data=4).shards_state
        (True, False)
        """
        return bool(self.zero) or self.tensor > 1 or self.pipeline > 1

    @property
    def reduces_stage_gradients_alone(self) -> bool:
        """Whether a replica's gradients are on its pipeline stages' devices
        with no tensor group's all-reduce to pack them: `tf.distribute`
        packs only values on one device, so the data reduce takes them one
        at a time, and the stages, not in step, reach it one at a time
        (`tfdist.engine.modes.planned_peak`).

        Example:

        >>> ParallelConfig(data=2, pipeline=2).reduces_stage_gradients_alone
        True
        >>> ParallelConfig(pipeline=2, tensor=2).reduces_stage_gradients_alone
        False
        """
        return self.pipeline > 1 and self.tensor == 1

    @property
    def computes_microbatches_whole(self) -> bool:
        """Whether a replica runs each microbatch's whole forward and then
        its backward, keeping the activations until that backward and the
        local gradients of all its weights at its end: without zero=3's
        units (replayed one at a time for their backward) and pipeline
        stages (`tfdist.sharding.peak.predict_peak`).

        Example:

        >>> ParallelConfig(data=2, microbatches=2).computes_microbatches_whole
        True
        >>> ParallelConfig(data=2, zero=3).computes_microbatches_whole
        False
        """
        return self.zero < 3 and self.pipeline == 1

    @property
    def creates_weights_as_shards(self) -> bool:
        """Whether the scope creates trainable weights as shards: the step
        keeps them split, sharded or on their stage's devices (`zero=3`,
        `tensor`, `pipeline`).

        Example:

        >>> ParallelConfig(data=4, zero=3).creates_weights_as_shards
        True
        >>> ParallelConfig(data=4, zero=1).creates_weights_as_shards
        False
        """
        return self.shards_parameters or self.tensor > 1 or self.pipeline > 1

    def gradients_beside(self, local: int, largest: int) -> int:
        """The bytes of gradients a device's step holds beside its `local`
        ones (without zero=2 and 3's reduce-scatter): the microbatches'
        running sum, or a data all-reduce's packed buffer (one bucket of
        `bucket_bytes` at a time, the `largest` gradient at least), or none
        (`tfdist.sharding.peak`).

        Example:

        >>> ParallelConfig(data=4).gradients_beside(400, 100)
        400
        >>> ParallelConfig(data=4, bucket_bytes=64).gradients_beside(400, 100)
        100
        >>> ParallelConfig(data=1, tensor=4).gradients_beside(400, 100)
        0
        """
        if self.microbatches > 1:
            return local
        return self.all_reduce_pack(local, largest) if self.data > 1 else 0

    def all_reduce_pack(self, local: int, largest: int) -> int:
        """The bytes of a data all-reduce's packed buffer for `local` bytes
        of gradients: all of them, or with `bucket_bytes` one bucket (the
        `largest` gradient at least, which goes alone), or the `largest`
        gradient where each goes alone (`reduces_stage_gradients_alone`).

        Example:

        >>> ParallelConfig(bucket_bytes=64).all_reduce_pack(400, 100)
        100
        >>> ParallelConfig(bucket_bytes=256).all_reduce_pack(400, 100)
        256
        >>> ParallelConfig(data=2, pipeline=2).all_reduce_pack(400, 100)
        100
        """
        if self.reduces_stage_gradients_alone:
            return largest
        return min(local, max(self.bucket_bytes, largest)) if self.bucket_bytes else local

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether the optimizer's state is sharded over the data group (any
        `zero`): the scope creates every slot as shards.

        Example:

        >>> ParallelConfig(data=4, zero=1).shards_optimizer_state
        True
        """
        return self.zero > 0

    @property
    def shards_parameters(self) -> bool:
        """Whether the parameters are sharded over the data group (`zero=3`):
        a tensor rank's slice of a split weight too.

        Example:

        >>> ParallelConfig(data=4, zero=2).shards_parameters
        False
        """
        return self.zero == 3

    def changed(self, *names) -> list[str]:
        """`name=value` of each of the fields `names` not at its default.

        Example:

        >>> ParallelConfig(data=2, zero=1, xla=True).changed("zero", "tensor", "xla")
        ['zero=1', 'xla=True']
        """
        defaults = {field.name: field.default for field in dataclasses.fields(ParallelConfig)}
        return [f"{name}={getattr(self, name)!r}" for name in names
                if getattr(self, name) != defaults[name]]

    @property
    def topk_fraction(self) -> float | None:
        """The fraction of `compression="topk:<fraction>"`, else None.

        Example:

        >>> ParallelConfig(data=4, compression="topk:0.01").topk_fraction
        0.01
        """
        kind, _, fraction = self.compression.partition(":")
        try:
            value = float(fraction) if kind == "topk" else None
        except ValueError:
            return None
        return value if value is not None and 0 < value < 1 else None

    @property
    def powersgd_rank(self) -> int | None:
        """The rank of `compression="powersgd:<rank>"`, else None.

        Example:

        >>> ParallelConfig(data=4, compression="powersgd:4").powersgd_rank
        4
        """
        kind, _, rank = self.compression.partition(":")
        if kind != "powersgd" or not rank.isdigit() or int(rank) < 1:
            return None
        return int(rank)

    @property
    def keeps_replica_state(self) -> bool:
        """Whether the step keeps state of its own on each replica beside the
        model's and optimizer's (the residuals of `compression="topk:..."`
        and `"powersgd:..."`): its checkpoints are
        `tfdist.checkpoint.ShardedCheckpoint`s, which save it.

        Example:

        >>> ParallelConfig(data=4, compression="topk:0.01").keeps_replica_state
        True
        """
        return self.topk_fraction is not None or self.powersgd_rank is not None

    def _check_gathered_compression(self):
        """int8, Top-K and PowerSGD take each replica's whole local gradient
        of a weight: refused where a replica's gradients are not whole
        (tensor slices, pipeline stages); Top-K and PowerSGD, which keep the
        rest as their residual, also with zero=2's reduce-scatter and
        zero=3's units, and under loss scaling (the residual would mix
        gradients of different scales). int8 under ZeRO quantises its
        reduce-scatter (and zero=3's gathers) itself."""
        residual = self.keeps_replica_state
        off = [f"`{name}={value!r}`" for name, value, plain in (
            ("zero", self.zero, not residual or self.zero < 2),
            ("tensor", self.tensor, self.tensor == 1),
            ("pipeline", self.pipeline, self.pipeline == 1),
            ("precision", self.precision, not residual or self.precision != "mixed_float16"))
            if not plain]
        if off:
            raise NotImplementedError(
                f"`compression={self.compression!r}` with {' and '.join(off)} is not "
                f"available in this version: it compresses each replica's whole local "
                f"gradient{' and keeps the rest as its residual' if residual else ''}, "
                f"which needs data parallelism (with microbatches"
                f"{', zero <= 1, precision float32 or mixed_bfloat16' if residual else ', zero'}"
                f"). Use 'bf16' or 'fp16' compression there, or drop "
                f"{'that option' if len(off) == 1 else 'those options'}.")

    def _check_strategy(self, strategy):
        if strategy not in STRATEGIES:
            raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}.")
        if strategy == "MultiWorkerStrategy" and self.pipeline > 1 and self.tensor > 1:
            raise NotImplementedError(
                f"`pipeline={self.pipeline}` with `tensor={self.tensor}` runs on "
                f"one host (tfdist.Strategy); MultiWorkerStrategy takes one of them.")
        if strategy == "MultiWorkerStrategy" and self.pipeline > 1 and self.zero == 3:
            raise NotImplementedError(
                f"`zero=3` with `pipeline={self.pipeline}` runs on one host in this "
                f"version (tfdist.Strategy: every replica's stage devices local); "
                f"MultiWorkerStrategy takes zero <= 2 with `pipeline`.")
        replicas = (self.data or 1) * self.tensor
        if strategy == "ChiefStrategy" and replicas > 1:
            raise NotImplementedError(
                f"`data={self.data}` x `tensor={self.tensor}` is {replicas} replicas; a "
                f"ChiefStrategy runs one (TensorFlow's MirroredStrategy puts no replicas "
                f"on several workers' devices in eager mode, and data and tensor groups "
                f"are replicas). Use `pipeline` equal to the workers' devices, or "
                f"tfdist.MultiWorkerStrategy for data and tensor parallelism across "
                f"workers.")
        if strategy == "ParameterServerStrategy":
            for name, (off, why) in _NOT_UNDER_PS.items():
                if getattr(self, name) != off:
                    raise ValueError(
                        f"`{name}={getattr(self, name)!r}` is not available under "
                        f"ParameterServerStrategy ({why}); use {name}={off!r}, or "
                        f"tfdist.Strategy / tfdist.MultiWorkerStrategy.")

    def resolve(self, num_devices: int) -> "ParallelConfig":
        """The config for a mesh of `num_devices` devices, `data` filled in.

        `data * pipeline * tensor` must equal `num_devices`; a `data` of None
        becomes `num_devices / (pipeline * tensor)`.

        Example:

        >>> ParallelConfig().resolve(4).data
        4
        >>> ParallelConfig(data=4).resolve(2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: The mesh data=4 x pipeline=1 x tensor=1 needs 4 devices, but there are 2: ...
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

    @property
    def devices_needed(self) -> int | None:
        """The devices the mesh needs, `data * pipeline * tensor`; None while
        `data` is unset (it then takes every device, `resolve`).

        Example:

        >>> ParallelConfig(data=2, tensor=2).devices_needed, ParallelConfig().devices_needed
        (4, None)
        """
        return None if self.data is None else self.data * self.pipeline * self.tensor

    def for_worker_tasks(self, workers: int) -> "ParallelConfig":
        """The config of a `ParameterServerStrategy` over `workers` worker
        tasks: `data` is their number (or unset, then filled in).

        Example:

        >>> ParallelConfig().for_worker_tasks(2).data
        2
        >>> ParallelConfig(data=4).for_worker_tasks(2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `data=4` must equal the number of worker tasks, 2, ...
        """
        if self.data not in (None, workers):
            raise ValueError(
                f"`data={self.data}` must equal the number of worker tasks, "
                f"{workers}, under a ParameterServerStrategy (or be left unset)."
            )
        return self.resolve(workers)

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (JSON-serialisable).

        Example:

        >>> ParallelConfig(data=2).to_dict()["data"]
        2
        """
        values = dataclasses.asdict(self)
        if self.stage_boundaries is not None:
            values["stage_boundaries"] = list(self.stage_boundaries)
        return values

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

        >>> ParallelConfig(data=2).to_json()[:10]
        '{"data": 2'
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


def check_boundary_count(boundaries, stages: int):
    """`stage_boundaries` names one layer per stage after the first.

    Example:

    >>> check_boundary_count(["dense_2"], 3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `stage_boundaries` must name 2 layer(s) for 3 stages ...
    """
    if isinstance(boundaries, str) or len(boundaries) != stages - 1:
        raise ValueError(
            f"`stage_boundaries` must name {stages - 1} layer(s) for "
            f"{stages} stages (the first layer of each stage after the "
            f"first), got {boundaries!r}.")


