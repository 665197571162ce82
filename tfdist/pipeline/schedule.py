"""Pipeline schedules as data: which stage runs which microbatch's forward or
backward, and in what order.

A schedule is, for each stage, the list of its `Action`s in the order the stage
runs them (`stage_orders`). From those lists alone follow the clock of the
whole pipeline (`clock_steps`, `emission_order`), the activations each stage
holds at its peak (`held_activations`) and a printable timetable (`grid`).
No TensorFlow here: the step engine (`tfdist.pipeline.compute`) executes the
actions.

A new schedule is one function `(stages, microbatches) -> list[list[Action]]`
added to `SCHEDULES`, whose keys are the names `ParallelConfig.schedule`
accepts.

Example:

>>> print(grid(stage_orders("1f1b", 2, 2)))
step  stage 0  stage 1
0     F0       .
1     F1       F0
2     .        B0
3     B0       F1
4     .        B1
5     B1       .
"""

import dataclasses
import re

FORWARD = "F"
BACKWARD = "B"
# The kinds of action a schedule may contain. A zero-bubble schedule would add
# "W" (the weight gradients, split from the input gradients of "B").
KINDS = (FORWARD, BACKWARD)

_TEXT = re.compile(r"(\d+)([A-Z])(\d+)")


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of pipeline work: stage `stage` runs the `kind` ("F" forward,
    "B" backward) of microbatch `microbatch`.

    Written compactly as stage, kind, microbatch.

    Example:

    >>> str(Action(1, "F", 0))
    '1F0'
    >>> Action.parse("2B7")
    Action(stage=2, kind='B', microbatch=7)
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self):
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"Action `{field}` must be an int >= 0, got {value!r}.")
        if self.kind not in KINDS:
            raise ValueError(f"Action `kind` must be one of {KINDS}, got {self.kind!r}.")

    def __str__(self):
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action written as `text` ("1F0": stage 1, forward, microbatch 0).

        Example:

        >>> Action.parse("0B3").microbatch
        3
        """
        match = _TEXT.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                f"`text` must be stage, kind and microbatch such as '1F0', got {text!r}.")
        stage, kind, microbatch = match.groups()
        return cls(int(stage), kind, int(microbatch))


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """GPipe: every stage runs all its forwards, then all its backwards; each
    stage holds every microbatch's activations at its peak.

    Example:

    >>> [" ".join(map(str, order)) for order in gpipe(2, 2)]
    ['0F0 0F1 0B0 0B1', '1F0 1F1 1B0 1B1']
    """
    return [[Action(s, FORWARD, i) for i in range(microbatches)]
            + [Action(s, BACKWARD, i) for i in range(microbatches)]
            for s in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B: stage s runs `stages - s - 1` warm-up forwards, then one forward
    and one backward in turn, then the remaining backwards; it holds at most
    `stages - s` microbatches' activations.

    Example:

    >>> [" ".join(map(str, order)) for order in one_f_one_b(2, 3)]
    ['0F0 0F1 0B0 0F2 0B1 0B2', '1F0 1B0 1F1 1B1 1F2 1B2']
    """
    orders = []
    for s in range(stages):
        warm = min(stages - s - 1, microbatches)
        order = [Action(s, FORWARD, i) for i in range(warm)]
        for i in range(microbatches - warm):
            order += [Action(s, FORWARD, warm + i), Action(s, BACKWARD, i)]
        order += [Action(s, BACKWARD, i) for i in range(microbatches - warm, microbatches)]
        orders.append(order)
    return orders


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def stage_orders(kind: str, stages: int, microbatches: int) -> list[list[Action]]:
    """Each stage's actions in the order it runs them, for schedule `kind` (a
    key of `SCHEDULES`).

    Example:

    >>> [str(action) for action in stage_orders("1f1b", 2, 3)[0]]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    if kind not in SCHEDULES:
        raise ValueError(f"`kind` must be one of {tuple(SCHEDULES)}, got {kind!r}.")
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")
    return SCHEDULES[kind](stages, microbatches)


def needs(action: Action, stages: int) -> list[Action]:
    """The actions of other stages (or of the same stage, for a backward) whose
    results `action` reads.

    Example:

    >>> [str(a) for a in needs(Action.parse("1B0"), 3)]
    ['1F0', '2B0']
    """
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [Action(s - 1, FORWARD, i)] if s > 0 else []
    needs = [Action(s, FORWARD, i)]
    if s < stages - 1:
        needs.append(Action(s + 1, BACKWARD, i))
    return needs


def clock_steps(orders: list[list[Action]]) -> list[list[Action]]:
    """The schedule on a clock, every action taking one step: in each step,
    every stage whose next action reads only results of earlier steps runs
    it. A step holds at most one action per stage, in stage order.

    Raises `ValueError` if the orders deadlock (a stage's next action waits
    for one that can never run).

    Example:

    >>> [" ".join(map(str, step)) for step in clock_steps(gpipe(2, 1))]
    ['0F0', '1F0', '1B0', '0B0']
    """
    stages = len(orders)
    done, position, steps = set(), [0] * stages, []
    remaining = sum(len(order) for order in orders)
    while remaining:
        step = [orders[s][position[s]] for s in range(stages)
                if position[s] < len(orders[s])
                and all(need in done for need in needs(orders[s][position[s]], stages))]
        if not step:
            waiting = [str(orders[s][position[s]]) for s in range(stages)
                       if position[s] < len(orders[s])]
            raise ValueError(
                f"`orders` deadlock: no stage can run its next action {waiting} "
                f"(each waits for a result no stage can produce).")
        for action in step:
            position[action.stage] += 1
        done.update(step)
        remaining -= len(step)
        steps.append(step)
    return steps


def emission_order(orders: list[list[Action]]) -> list[Action]:
    """Every stage's actions merged into one order that respects both each
    stage's order and the data dependencies (forward after the previous
    stage's forward, backward after the stage's forward and the next stage's
    backward): `clock_steps` one after another.

    Example:

    >>> [str(action) for action in emission_order(gpipe(2, 1))]
    ['0F0', '1F0', '1B0', '0B0']
    """
    return [action for step in clock_steps(orders) for action in step]


def held_activations(orders: list[list[Action]]) -> list[int]:
    """For each stage, the largest number of microbatches whose activations it
    holds at once: forward done, backward not yet.

    Example:

    >>> held_activations(stage_orders("gpipe", 4, 8))
    [8, 8, 8, 8]
    >>> held_activations(stage_orders("1f1b", 4, 8))
    [4, 3, 2, 1]
    """
    peaks = []
    for order in orders:
        held = peak = 0
        for action in order:
            held += {FORWARD: 1, BACKWARD: -1}[action.kind]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def grid(orders: list[list[Action]]) -> str:
    """The schedule as a table: one row per clock step (`clock_steps`), one
    column per stage, cells such as "F0" (forward of microbatch 0), "B3", or
    "." (the stage is idle: the pipeline's bubble).

    Example:

    >>> print(grid(stage_orders("gpipe", 2, 2)))
    step  stage 0  stage 1
    0     F0       .
    1     F1       F0
    2     .        F1
    3     .        B0
    4     B0       B1
    5     B1       .
    """
    steps = clock_steps(orders)
    header = ["step"] + [f"stage {s}" for s in range(len(orders))]
    rows = [header]
    for number, step in enumerate(steps):
        cells = ["."] * len(orders)
        for action in step:
            cells[action.stage] = f"{action.kind}{action.microbatch}"
        rows.append([str(number)] + cells)
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)
