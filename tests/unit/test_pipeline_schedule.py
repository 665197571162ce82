"""Pipeline schedules as data: every action once, in an order the data allows."""

import itertools

import pytest

from tfdist.config import SCHEDULES as CONFIG_SCHEDULES
from tfdist.pipeline.schedule import (
    SCHEDULES,
    Action,
    clock_steps,
    emission_order,
    grid,
    held_activations,
    stage_orders,
)

CASES = [(kind, p, m) for kind in SCHEDULES
         for p, m in itertools.product(range(1, 5), range(1, 9))]


@pytest.mark.parametrize("kind, p, m", CASES)
def test_every_forward_and_backward_once_on_its_stage(kind, p, m):
    orders = stage_orders(kind, p, m)
    assert len(orders) == p
    for s, order in enumerate(orders):
        assert sorted(order, key=str) == sorted(
            (Action(s, k, i) for k in "FB" for i in range(m)), key=str)


@pytest.mark.parametrize("kind, p, m", CASES)
def test_emission_order_respects_stage_order_and_data(kind, p, m):
    orders = stage_orders(kind, p, m)
    order = emission_order(orders)
    position = {action: n for n, action in enumerate(order)}
    assert len(position) == len(order) == 2 * p * m
    for s in range(p):
        assert [a for a in order if a.stage == s] == orders[s]
    for action in order:
        s, i = action.stage, action.microbatch
        if action.kind == "F" and s > 0:
            assert position[Action(s - 1, "F", i)] < position[action]
        if action.kind == "B":
            assert position[Action(s, "F", i)] < position[action]
            if s < p - 1:
                assert position[Action(s + 1, "B", i)] < position[action]


@pytest.mark.parametrize("kind, p, m", CASES)
def test_a_clock_step_runs_each_stage_at_most_once(kind, p, m):
    for step in clock_steps(stage_orders(kind, p, m)):
        assert [a.stage for a in step] == sorted({a.stage for a in step})


def test_held_activations():
    assert held_activations(stage_orders("gpipe", 4, 8)) == [8, 8, 8, 8]
    assert held_activations(stage_orders("1f1b", 4, 8)) == [4, 3, 2, 1]
    assert held_activations(stage_orders("1f1b", 4, 2)) == [2, 2, 2, 1]


def test_action_text_round_trip():
    assert str(Action(1, "F", 0)) == "1F0"
    assert Action.parse("1F0") == Action(1, "F", 0)
    for action in emission_order(stage_orders("1f1b", 3, 12)):
        assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["", "F0", "1F", "-1F0", "1F0 ", 10])
def test_action_parse_rejects(text):
    with pytest.raises(ValueError, match="`text` must be stage, kind and microbatch"):
        Action.parse(text)


def test_action_parse_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match=r"`kind` must be one of \('F', 'B'\), got 'X'"):
        Action.parse("1X0")


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": -1, "kind": "F", "microbatch": 0}, r"`stage` must be an int >= 0, got -1"),
    ({"stage": 0, "kind": "W", "microbatch": 0}, r"`kind` must be one of \('F', 'B'\), got 'W'"),
    ({"stage": 0, "kind": "F", "microbatch": 1.5}, r"`microbatch` must be an int >= 0"),
])
def test_bad_action(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Action(**kwargs)


def test_grid_1f1b_three_stages():
    assert grid(stage_orders("1f1b", 3, 4)) == "\n".join([
        "step  stage 0  stage 1  stage 2",
        "0     F0       .        .",
        "1     F1       F0       .",
        "2     F2       F1       F0",
        "3     .        .        B0",
        "4     .        B0       F1",
        "5     B0       F2       B1",
        "6     F3       B1       F2",
        "7     B1       F3       B2",
        "8     .        B2       F3",
        "9     B2       .        B3",
        "10    .        B3       .",
        "11    B3       .        .",
    ])


def test_deadlock_is_reported():
    backwards_first = [[Action(0, "B", 0), Action(0, "F", 0)]]
    with pytest.raises(ValueError, match=r"`orders` deadlock: .*\['0B0'\]"):
        emission_order(backwards_first)


@pytest.mark.parametrize("args, message", [
    (("zero-bubble", 2, 2), r"`kind` must be one of \('gpipe', '1f1b'\), got 'zero-bubble'"),
    (("gpipe", 0, 2), r"`stages` must be an int >= 1, got 0"),
    (("1f1b", 2, "4"), r"`microbatches` must be an int >= 1, got '4'"),
])
def test_bad_stage_orders(args, message):
    with pytest.raises(ValueError, match=message):
        stage_orders(*args)


def test_config_accepts_the_registered_schedules():
    assert CONFIG_SCHEDULES == tuple(SCHEDULES) == ("gpipe", "1f1b")
