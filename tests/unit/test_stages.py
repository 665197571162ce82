"""Cutting a model into pipeline stages: balanced by estimated cost, or at named
layers; what crosses each boundary; the models and boundaries that are refused."""

import keras
import pytest

from tfdist.pipeline.cost import node_cost
from tfdist.pipeline.graph import graph_of
from tfdist.pipeline.stages import _balanced_starts, plan_stages


def mlp(widths=(64, 64, 64, 64), features=16):
    """A functional MLP whose Dense layers are named d0, d1, ..."""
    inputs = x = keras.Input((features,))
    for i, width in enumerate(widths):
        x = keras.layers.Dense(width, name=f"d{i}")(x)
    return keras.Model(inputs, x)


def residual():
    """in -> a -> b -> skip(in, b) -> out: the residual from `in` may cross a stage."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, name="in")(inputs)
    a = keras.layers.Dense(16, name="a")(h)
    b = keras.layers.Dense(16, name="b")(a)
    joined = keras.layers.Add(name="skip")([h, b])
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(joined), name="residual")


def names(stage):
    return [layer.name for layer in stage.layers]


@pytest.mark.parametrize("costs, params, stages, starts", [
    ([1, 1, 1, 1], [0, 0, 0, 0], 2, [0, 2]),
    ([1, 1, 1, 1], [0, 0, 0, 0], 4, [0, 1, 2, 3]),
    ([4, 1, 1, 1, 1], [0] * 5, 2, [0, 1]),         # the big first node stands alone
    ([1, 1, 1, 1, 4], [0] * 5, 2, [0, 4]),
    ([1, 2, 3, 4, 5, 6], [0] * 6, 3, [0, 3, 5]),    # max stage cost 6 (1+2+3 | 4+5 | 6)
    ([1, 1, 1], [5, 0, 0], 2, [0, 1]),              # cost ties: fewer parameters win
    ([1, 1, 1], [0, 0, 5], 2, [0, 2]),
    ([3], [0], 1, [0]),
])
def test_balanced_starts_minimise_the_largest_stage(costs, params, stages, starts):
    assert _balanced_starts(costs, params, stages) == starts


def test_node_cost_of_a_dense_is_its_matmul_and_one_per_output():
    model = mlp(widths=(32,), features=64)
    (node,) = model.get_layer("d0")._inbound_nodes
    assert node_cost(node) == 2 * 64 * 32 + 32


def test_equal_layers_split_evenly_and_costs_add_up():
    model = mlp()
    stages = plan_stages(model, 2)
    assert [names(s) for s in stages] == [["d0", "d1"], ["d2", "d3"]]
    assert [s.index for s in stages] == [0, 1]
    assert stages[1].cost == stages[0].cost - 2 * 16 * 64 + 2 * 64 * 64
    assert sum(s.params for s in stages) == model.count_params()
    assert [len(s.variables) for s in stages] == [4, 4]


def test_one_heavy_layer_gets_a_stage_of_its_own():
    model = mlp(widths=(512, 8, 8, 8))
    stages = plan_stages(model, 2)
    assert [names(s) for s in stages] == [["d0"], ["d1", "d2", "d3"]]


def test_what_crosses_each_boundary():
    model = residual()
    first, second = plan_stages(model, 2, boundaries=["b"])
    assert names(first) == ["in", "a"] and names(second) == ["b", "skip", "out"]
    assert first.inputs == model.inputs
    # `b` reads `a`'s output; the residual reads `in`'s output across the boundary.
    h, a = (model.get_layer(n).output for n in ("in", "a"))
    assert {id(x) for x in second.inputs} == {id(h), id(a)}
    assert {id(x) for x in first.outputs} == {id(h), id(a)}
    assert [id(x) for x in second.outputs] == [id(model.outputs[0])]


def test_sequential_with_an_input_is_split_like_its_functional_graph():
    model = keras.Sequential([keras.Input((16,)),
                              *(keras.layers.Dense(64, name=f"s{i}") for i in range(4))])
    assert graph_of(model) is model._functional
    assert [names(s) for s in plan_stages(model, 4)] == [["s0"], ["s1"], ["s2"], ["s3"]]


@pytest.mark.parametrize("stages, boundaries, message", [
    (8, None, r"`pipeline=8` needs at least 8 layers to split, but 'residual' has 5: "
              r"use pipeline <= 5"),
    (2, ["nope"], r"`stage_boundaries`: no layer named 'nope' in the model; its layers are"),
    (2, ["a", "b"], r"`stage_boundaries` must name 1 layer\(s\) for 2 stages"),
    (2, "a", r"`stage_boundaries` must name 1 layer\(s\) for 2 stages .*got 'a'"),
    (3, ["b", "a"], r"'a' must come after the previous boundary"),
    (2, ["in"], r"'in' must come after the previous boundary .* the first stage must not"),
])
def test_bad_stage_counts_and_boundaries_are_refused(stages, boundaries, message):
    model = residual()
    with pytest.raises(ValueError, match=message):
        plan_stages(model, stages, boundaries=boundaries)


def test_a_layer_called_in_the_first_and_last_stage_is_tied():
    inputs = keras.Input((8,))
    shared = keras.layers.Dense(8, name="shared")
    x = keras.layers.Dense(8, name="middle0")(shared(inputs))
    model = keras.Model(inputs, shared(x))
    first, last = plan_stages(model, 2, boundaries=["middle0"])
    assert [layer.name for layer in first.layers] == ["shared"]
    assert [layer.name for layer in last.layers] == ["middle0"]
    assert [layer.name for layer in last.tied] == ["shared"] and not first.tied
    assert (first.params, last.params) == (72, 72)  # the shared layer counted once


def test_a_layer_called_in_two_stages_not_first_and_last_is_refused():
    inputs = keras.Input((8,))
    shared = keras.layers.Dense(8, name="shared")
    x = shared(keras.layers.Dense(8, name="middle0")(shared(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(8, name="middle1")(x))
    with pytest.raises(ValueError, match=r"'shared' is called in stages 0 and 1"):
        plan_stages(model, 3, boundaries=["middle0", "middle1"])


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("model, message", [
    (Subclassed(), r"Subclassed is a subclassed model, whose graph is not known"),
    (keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(2)]),
     r"needs a Sequential model with a known input shape"),
])
def test_models_without_a_known_graph_are_refused(model, message):
    with pytest.raises(ValueError, match=message):
        plan_stages(model, 2)
