"""Programs: pipeline schedules and ZeRO-3's unit order as instruction lists."""

import pytest

from tfdist.pipeline.program import (
    BACKWARD,
    FORWARD,
    GATHER,
    REDUCE_SCATTER,
    REFRESH,
    WEIGHTS,
    Instruction,
    Program,
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
        [(GATHER, 0, 0, False), (FORWARD, 0, 0, True)],
        [(GATHER, 1, 0, False), (FORWARD, 1, 0, True)],
        [(GATHER, 2, 0, False), (FORWARD, 2, 0, False)],
        [(BACKWARD, 2, 0, False), (REDUCE_SCATTER, 2, 0, False)],  # the forward's gathered
        [(GATHER, 1, 0, False), (BACKWARD, 1, 0, True), (REDUCE_SCATTER, 1, 0, False)],
        [(GATHER, 0, 0, False), (BACKWARD, 0, 0, True), (REDUCE_SCATTER, 0, 0, False)]]
    assert [block[-1].microbatch for block in blocks[6:]] == [1] * 6
    assert {instruction.device for instruction in program.instructions} == {0}
    # The gather and the reduce-scatter run inside the backward's block and
    # name scope.
    assert Program.lead(blocks[4]).scope("unit") == "unit1/bwd/mb0"
    assert [i.kind for i in blocks[4]] == ["gather", "bwd", "reduce_scatter"]


def test_pipeline_stages_reduce_scatter_once_after_every_microbatch():
    program = pipeline_program(stage_orders("1f1b", 2, 2), [0, 1]).then_reduce_scatter([0, 1])
    tail = program.instructions[-2:]
    assert [(i.op, i.stage, i.microbatch, i.device) for i in tail] == [
        (REDUCE_SCATTER, 0, None, 0), (REDUCE_SCATTER, 1, None, 1)]
    assert [i.scope("stage") for i in tail] == ["stage0/reduce_scatter", "stage1/reduce_scatter"]


def test_sharded_pipeline_stages_gather_before_each_forward_and_replay():
    program = pipeline_program(stage_orders("1f1b", 2, 2), [0, 1], remat=True).then_gather()
    gathered = [(i.op, i.stage, i.microbatch) for block in program.blocks()
                for i in block[1:2] if block[0].op == GATHER]
    assert len(gathered) == len(program.blocks()) == 2 * 2 * 2  # every F and B
    assert {op for op, _, _ in gathered} == {FORWARD, BACKWARD}
    assert all(block[0].stage == block[1].stage and block[0].microbatch == block[1].microbatch
               for block in program.blocks())


def test_tied_copies_are_refreshed_first_on_their_stages_devices():
    program = pipeline_program(stage_orders("1f1b", 2, 2), [0, 1]).first_refreshing([1], [0, 1])
    first = program.instructions[0]
    assert (first.op, first.stage, first.microbatch, first.device) == (REFRESH, 1, None, 1)
    assert program.blocks()[0] == [first]
    assert first.scope("stage") == "stage1/refresh"


def test_an_unknown_instruction_is_refused():
    with pytest.raises(ValueError, match=r"Instruction `op` must be one of .*'gather'"):
        Instruction("all_to_all", 0, 0, 0)
