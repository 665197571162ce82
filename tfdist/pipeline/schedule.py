"""Pipeline schedules as data: which stage runs which microbatch's forward or
backward, and in what order.

A schedule is, for each device of the pipeline, the list of its `Action`s in
the order the device runs them (`stage_orders`). An action is the forward
("F"), backward ("B") or, in a zero-bubble schedule, the weight-gradient part
("W", split from the backward, whose "B" then only computes the gradients of
the stage's inputs) of one microbatch on one stage. Usually a device runs one
stage; with virtual stages (`interleaved`) the model is cut into p x v stages
and device d runs stages d, d + p, d + 2p, ... (ZB-V: stages d and 2p - 1 - d,
`stage_device`). From the lists alone follow the
clock of the whole pipeline (`clock_steps`, `emission_order`), the activations
each device holds at its peak (`held_activations`) and a printable timetable
(`grid`). No TensorFlow here: the step engine (`tfdist.pipeline.compute`)
executes the actions.

A new schedule is one function `(stages, microbatches, virtual_stages) ->
list[list[Action]]` added to `SCHEDULES`, whose keys are the names
`ParallelConfig.schedule` accepts.

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

import collections
import dataclasses
import re

FORWARD = "F"
BACKWARD = "B"
WEIGHTS = "W"
# The kinds of action a schedule may contain: a zero-bubble schedule splits the
# weight gradients ("W") from the input gradients of "B".
KINDS = (FORWARD, BACKWARD, WEIGHTS)

_TEXT = re.compile(r"(\d+)([A-Z])(\d+)")


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of pipeline work: stage `stage` runs the `kind` ("F" forward,
    "B" backward, "W" weight gradients) of microbatch `microbatch`.

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


def gpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """GPipe: every stage runs all its forwards, then all its backwards; each
    stage holds every microbatch's activations at its peak.

    Example:

    >>> [" ".join(map(str, order)) for order in gpipe(2, 2)]
    ['0F0 0F1 0B0 0B1', '1F0 1F1 1B0 1B1']
    """
    return [[Action(s, FORWARD, i) for i in range(microbatches)]
            + [Action(s, BACKWARD, i) for i in range(microbatches)]
            for s in range(stages)]


def one_f_one_b(stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
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


def zero_bubble_h1(stages: int, microbatches: int,
                   virtual_stages: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B's forwards
    and backwards, each backward ("B") computing only the gradients of the
    stage's inputs, which the previous stage waits for; the gradients of the
    stage's weights ("W") are deferred into the clock steps where the stage
    would otherwise wait. A stage runs its next forward or backward as soon as
    it can, and a W (oldest first) when it cannot, or when one more forward
    would hold more microbatches than 1F1B's first stage does (`stages`; a
    microbatch's activations are held until its W). With forward, backward
    and weight work of equal length a step lasts m (F + B + W) + (p - 1) F:
    the bubble is a third of 1F1B's.

    Example:

    >>> [" ".join(map(str, order)) for order in zero_bubble_h1(2, 2)]
    ['0F0 0F1 0B0 0W0 0B1 0W1', '1F0 1B0 1F1 1B1 1W0 1W1']
    """
    plan = one_f_one_b(stages, microbatches)
    orders = [[] for _ in range(stages)]
    done, position, held = set(), [0] * stages, [0] * stages
    deferred = [collections.deque() for _ in range(stages)]  # B done, W not
    while any(position[s] < len(plan[s]) or deferred[s] for s in range(stages)):
        step = []
        for s in range(stages):
            nxt = plan[s][position[s]] if position[s] < len(plan[s]) else None
            if (nxt is not None and all(n in done for n in needs(nxt, stages))
                    and not (nxt.kind == FORWARD and held[s] >= stages)):
                position[s] += 1
                held[s] += nxt.kind == FORWARD
                step.append(nxt)
            elif deferred[s]:
                held[s] -= 1
                step.append(Action(s, WEIGHTS, deferred[s].popleft()))
        for action in step:
            orders[action.stage].append(action)
            if action.kind == BACKWARD:
                deferred[action.stage].append(action.microbatch)
        done.update(step)
    return orders


def interleaved(stages: int, microbatches: int, virtual_stages: int = 2) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: the model is cut into `stages *
    virtual_stages` stages and device d runs stages d, d + p, ... (p =
    `stages`). Each device runs microbatches in groups of p through its
    stages in turn (forwards through its stages in order, backwards in
    reverse), with Megatron's warm-up of `2 (p - d - 1) + (v - 1) p` forwards,
    then one forward and one backward in turn. A device's stage is 1/v of a
    1F1B stage, so a bubble step is 1/v as long: the bubble is divided by v.
    `microbatches` must be a multiple of p.

    Example:

    >>> [" ".join(map(str, order)) for order in interleaved(2, 2, 2)]
    ['0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1', '1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1']
    """
    p, v = stages, virtual_stages
    if microbatches % p:
        raise ValueError(
            f"`microbatches` must be a multiple of `stages` ({p}) for the interleaved "
            f"schedule, got {microbatches}.")
    total = microbatches * v

    def action(device, k, kind):
        local = (k % (p * v)) // p
        chunk = local if kind == FORWARD else v - 1 - local
        return Action(chunk * p + device, kind, (k // (p * v)) * p + k % p)

    orders = []
    for d in range(p):
        warm = min(2 * (p - d - 1) + (v - 1) * p, total)
        order = [action(d, k, FORWARD) for k in range(warm)]
        for k in range(total - warm):
            order += [action(d, warm + k, FORWARD), action(d, k, BACKWARD)]
        order += [action(d, k, BACKWARD) for k in range(total - warm, total)]
        orders.append(order)
    return orders


def zero_bubble_v(stages: int, microbatches: int, virtual_stages: int = 2) -> list[list[Action]]:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory"): the
    model cut into 2p stages placed in a V (`stage_device`: device d runs
    stages d and 2p - 1 - d, so the first device also computes the loss),
    each backward split into "B" and "W" as in ZB-H1. Every clock step, each
    device runs a forward if it may (later stage first), else a backward
    (later stage first), else its oldest deferred W; a device holds at most
    2p half-size stages' activations, 1F1B's first stage's memory. With
    forward, backward and weight work of equal length the bubble is at most
    a third of 1F1B's once m >= p, and mostly (p - 1) half-stage forwards, a
    sixth of it (p = 4, m = 8: m (F + B + W) + 3 F / 2).

    Example:

    >>> [" ".join(map(str, order)) for order in zero_bubble_v(2, 1)]
    ['0F0 3F0 3B0 3W0 0B0 0W0', '1F0 2F0 2B0 1B0 2W0 1W0']
    """
    if virtual_stages != 2:
        raise ValueError(f"`virtual_stages` must be 2 for ZB-V, got {virtual_stages}.")
    p, total = stages, 2 * stages
    chunks = [(d, total - 1 - d) for d in range(p)]     # each device's two stages
    orders = [[] for _ in range(p)]
    done, held = set(), [0] * p
    nxt = {kind: [[0, 0] for _ in range(p)] for kind in (FORWARD, BACKWARD)}
    deferred = [collections.deque() for _ in range(p)]  # B done, W not
    remaining = 6 * p * microbatches
    while remaining:
        step = []
        for d in range(p):
            action = None
            for kind in (FORWARD, BACKWARD):
                if action is not None or (kind == FORWARD and held[d] >= total):
                    continue
                for c in (1, 0):
                    i = nxt[kind][d][c]
                    candidate = Action(chunks[d][c], kind, i) if i < microbatches else None
                    if candidate and all(n in done for n in needs(candidate, total)):
                        action = candidate
                        nxt[kind][d][c] += 1
                        held[d] += kind == FORWARD
                        break
            if action is None and deferred[d]:
                action = deferred[d].popleft()
                held[d] -= 1
            if action is not None:
                step.append((d, action))
        for d, action in step:
            orders[d].append(action)
            if action.kind == BACKWARD:
                deferred[d].append(Action(action.stage, WEIGHTS, action.microbatch))
        done.update(action for _, action in step)
        remaining -= len(step)
    return orders


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb1": zero_bubble_h1,
             "interleaved": interleaved, "zbv": zero_bubble_v}
# Schedules that run several stages per device, and how many they need.
VIRTUAL = {"interleaved": None, "zbv": 2}


def stage_device(kind: str, stage: int, devices: int) -> int:
    """The pipeline device that runs `stage` under schedule `kind`: stage
    mod `devices`, except in ZB-V's V (stages 0..p-1 on devices 0..p-1, then
    p..2p-1 back on p-1..0).

    Example:

    >>> [stage_device("interleaved", s, 2) for s in range(4)]
    [0, 1, 0, 1]
    >>> [stage_device("zbv", s, 2) for s in range(4)]
    [0, 1, 1, 0]
    """
    if kind == "zbv" and stage >= devices:
        return 2 * devices - 1 - stage
    return stage % devices


def stage_orders(kind: str, stages: int, microbatches: int,
                 virtual_stages: int = 1) -> list[list[Action]]:
    """Each device's actions in the order it runs them, for schedule `kind`
    (a key of `SCHEDULES`) over `stages` devices; `virtual_stages` (> 1 for
    "interleaved" only) stages per device.

    Example:

    >>> [str(action) for action in stage_orders("1f1b", 2, 3)[0]]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    if kind not in SCHEDULES:
        raise ValueError(f"`kind` must be one of {tuple(SCHEDULES)}, got {kind!r}.")
    for name, value in (("stages", stages), ("microbatches", microbatches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")
    if (kind in VIRTUAL) != (virtual_stages > 1) or VIRTUAL.get(kind) not in (
            None, virtual_stages):
        raise ValueError(
            f"`virtual_stages` must be > 1 with the interleaved schedule, 2 with zbv "
            f"and 1 with the others, got {virtual_stages} with {kind!r}.")
    return SCHEDULES[kind](stages, microbatches, virtual_stages)


def needs(action: Action, stages: int) -> list[Action]:
    """The actions whose results `action` reads, in a model of `stages`
    stages: a forward, the previous stage's forward; a backward, its own
    forward and the next stage's backward; a W, its own backward.

    Example:

    >>> [str(a) for a in needs(Action.parse("1B0"), 3)]
    ['1F0', '2B0']
    """
    s, i = action.stage, action.microbatch
    if action.kind == WEIGHTS:
        return [Action(s, BACKWARD, i)]
    if action.kind == FORWARD:
        return [Action(s - 1, FORWARD, i)] if s > 0 else []
    needs = [Action(s, FORWARD, i)]
    if s < stages - 1:
        needs.append(Action(s + 1, BACKWARD, i))
    return needs


def _stage_count(orders) -> int:
    return 1 + max((a.stage for order in orders for a in order), default=0)


def clock_steps(orders: list[list[Action]]) -> list[list[Action]]:
    """The schedule on a clock, every action taking one step: in each step,
    every device whose next action reads only results of earlier steps runs
    it. A step holds at most one action per device, in device order.

    Raises `ValueError` if the orders deadlock (a device's next action waits
    for one that can never run).

    Example:

    >>> [" ".join(map(str, step)) for step in clock_steps(gpipe(2, 1))]
    ['0F0', '1F0', '1B0', '0B0']
    """
    devices, stages = len(orders), _stage_count(orders)
    done, position, steps = set(), [0] * devices, []
    remaining = sum(len(order) for order in orders)
    while remaining:
        ready = [d for d in range(devices) if position[d] < len(orders[d])
                 and all(need in done for need in needs(orders[d][position[d]], stages))]
        if not ready:
            waiting = [str(orders[d][position[d]]) for d in range(devices)
                       if position[d] < len(orders[d])]
            raise ValueError(
                f"`orders` deadlock: no stage can run its next action {waiting} "
                f"(each waits for a result no stage can produce).")
        step = [orders[d][position[d]] for d in ready]
        for d in ready:
            position[d] += 1
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
    """For each device, the largest number of (stage, microbatch) forwards
    whose activations it holds at once: forward done, backward (or, when the
    schedule splits it, W) not yet. With virtual stages each is a 1/v-size
    stage's.

    Example:

    >>> held_activations(stage_orders("gpipe", 4, 8))
    [8, 8, 8, 8]
    >>> held_activations(stage_orders("1f1b", 4, 8))
    [4, 3, 2, 1]
    >>> held_activations(stage_orders("zb1", 4, 8))
    [4, 4, 4, 4]
    """
    peaks = []
    for order in orders:
        release = WEIGHTS if any(a.kind == WEIGHTS for a in order) else BACKWARD
        held = peak = 0
        for action in order:
            held += 1 if action.kind == FORWARD else -(action.kind == release)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def grid(orders: list[list[Action]]) -> str:
    """The schedule as a table: one row per clock step (`clock_steps`), one
    column per device, cells such as "F0" (forward of microbatch 0), "B3",
    "W3", "F2s5" (with virtual stages: of stage 5), or "." (the device is
    idle: the pipeline's bubble).

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
    devices = len(orders)
    virtual = _stage_count(orders) > devices
    device_of = {a.stage: d for d, order in enumerate(orders) for a in order}
    header = ["step"] + [f"stage {s}" for s in range(devices)]
    rows = [header]
    for number, step in enumerate(steps):
        cells = ["."] * devices
        for action in step:
            cells[device_of[action.stage]] = (f"{action.kind}{action.microbatch}"
                                             + (f"s{action.stage}" if virtual else ""))
        rows.append([str(number)] + cells)
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)
