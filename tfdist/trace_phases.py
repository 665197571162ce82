"""tfdist's step phases as named ranges in a profiler trace.

tfdist names the ops of its step after the phase they belong to
(`tfdist/split/...`, `tfdist/microbatch0/...`, `tfdist/reduce/...`,
`tfdist/apply/...`, `tfdist/stage1/...`). TensorBoard's trace viewer titles an
op's bar by its type (`MatMul`) and finds events by the start of their title,
so a search for `tfdist` found only the `tfdist/step N` ranges. `add_phases`
adds to a trace's host plane one timeline row per phase, `tfdist/<phase>`,
whose events are titled `tfdist/<phase>` and span, in each profiled step, the
first to the last op of that phase: searching `tfdist/reduce` in the trace
viewer finds every step's reduce, and each row shows when its phase ran. The
steps' row and the phases' rows sort above the host's threads.

Example:

```python
add_phases("logs/plugins/profile/run/host.xplane.pb")
# -> {"split": 3, "microbatch0": 3, "reduce": 3, "apply": 3, ...} events per phase
```
"""

import bisect
import collections
import re

from tfdist._compat.tf_profiler import read_xspace, write_xspace

HOST_PLANE = "/host:CPU"
STEP_EVENT = "tfdist/step"  # the Profiler callback's range around each step
# `<scopes>/tfdist/<phase>/<op>:<type>`: the phase, from a TensorFlow op event's name.
_PHASE = re.compile(r"(?:^|/)tfdist/([^/:]+)/[^:]*:")
_STEP_STAT = "tfdist_step"  # each range's step number, as its `tfdist/step N`


def add_phases(path) -> dict:
    """Adds a `tfdist/<phase>` row per phase to the trace at `path` (an
    `.xplane.pb` file), in place; returns {phase: events added}.

    The trace must hold `tfdist/step` ranges (`tfdist.callbacks.Profiler`
    writes them): each op counts in the last step that started before it.
    A trace without them (a remote capture of a task whose `fit` has no
    `Profiler`) gets one event per phase over the whole capture. A trace
    that already has the rows is left as it is.

    Example:

    ```python
    add_phases(tfdist.callbacks.Profiler(...).trace_path)  # the callback does it
    ```
    """
    space = read_xspace(path)
    plane = next((p for p in space.planes if p.name == HOST_PLANE), None)
    if plane is None or any(line.name.startswith("tfdist/") for line in plane.lines):
        return {}
    names = {key: metadata.name for key, metadata in plane.event_metadata.items()}
    step_num = next((key for key, stat in plane.stat_metadata.items()
                     if stat.name == "step_num"), None)
    step_events = [(line, event) for line in plane.lines for event in line.events
                   if names[event.metadata_id] == STEP_EVENT]
    steps = sorted(  # (start, step number) of each profiled step
        (line.timestamp_ns * 1000 + event.offset_ps,
         next((s.int64_value for s in event.stats if s.metadata_id == step_num), None))
        for line, event in step_events)
    starts = [start for start, _ in steps]
    spans = collections.defaultdict(dict)  # phase -> {step index: [start, end]}
    for line in plane.lines:
        base = line.timestamp_ns * 1000
        for event in line.events:
            match = _PHASE.search(names[event.metadata_id])
            if match is None:
                continue
            start = base + event.offset_ps
            step = _step_of(starts, start)
            if step < 0:
                continue
            span = spans[match[1]].setdefault(step, [start, start])
            span[0] = min(span[0], start)
            span[1] = max(span[1], start + event.duration_ps)
    if not spans:
        return {}
    step_line = step_events[0][0] if step_events else None
    _add_rows(plane, spans, [number for _, number in steps], step_line)
    write_xspace(space, path)
    return {phase: len(ranges) for phase, ranges in spans.items()}


def _step_of(starts, time_ps):
    """Index of the last step start at or before `time_ps` (0 without steps)."""
    return bisect.bisect_right(starts, time_ps) - 1 if starts else 0


def _add_rows(plane, spans, step_numbers, step_line):
    """One row per phase of `spans` ({phase: {step index: [start, end]}}),
    each range with its step's number (`step_numbers[index]`) when known;
    the row of the steps (`step_line`, if any) moved first."""
    next_event_id = max(plane.event_metadata, default=0) + 1
    stat_id = max(plane.stat_metadata, default=0) + 1
    plane.stat_metadata[stat_id].id = stat_id
    plane.stat_metadata[stat_id].name = _STEP_STAT
    # The trace viewer sorts a host's rows by their id's low 32 bits (random
    # for threads): the steps' row first, then the phases'.
    taken = {line.id % 2**32 for line in plane.lines if line is not step_line}
    free_ids = (i for i in range(1, 2**32) if i not in taken)
    if step_line is not None:
        step_line.id = step_line.display_id = next(free_ids)
    origin = min(span[0] for steps in spans.values() for span in steps.values())
    for phase in sorted(spans, key=_phase_order):
        metadata = plane.event_metadata[next_event_id]
        metadata.id = next_event_id
        metadata.name = metadata.display_name = f"tfdist/{phase}"
        next_event_id += 1
        row_id = next(free_ids)
        line = plane.lines.add(id=row_id, display_id=row_id, name=f"tfdist/{phase}",
                               timestamp_ns=origin // 1000)
        base = line.timestamp_ns * 1000
        ordered = sorted(spans[phase].items())
        for index, (step, (start, end)) in enumerate(ordered):
            if index + 1 < len(ordered):  # a late op must not overlap the next step's
                end = min(end, ordered[index + 1][1][0])
            event = line.events.add(metadata_id=metadata.id, offset_ps=start - base,
                                    duration_ps=max(end - start, 1))
            if step < len(step_numbers) and step_numbers[step] is not None:
                event.stats.add(metadata_id=stat_id, int64_value=step_numbers[step])
        line.duration_ps = max(ordered[-1][1][1] - base, 1)


def _phase_order(phase):
    """The step's own order: split, microbatches or stages, metrics, reduce,
    apply; then anything else by name."""
    order = ("split", "microbatch", "stage", "unit", "metrics", "reduce", "gather", "apply")
    head = phase.rstrip("0123456789")
    number = phase[len(head):]
    rank = order.index(head) if head in order else len(order)
    return rank, head, int(number) if number else -1
