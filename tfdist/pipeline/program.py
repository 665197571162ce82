"""Compute programs: a replica's forward and backward work as one list of instructions.

Pipeline stages (`tfdist.pipeline.compute`) and ZeRO-3's units
(`tfdist.optim.zero3`) are run by one executor (`StagedCompute`) from a
`Program`: every instruction the replica's step runs, in the order it builds
them. A stage is a pipeline stage or a ZeRO-3 unit alike (a `Stage` of the
model's layers, run by its `StageRunner`). The instructions:

- `FORWARD` s, i: stage s's forward of microbatch i (its parameters gathered
  first when they are sharded; the last stage's ends in the microbatch's
  loss). With `remat` it keeps only its inputs.
- `BACKWARD` s, i: its backward, with `remat` after replaying the forward
  under a tape. With `defer` (a zero-bubble "B") the ops only the weight
  gradients need wait for the later `WEIGHTS` s, i.
- `WEIGHTS` s, i: those weight gradients (a zero-bubble "W").
- `REDUCE_SCATTER` s: the stage's weight gradients summed since its last
  reduce-scatter, reduce-scattered over the data group: the replica keeps its
  shard of each (ZeRO-3).

An instruction with `joins` runs in the block of the one before it (same
device, name scope and dependencies: ZeRO-3 reduce-scatters each unit's
gradients inside its backward). Each block waits for the work of the block
`window` places before it on its device: the previous one (a pipeline
device's actions in schedule order), or the one before that (ZeRO-3: two
units' gathered parameters alive at most). A block's work is the values it
gives the next (outputs, loss, gradients), or with `wait_for_all_ops` every
op it built (so its gathered parameters are released). No TensorFlow here.

Example:

>>> print(unit_program(units=2, microbatches=1))
unit0/fwd/mb0 (remat), unit1/fwd/mb0, unit1/bwd/mb0 + reduce_scatter,
unit0/bwd/mb0 (remat) + reduce_scatter
"""

import dataclasses

from tfdist.pipeline.schedule import BACKWARD as _B
from tfdist.pipeline.schedule import FORWARD as _F
from tfdist.pipeline.schedule import WEIGHTS as _W
from tfdist.pipeline.schedule import emission_order

FORWARD = "forward"
BACKWARD = "backward"
WEIGHTS = "weights"
REDUCE_SCATTER = "reduce_scatter"
OPS = (FORWARD, BACKWARD, WEIGHTS, REDUCE_SCATTER)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a `Program`.

    Attributes:
        op: one of `OPS`.
        stage: the stage (or unit) it runs.
        microbatch: the microbatch; None for a `REDUCE_SCATTER` of every
            microbatch's gradients.
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

    def scope(self, name: str) -> str:
        """Its ops' name scope under a program named `name` ("stage", "unit");
        a joined instruction's, inside its block's."""
        kind = {FORWARD: "fwd", BACKWARD: "bwd_input" if self.defer else "bwd",
                WEIGHTS: "bwd_weight", REDUCE_SCATTER: "reduce_scatter"}[self.op]
        if self.joins:
            return kind
        if self.microbatch is None:
            return f"{name}{self.stage}/{kind}"
        return f"{name}{self.stage}/{kind}/mb{self.microbatch}"


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

    def __str__(self):
        parts = []
        for instruction in self.instructions:
            text = instruction.scope(self.name) + " (remat)" * instruction.remat
            if instruction.joins and parts:
                parts[-1] += " + " + text
            else:
                parts.append(text)
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


def unit_program(units: int, microbatches: int) -> Program:
    """ZeRO-3's program on one device: for each microbatch, every unit's
    forward in order, then their backwards in reverse, each followed by the
    reduce-scatter of its gradients. Every unit but the last keeps only its
    inputs (its backward replays it; the last unit's backward follows its
    forward at once). Two blocks in flight at most.

    Example:

    >>> print(unit_program(units=3, microbatches=1))  # doctest: +NORMALIZE_WHITESPACE
    unit0/fwd/mb0 (remat), unit1/fwd/mb0 (remat), unit2/fwd/mb0,
    unit2/bwd/mb0 + reduce_scatter, unit1/bwd/mb0 (remat) + reduce_scatter,
    unit0/bwd/mb0 (remat) + reduce_scatter
    """
    last = units - 1
    instructions = []
    for i in range(microbatches):
        instructions += [Instruction(FORWARD, u, i, 0, remat=u != last) for u in range(units)]
        for u in reversed(range(units)):
            instructions += [Instruction(BACKWARD, u, i, 0, remat=u != last),
                             Instruction(REDUCE_SCATTER, u, i, 0, joins=True)]
    return Program("unit", tuple(instructions), window=2, wait_for_all_ops=True)
