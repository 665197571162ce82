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
    stage_device,
    stage_orders,
)

# (schedule, devices p, microbatches m, virtual stages v)
CASES = [(kind, p, m, 1) for kind in ("gpipe", "1f1b", "zb1")
         for p, m in itertools.product(range(1, 5), range(1, 9))]
CASES += [("interleaved", p, m, v) for p in range(1, 5) for v in (2, 3)
          for m in range(p, 9, p)]
CASES += [("zbv", p, m, 2) for p, m in itertools.product(range(1, 5), range(1, 9))]


def kinds(kind):
    return "FBW" if kind in ("zb1", "zbv") else "FB"


@pytest.mark.parametrize("kind, p, m, v", CASES)
def test_every_action_once_on_its_device(kind, p, m, v):
    orders = stage_orders(kind, p, m, v)
    assert len(orders) == p
    for d, order in enumerate(orders):
        assert sorted(order, key=str) == sorted(
            (Action(s, k, i) for s in range(p * v) if stage_device(kind, s, p) == d
             for k in kinds(kind) for i in range(m)), key=str)


@pytest.mark.parametrize("kind, p, m, v", CASES)
def test_emission_order_respects_device_order_and_data(kind, p, m, v):
    orders = stage_orders(kind, p, m, v)
    order = emission_order(orders)
    position = {action: n for n, action in enumerate(order)}
    stages = p * v
    assert len(position) == len(order) == len(kinds(kind)) * stages * m
    for d in range(p):
        assert [a for a in order if stage_device(kind, a.stage, p) == d] == orders[d]
    for action in order:
        s, i = action.stage, action.microbatch
        if action.kind == "F" and s > 0:
            assert position[Action(s - 1, "F", i)] < position[action]
        if action.kind == "B":
            assert position[Action(s, "F", i)] < position[action]
            if s < stages - 1:
                assert position[Action(s + 1, "B", i)] < position[action]
        if action.kind == "W":
            assert position[Action(s, "B", i)] < position[action]


@pytest.mark.parametrize("kind, p, m, v", CASES)
def test_a_clock_step_runs_each_device_at_most_once(kind, p, m, v):
    for step in clock_steps(stage_orders(kind, p, m, v)):
        devices = [stage_device(kind, a.stage, p) for a in step]
        assert devices == sorted(set(devices))


def test_held_activations():
    assert held_activations(stage_orders("gpipe", 4, 8)) == [8, 8, 8, 8]
    assert held_activations(stage_orders("1f1b", 4, 8)) == [4, 3, 2, 1]
    assert held_activations(stage_orders("1f1b", 4, 2)) == [2, 2, 2, 1]


@pytest.mark.parametrize("p, m", list(itertools.product(range(1, 6), range(1, 17))))
def test_zb1_holds_no_more_than_1f1b_and_has_a_third_of_its_bubble(p, m):
    """Within 1F1B's peak (its first stage's). With F = B = W one clock step
    each, 1F1B (B and W in one backward) takes 3 (m + p - 1) steps: a bubble
    of 3 (p - 1); zb1 never more, and with m >= p, 3 m + (p - 1) steps."""
    orders = stage_orders("zb1", p, m)
    assert max(held_activations(orders)) <= max(held_activations(stage_orders("1f1b", p, m)))
    steps = len(clock_steps(orders))
    assert steps <= 3 * (m + p - 1)
    if m >= p:
        assert steps == 3 * m + p - 1


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 3), (3, 2)])
def test_interleaved_divides_the_bubble_by_v(p, v):
    """A device's clock step is one 1/v-size stage's F or B: 2 m v steps of
    work, and a bubble of 2 (p - 1) such steps against 1F1B's 2 (p - 1)
    stage-size steps."""
    m = 2 * p
    steps = clock_steps(stage_orders("interleaved", p, m, v))
    assert len(steps) - 2 * m * v == 2 * (p - 1)


@pytest.mark.parametrize("p, m", list(itertools.product(range(1, 9), range(1, 17))))
def test_zbv_holds_1f1bs_memory_and_at_most_a_third_of_its_bubble(p, m):
    """A device holds at most 2p half-size stages' activations: 1F1B's first
    stage's p whole-stage ones. With F = B = W one clock step each on a
    half-size stage, 1F1B takes 6 (m + p - 1) such steps: a bubble of
    6 (p - 1); ZB-V's is at most a third of that once m >= p, and p - 1 (a
    sixth) at p = 4, m = 8."""
    orders = stage_orders("zbv", p, m, 2)
    assert max(held_activations(orders)) <= 2 * max(held_activations(stage_orders("1f1b", p, m)))
    bubble = len(clock_steps(orders)) - 6 * m
    assert bubble <= 6 * (p - 1)
    if m >= p:
        assert bubble <= 2 * (p - 1)
    if (p, m) == (4, 8):
        assert bubble == p - 1


def test_zbv_places_stages_in_a_v():
    assert [stage_device("zbv", s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_device("interleaved", s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # The loss is on device 0's second stage; the backward comes back up the V.
    assert grid(stage_orders("zbv", 2, 1, 2)).splitlines() == [
        "step  stage 0  stage 1",
        "0     F0s0     .",
        "1     .        F0s1",
        "2     .        F0s2",
        "3     F0s3     .",
        "4     B0s3     .",
        "5     W0s3     B0s2",
        "6     .        B0s1",
        "7     B0s0     W0s2",
        "8     W0s0     W0s1",
    ]


def test_interleaved_holds_megatrons_warm_up():
    # Megatron: 2 (p - d - 1) + (v - 1) p warm-up forwards, plus the steady
    # state's one, of 1/v-size stages.
    assert held_activations(stage_orders("interleaved", 4, 8, 2)) == [11, 9, 7, 5]


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
    with pytest.raises(ValueError, match=r"`kind` must be one of \('F', 'B', 'W'\), got 'X'"):
        Action.parse("1X0")


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": -1, "kind": "F", "microbatch": 0}, r"`stage` must be an int >= 0, got -1"),
    ({"stage": 0, "kind": "w", "microbatch": 0},
     r"`kind` must be one of \('F', 'B', 'W'\), got 'w'"),
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


def test_grid_zb1_and_interleaved():
    assert grid(stage_orders("zb1", 2, 2)) == "\n".join([
        "step  stage 0  stage 1",
        "0     F0       .",
        "1     F1       F0",
        "2     .        B0",
        "3     B0       F1",
        "4     W0       B1",
        "5     B1       W0",
        "6     W1       W1",
    ])
    assert grid(stage_orders("interleaved", 2, 2, 2)).splitlines()[:4] == [
        "step  stage 0  stage 1",
        "0     F0s0     .",
        "1     F1s0     F0s1",
        "2     F0s2     F1s1",
    ]


def test_deadlock_is_reported():
    backwards_first = [[Action(0, "B", 0), Action(0, "F", 0)]]
    with pytest.raises(ValueError, match=r"`orders` deadlock: .*\['0B0'\]"):
        emission_order(backwards_first)


@pytest.mark.parametrize("args, message", [
    (("zero-bubble", 2, 2), r"`kind` must be one of \('gpipe', '1f1b', 'zb1', 'interleaved', "
                            r"'zbv'\), got 'zero-bubble'"),
    (("interleaved", 2, 4), r"`virtual_stages` must be > 1 with the interleaved schedule"),
    (("1f1b", 2, 4, 2), r"`virtual_stages` must be > 1 with .* and 1 with the others, got 2"),
    (("zbv", 2, 4, 3), r"`virtual_stages` must be .* 2 with zbv .*got 3 with 'zbv'"),
    (("zbv", 2, 4), r"`virtual_stages` must be .* 2 with zbv .*got 1 with 'zbv'"),
    (("interleaved", 4, 6, 2), r"`microbatches` must be a multiple of `stages` \(4\) .*got 6"),
    (("gpipe", 0, 2), r"`stages` must be an int >= 1, got 0"),
    (("1f1b", 2, "4"), r"`microbatches` must be an int >= 1, got '4'"),
])
def test_bad_stage_orders(args, message):
    with pytest.raises(ValueError, match=message):
        stage_orders(*args)


def test_config_accepts_the_registered_schedules():
    assert CONFIG_SCHEDULES == tuple(SCHEDULES) == ("gpipe", "1f1b", "zb1", "interleaved", "zbv")
