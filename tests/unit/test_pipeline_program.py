"""Programs: pipeline schedules and ZeRO-3's unit order as instruction lists."""

import pytest

from tfdist.pipeline.program import (
    BACKWARD,
    FORWARD,
    REDUCE_SCATTER,
    WEIGHTS,
    Instruction,
    pipeline_program,
    unit_program,
)
from tfdist.pipeline.schedule import SCHEDULES, VIRTUAL, emission_order, stage_device, stage_orders

KIND = {"F": FORWARD, "B": BACKWARD, "W": WEIGHTS}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("remat", [False, True])
def test_a_pipeline_program_is_its_schedule_in_emission_order(schedule, remat):
    virtual = 2 if schedule in VIRTUAL else 1
    orders = stage_orders(schedule, 2, 4, virtual)
    device_of = [stage_device(schedule, s, 2) for s in range(2 * virtual)]
    program = pipeline_program(orders, device_of, remat)
    order = emission_order(orders)
    assert [(i.op, i.stage, i.microbatch, i.device) for i in program.instructions] == [
        (KIND[a.kind], a.stage, a.microbatch, device_of[a.stage]) for a in order]
    split = any(a.kind == "W" for a in order)
    for instruction in program.instructions:
        assert instruction.defer == (split and instruction.op == BACKWARD)
        assert instruction.remat == (remat and instruction.op != WEIGHTS)
        assert not instruction.joins
    assert program.window == 1 and not program.wait_for_all_ops
    assert len(program.blocks()) == len(order)


def test_zero3_units_are_a_program_of_blocks_two_in_flight():
    program = unit_program(units=3, microbatches=2)
    blocks = program.blocks()
    assert program.window == 2 and program.wait_for_all_ops
    assert len(blocks) == 2 * (3 + 3)
    first = [[(i.op, i.stage, i.microbatch, i.remat) for i in block] for block in blocks[:6]]
    assert first == [
        [(FORWARD, 0, 0, True)], [(FORWARD, 1, 0, True)], [(FORWARD, 2, 0, False)],
        [(BACKWARD, 2, 0, False), (REDUCE_SCATTER, 2, 0, False)],
        [(BACKWARD, 1, 0, True), (REDUCE_SCATTER, 1, 0, False)],
        [(BACKWARD, 0, 0, True), (REDUCE_SCATTER, 0, 0, False)]]
    assert [block[0].microbatch for block in blocks[6:]] == [1] * 6
    assert {instruction.device for instruction in program.instructions} == {0}
    # The reduce-scatter runs inside its backward's block and name scope.
    assert [i.scope("unit") for i in blocks[3]] == ["unit2/bwd/mb0", "reduce_scatter"]


def test_pipeline_stages_reduce_scatter_once_after_every_microbatch():
    program = pipeline_program(stage_orders("1f1b", 2, 2), [0, 1]).then_reduce_scatter([0, 1])
    tail = program.instructions[-2:]
    assert [(i.op, i.stage, i.microbatch, i.device) for i in tail] == [
        (REDUCE_SCATTER, 0, None, 0), (REDUCE_SCATTER, 1, None, 1)]
    assert [i.scope("stage") for i in tail] == ["stage0/reduce_scatter", "stage1/reduce_scatter"]


def test_an_unknown_instruction_is_refused():
    with pytest.raises(ValueError, match=r"Instruction `op` must be one of .*'gather'"):
        Instruction("gather", 0, 0, 0)
