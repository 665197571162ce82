"""A keras.distribution.LayoutMap as the tensor plan: translated, or refused clearly."""

import re

import keras
import pytest

import tfdist
from helpers import LLAMA_MEGATRON_LAYOUT, layout_map
from tfdist.tensor.layout_map import check_layout_map
from tfdist.tensor.plan import plan

keras_hub = pytest.importorskip("keras_hub")


def mlp():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    norm = keras.layers.LayerNormalization(name="norm")(keras.layers.Dense(8, name="down")(hidden))
    return keras.Model(inputs, norm)


def layouts(decisions):
    return [(d.name, d.layout.name) for d in decisions]


MEGATRON_MLP = {"up/kernel": (None, "model"), "down/kernel": ("model", None)}


def test_a_map_of_the_plans_own_layouts_gives_the_same_plan():
    model = mlp()
    assert layouts(plan(model, 2, layout_map=layout_map(MEGATRON_MLP))) == layouts(
        plan(model, 2)) == [("up", "column"), ("down", "row"), ("norm", "replicated")]
    # A bias may be named too, where the plan splits it.
    named = layout_map({**MEGATRON_MLP, "up/bias": ("model",), "down/bias": (None,)})
    assert layouts(plan(model, 2, layout_map=named))[:2] == [("up", "column"), ("down", "row")]


def test_what_the_map_leaves_out_stays_whole():
    decisions = plan(mlp(), 2, layout_map=layout_map({}))
    assert {(d.layout.name, d.reason) for d in decisions} == {
        ("replicated", "layout_map keeps it whole"),
        ("replicated", "LayerNormalization has no tensor-parallel layout")}


@pytest.mark.parametrize("entries, message", [
    ({"up/kernel": (None, "model")},
     "`layout_map` splits some of up, down and not the others: they are split together"),
    ({"up/kernel": ("model", None), "down/kernel": ("model", None)},
     "`layout_map` puts weight 'up/kernel' (8, 16) on the tensor axis 'model' along axis 0; "
     "tfdist splits up (Dense) as column ('up/kernel' on axis 1, 'up/bias' on axis 0) only "
     "(or every weight whole)."),
    ({**MEGATRON_MLP, "norm/gamma": ("model",)},
     "`layout_map` puts weight 'norm/gamma' (8,) on the tensor axis 'model' along axis 0, but "
     "tfdist keeps norm (LayerNormalization) whole: LayerNormalization has no tensor-parallel "
     "layout. Map it to None on every axis."),
    ({**MEGATRON_MLP, "dense_7/kernel": (None, "model")},
     "`layout_map` keys ['dense_7/kernel'] match no weight of the model"),
])
def test_what_tfdist_cannot_run_is_refused_naming_the_weight(entries, message):
    with pytest.raises(ValueError) as raised:
        plan(mlp(), 2, layout_map=layout_map(entries))
    assert message in str(raised.value)


def test_the_data_axis_of_one_device_shards_nothing_and_of_more_needs_zero3():
    on_data = {"up/kernel": ("batch", "model"), "down/kernel": ("model", "batch")}
    assert layouts(plan(mlp(), 2, layout_map=layout_map(on_data)))[:2] == [
        ("up", "column"), ("down", "row")]
    check_layout_map(layout_map(on_data), tensor=2)
    with pytest.raises(ValueError, match=re.escape(
            "`layout_map` puts weights on its data axis 'batch' of 2 devices ('up/kernel': "
            "('batch', 'model')): sharded over the data replicas and gathered where used, "
            "which tfdist does with zero=3 (every weight), but zero=1: pass zero=3, or map "
            "'batch' to None.")):
        tfdist.Strategy(tensor=2, zero=1, devices=[f"CPU:{i}" for i in range(4)],
                        layout_map=layout_map(on_data, shape=(2, 2)))
    check_layout_map(layout_map(on_data, shape=(2, 2)), tensor=2, zero=3)


def test_the_map_itself_is_checked_when_the_strategy_is_made():
    with pytest.raises(TypeError, match=r"`layout_map` must be a keras.distribution.LayoutMap, "
                                        r"got \{'up/kernel': .*\} of type dict"):
        tfdist.Strategy(tensor=2, devices=["CPU:0", "CPU:1"], layout_map=MEGATRON_MLP)
    with pytest.raises(ValueError, match=r"`layout_map` is a tensor-parallel plan, but "
                                         r"tensor=1"):
        check_layout_map(layout_map({}), tensor=1)
    with pytest.raises(ValueError, match=r"mesh \{'batch': 1, 'model': 2\} has 2 devices on "
                                         r"its tensor axis 'model', but tensor=4: build the "
                                         r"mesh with shape \(data, 4\)"):
        check_layout_map(layout_map({}), tensor=4)
    with pytest.raises(ValueError, match=r"needs a DeviceMesh of two axes \(data, tensor\).*"
                                         r"got \('model',\)"):
        check_layout_map(layout_map({}, shape=(2,), names=("model",)), tensor=2)


def llama():
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=24, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, dropout=0.0)


def test_keras_hub_llama_megatron_map_gives_tfdists_own_plan():
    model = llama()
    decisions = plan(model, 2, layout_map=layout_map(LLAMA_MEGATRON_LAYOUT))
    assert layouts(decisions) == layouts(plan(model, 2))
    assert sum(d.layout.name != "replicated" for d in decisions) == 1 + 2 * 7


def test_keras_hub_llamas_own_map_splits_attention_by_hidden_features():
    """keras-hub's `LlamaBackbone.get_layout_map` puts query/key/value on
    the tensor axis along their input (hidden) axis, the attention output
    along its heads, the MLP column -> row, the token table by rows and not
    its untied reverse table: tfdist's alternatives for those layers."""
    model = llama()
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), ["cpu:0", "cpu:1"])
    decisions = plan(model, 2, layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh))
    by_name = {d.name.split("/")[-1]: d for d in decisions}
    assert {name: d.layout.name for name, d in by_name.items() if d.layout.name != "replicated"
            } == {"token_embedding": "vocabulary", "query": "row", "key": "row", "value": "row",
                  "attention_output": "row", "feedforward_intermediate_dense": "column",
                  "feedforward_gate_dense": "column", "feedforward_output_dense": "row"}
    assert by_name["query"].reason == "input features 16 -> 8 per device, partial products summed"
    assert by_name["token_embedding"].reason == "24 rows -> 12 per device, its reverse table whole"
    split = {w.path: axis for d in decisions for w, axis in d.layout.weight_axes(d.layer)}
    assert split["transformer_layer_0/self_attention/query/kernel"] == 0
    assert split["transformer_layer_0/self_attention/attention_output/kernel"] == 0
    assert "token_embedding/reverse_embeddings" not in split


def test_keras_hub_gemmas_own_map_asks_heads_which_gemma_cannot_split():
    model = keras_hub.models.GemmaBackbone(
        vocabulary_size=24, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, head_dim=4)
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), ["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match=(
            r"`layout_map` puts weight 'decoder_block_0/attention/(query|key|value)/kernel' "
            r"\([24], 16, 4\) on the tensor axis 'model' along axis 0; tfdist splits "
            r"decoder_block_0/attention/\1 \(EinsumDense\) as row "
            r"\('decoder_block_0/attention/\1/kernel' on axis 1\) only")):
        plan(model, 2, layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh))
