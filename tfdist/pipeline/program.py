"""Compute programs: a replica's forward and backward work as one list of instructions.

Pipeline stages (`tfdist.pipeline.compute`) and ZeRO-3's units
(`tfdist.optim.zero3`) are run by one executor (`StagedCompute`) from a
`Program`: every instruction the replica's step runs, in the order it builds
them. A stage is a pipeline stage or a ZeRO-3 unit alike (a `Stage` of the
model's layers, run by its `StageRunner`). The instructions:

- `REFRESH` s: stage s's copies of the weights it shares with an earlier
  stage (a tied embedding) set to their values, before its first action.
- `GATHER` s, i: stage s's sharded parameters all-gathered over the data
  group (ZeRO-3), for the `FORWARD` or remat `BACKWARD` it leads.
- `FORWARD` s, i: stage s's forward of microbatch i (with the parameters its
  `GATHER` gave; the last stage's ends in the microbatch's loss). With
  `remat` it keeps only its inputs.
- `BACKWARD` s, i: its backward, with `remat` after replaying the forward
  under a tape. With `defer` (a zero-bubble "B") the ops only the weight
  gradients need wait for the later `WEIGHTS` s, i.
- `WEIGHTS` s, i: those weight gradients (a zero-bubble "W").
- `REDUCE_SCATTER` s: the stage's weight gradients summed since its last
  reduce-scatter, reduce-scattered over the data group: the replica keeps its
  shard of each (ZeRO-3).
- `UPDATE` s: the optimizer's update of the weights whose last reduce-scatter
  was stage s's, from their complete gradient shards, which are then
  released (ZeRO-3's units, when the step's update can apply weight by
  weight).

An instruction with `joins` runs in the block of the one before it (same
device, dependencies and name scope: a block is named by its first
instruction that is not a gather, its `lead`, and the others' ops are named
inside it by their kind; ZeRO-3 gathers a unit's parameters and
reduce-scatters its gradients inside its backward's block). Each block
waits for the work of the block `window` places before it on its device: the
previous one (a pipeline device's actions in schedule order), or the one
before that (ZeRO-3: two units' gathered parameters alive at most). A block's
work is the values it gives the next (outputs, loss, gradients), or with
`wait_for_all_ops` every op it built (so its gathered parameters are
released). No TensorFlow here.

The step's other work stays outside the program: the loss is the last
stage's forward's (its `head`, under the forward's tape), and the data
group's reduce and the optimizer's update are the step's reduce and update
parts (`tfdist.engine.step`), but for the updates `UPDATE` makes and the
step's update then skips.

Example:

>>> print(unit_program(units=2, microbatches=1))  # doctest: +NORMALIZE_WHITESPACE
gather + unit0/fwd/mb0 (remat), gather + unit1/fwd/mb0, unit1/bwd/mb0 + reduce_scatter,
gather + unit0/bwd/mb0 (remat) + reduce_scatter
"""

import dataclasses

from tfdist.pipeline.schedule import BACKWARD as _B
from tfdist.pipeline.schedule import FORWARD as _F
from tfdist.pipeline.schedule import WEIGHTS as _W
from tfdist.pipeline.schedule import emission_order

REFRESH = "refresh"
GATHER = "gather"
FORWARD = "forward"
BACKWARD = "backward"
WEIGHTS = "weights"
REDUCE_SCATTER = "reduce_scatter"
UPDATE = "update"
OPS = (REFRESH, GATHER, FORWARD, BACKWARD, WEIGHTS, REDUCE_SCATTER, UPDATE)
_KINDS = {REFRESH: "refresh", GATHER: "gather", FORWARD: "fwd", BACKWARD: "bwd",
          WEIGHTS: "bwd_weight", REDUCE_SCATTER: "reduce_scatter", UPDATE: "update"}


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a `Program`.

    Attributes:
        op: one of `OPS`.
        stage: the stage (or unit) it runs.
        microbatch: the microbatch; None for a `REFRESH`, or a
            `REDUCE_SCATTER` of every microbatch's gradients.
        device: the replica's device it runs on (an index into the replica's
            pipeline devices).
        remat: `FORWARD`: keep only the inputs; `BACKWARD`: replay the forward first.
        defer: `BACKWARD`: leave the weight gradients to a later `WEIGHTS`.
        joins: run in the block of the instruction before it.

    Example:

    >>> Instruction(BACKWARD, stage=1, microbatch=0, device=1, defer=True).scope("stage")
    'stage1/bwd_input/mb0'
    """

    op: str
    stage: int
    microbatch: int | None
    device: int
    remat: bool = False
    defer: bool = False
    joins: bool = False

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Instruction `op` must be one of {OPS}, got {self.op!r}.")

    @property
    def kind(self) -> str:
        """Its name in op names: "fwd", "bwd" ("bwd_input" deferred), ...

        Example:

        >>> Instruction(GATHER, stage=0, microbatch=0, device=0).kind
        'gather'
        """
        return "bwd_input" if self.op == BACKWARD and self.defer else _KINDS[self.op]

    def scope(self, name: str) -> str:
        """Its ops' name scope when it leads its block, under a program named
        `name` ("stage", "unit"); inside another's block, `kind`."""
        if self.microbatch is None:
            return f"{name}{self.stage}/{self.kind}"
        return f"{name}{self.stage}/{self.kind}/mb{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class Program:
    """A replica's instructions, in the order the executor builds them.

    Attributes:
        name: what its stages are called in op names ("stage", "unit").
        instructions: the `Instruction`s.
        window: each block waits for its device's block this many before it.
        wait_for_all_ops: a block's work is every op it built, not only the
            values it gives the next.

    Example:

    ```python
    for block in program.blocks():
        ...   # block[0] sets the device, scope and dependencies of the rest
    ```
    """

    name: str
    instructions: tuple
    window: int = 1
    wait_for_all_ops: bool = False

    @staticmethod
    def lead(block) -> Instruction:
        """The instruction that names `block`: its first that is not a gather.

        Example:

        >>> block = unit_program(units=1, microbatches=1).blocks()[0]
        >>> Program.lead(block).scope("unit")
        'unit0/fwd/mb0'
        """
        return next((i for i in block if i.op != GATHER), block[0])

    def blocks(self) -> list[list[Instruction]]:
        """The instructions grouped into blocks (an instruction and those that join it)."""
        blocks = []
        for instruction in self.instructions:
            if instruction.joins and blocks:
                blocks[-1].append(instruction)
            else:
                blocks.append([instruction])
        return blocks

    def then_reduce_scatter(self, device_of) -> "Program":
        """This program, then a `REDUCE_SCATTER` of each stage's gradients on
        its device (`device_of[s]`), once every microbatch's are summed.

        Example:

        >>> from tfdist.pipeline.schedule import stage_orders
        >>> program = pipeline_program(stage_orders("gpipe", 2, 1), [0, 1])
        >>> print(program.then_reduce_scatter([0, 1]))  # doctest: +NORMALIZE_WHITESPACE
        stage0/fwd/mb0, stage1/fwd/mb0, stage1/bwd/mb0, stage0/bwd/mb0,
        stage0/reduce_scatter, stage1/reduce_scatter
        """
        return dataclasses.replace(self, instructions=self.instructions + tuple(
            Instruction(REDUCE_SCATTER, s, None, d) for s, d in enumerate(device_of)))

    def then_gather(self) -> "Program":
        """This program with a `GATHER` leading each forward and each remat
        backward (sharded stages: ZeRO-3 under `pipeline`).

        Example:

        >>> from tfdist.pipeline.schedule import stage_orders
        >>> print(pipeline_program(stage_orders("gpipe", 1, 1), [0], remat=True).then_gather())
        gather + stage0/fwd/mb0 (remat), gather + stage0/bwd/mb0 (remat)
        """
        instructions = []
        for i in self.instructions:
            gathered = i.op == FORWARD or (i.op == BACKWARD and i.remat)
            if gathered:
                instructions.append(Instruction(GATHER, i.stage, i.microbatch, i.device,
                                                joins=i.joins))
            instructions.append(dataclasses.replace(i, joins=i.joins or gathered))
        return dataclasses.replace(self, instructions=tuple(instructions))

    def first_refreshing(self, stages, device_of) -> "Program":
        """This program after a `REFRESH` of each of `stages` (those with
        copies of another stage's weights) on its device `device_of[s]`.

        Example:

        >>> from tfdist.pipeline.schedule import stage_orders
        >>> print(pipeline_program(stage_orders("gpipe", 2, 1), [0, 1])
        ...       .first_refreshing([1], [0, 1]))  # doctest: +NORMALIZE_WHITESPACE
        stage1/refresh, stage0/fwd/mb0, stage1/fwd/mb0, stage1/bwd/mb0, stage0/bwd/mb0
        """
        return dataclasses.replace(self, instructions=tuple(
            Instruction(REFRESH, s, None, device_of[s]) for s in stages) + self.instructions)

    def __str__(self):
        parts = []
        for block in self.blocks():
            lead = self.lead(block)
            parts.append(" + ".join(
                (i.scope(self.name) if i is lead else i.kind) + " (remat)" * i.remat
                for i in block))
        return ", ".join(parts)


def pipeline_program(orders, device_of, remat: bool = False) -> Program:
    """The program of a pipeline schedule (`stage_orders`: each device's
    actions), its actions in emission order, stage s on device `device_of[s]`;
    every forward keeps only its inputs with `remat`.

    Example:

    >>> from tfdist.pipeline.schedule import stage_orders
    >>> print(pipeline_program(stage_orders("gpipe", 2, 1), [0, 1]))
    stage0/fwd/mb0, stage1/fwd/mb0, stage1/bwd/mb0, stage0/bwd/mb0
    """
    order = emission_order(orders)
    split = any(action.kind == _W for action in order)
    op = {_F: FORWARD, _B: BACKWARD, _W: WEIGHTS}
    return Program("stage", tuple(
        Instruction(op[a.kind], a.stage, a.microbatch, device_of[a.stage],
                    remat=remat and a.kind != _W, defer=split and a.kind == _B)
        for a in order))


def unit_program(units: int, microbatches: int, update: bool = False) -> Program:
    """ZeRO-3's program on one device: for each microbatch, every unit's
    parameters gathered and its forward run, in order, then their backwards
    in reverse, each followed by the reduce-scatter of its gradients (and with
    `update`, after the last microbatch's, by the update of its weights).
    Every unit but the last keeps only its inputs (its backward gathers again
    and replays it; the last unit's backward follows its forward at once,
    with its gathered parameters). Two blocks in flight at most.

    Example:

    >>> print(unit_program(units=3, microbatches=1))  # doctest: +NORMALIZE_WHITESPACE
    gather + unit0/fwd/mb0 (remat), gather + unit1/fwd/mb0 (remat), gather + unit2/fwd/mb0,
    unit2/bwd/mb0 + reduce_scatter, gather + unit1/bwd/mb0 (remat) + reduce_scatter,
    gather + unit0/bwd/mb0 (remat) + reduce_scatter
    >>> print(unit_program(units=1, microbatches=2, update=True))  # doctest: +NORMALIZE_WHITESPACE
    gather + unit0/fwd/mb0, unit0/bwd/mb0 + reduce_scatter, gather + unit0/fwd/mb1,
    unit0/bwd/mb1 + reduce_scatter + update
    """
    last = units - 1
    instructions = []
    for i in range(microbatches):
        instructions += [Instruction(FORWARD, u, i, 0, remat=u != last) for u in range(units)]
        for u in reversed(range(units)):
            instructions += [Instruction(BACKWARD, u, i, 0, remat=u != last),
                             Instruction(REDUCE_SCATTER, u, i, 0, joins=True)]
            if update and i == microbatches - 1:
                instructions.append(Instruction(UPDATE, u, i, 0, joins=True))
    return Program("unit", tuple(instructions), window=2, wait_for_all_ops=True).then_gather()
