"""Tied embeddings: a `keras.layers.ReversibleEmbedding` (keras-hub's causal
LMs) looked up at the input and reused, `reverse=True`, as the output
projection. Under tensor parallelism its table is split by vocabulary and the
reverse call gives each rank its rows' logits; in a pipeline the first stage
holds the table and the last computes with a copy, their gradients summed
once per step (Megatron's tied embedding). Each equals one device."""

import keras
import pytest

import tfdist
from helpers import assert_parity, devices, train, trained_reference
from test_engine import executed_op_counts
from test_tensor_blocks import BLOCKS, HEADS, SEQ, VOCAB, WIDTH, gpt2, lm_data
from tfdist.pipeline.placement import component_devices

keras_hub = pytest.importorskip("keras_hub")

# 12 batches of 16 and a last one of 5: on 2 x 2 replicas with 2 microbatches
# a tensor group's last batch can be 1 row, so one microbatch is empty.
EXAMPLES = 197


def make_causal_lm(seed=0):
    """An unchanged keras-hub GPT2CausalLM: its logits are the token
    embedding's reverse call (the tied table)."""
    keras.utils.set_random_seed(seed)
    model = keras_hub.models.GPT2CausalLM(backbone=gpt2(), preprocessor=None)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    return model


@pytest.mark.parametrize("data_size, sharded_loss, microbatches", [(1, False, 1), (2, True, 2)])
def test_tied_embedding_is_split_by_vocabulary_and_matches_one_device(
        data_size, sharded_loss, microbatches):
    x, y = lm_data("gpt2", n=EXAMPLES)
    reference = trained_reference(make=make_causal_lm, x=x, y=y, batch_size=16)
    n = data_size * 2
    strategy = tfdist.Strategy(data=data_size, tensor=2, microbatches=microbatches,
                               devices=devices(n), vocab_parallel_classifier=sharded_loss)
    result = train(strategy, make=make_causal_lm, x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=12)
    model = result[2]

    # The one table, looked up and reused for the logits, is listed once and
    # holds half its rows per device.
    table = model.backbone.token_embedding
    (line,) = [row for row in strategy.describe(model).splitlines()
               if row.split()[0].endswith("token_embedding")]
    assert "vocabulary" in line and "reverse=True" in line
    assert ("sharded softmax loss" in line) == sharded_loss
    assert [v.shape for v in table.embeddings.value.values] == [(VOCAB // 2, WIDTH)] * n

    # Per microbatch, Megatron's counts as for the backbone plus the reverse
    # call's "f" (its input's gradient summed backward). Its logits are
    # gathered whole (one gather), or, for the sharded loss, never (no metrics
    # ask for them): each example's maximum is gathered, its sum of
    # exponentials and true logit all-reduced. Per step, the batch exchange,
    # the row count's all-reduce and the data groups' packed all-reduce of the
    # gradients and metric states (the table's gradient is dense: its lookup's
    # slices plus the reverse matmul's).
    counts = executed_op_counts(model)
    per_microbatch = BLOCKS * (2 + 2) + 1 + 1 + 2 * sharded_loss
    per_replica = microbatches * per_microbatch + (data_size > 1) + 1
    assert counts["CollectiveReduceV2"] == n * per_replica
    # The batch exchange: the slices' sizes, then x's arrays and y together
    # (all int32: the columns of one matrix).
    assert counts["CollectiveGatherV2"] == n * (1 + 1 + microbatches)


def make_untied_lm(seed=0):
    """A ReversibleEmbedding with its own output table (tie_weights=False),
    masking id 0 from the attention, and a logit soft cap."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((SEQ,), dtype="int32")
    table = keras.layers.ReversibleEmbedding(VOCAB, WIDTH, tie_weights=False, mask_zero=True,
                                             logit_soft_cap=5.0)
    embedded = table(ids)
    hidden = keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS)(embedded, embedded)
    model = keras.Model(ids, table(hidden, reverse=True))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_untied_reverse_table_is_split_by_vocabulary_columns():
    x, y = lm_data("gpt2")
    reference = trained_reference(make=make_untied_lm, x=x["token_ids"], y=y, batch_size=16)
    strategy = tfdist.Strategy(tensor=2, devices=devices(2))
    result = train(strategy, make=make_untied_lm, x=x["token_ids"], y=y, batch_size=16)
    assert_parity(result, reference, steps=12)
    table = result[2].layers[1]
    assert [v.shape for v in table.reverse_embeddings.value.values] == [(WIDTH, VOCAB // 2)] * 2


def test_tied_embedding_across_pipeline_stages_matches_one_device():
    x, y = lm_data("gpt2", n=EXAMPLES)
    reference = trained_reference(make=make_causal_lm, x=x, y=y, batch_size=16)
    # 1F1B with remat: the last stage's replayed forward reads the copy too.
    strategy = tfdist.Strategy(data=2, pipeline=2, microbatches=2, schedule="1f1b",
                               remat=True, devices=devices(4))
    result = train(strategy, make=make_causal_lm, x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=12)
    model = result[2]

    # Stage 0 holds the table; the last stage computes with its own copy,
    # refreshed once per step, and describe counts the table once.
    def where(devices):
        return [d.split("device:")[-1] for d in devices]

    runners = strategy.train_step(model).compute.pipeline.runners
    table = model.backbone.token_embedding.embeddings
    ((tied, copy),) = runners[1].copies
    assert tied is table
    assert where(component_devices(table)) == ["CPU:0", "CPU:2"]
    assert where(v.device for v in copy.values) == ["CPU:1", "CPU:3"]
    assert not any(v is table for _, v in runners[1].weights)
    lines = strategy.describe(model).splitlines()
    assert lines[1].endswith("; tied: token_embedding (a copy of stage 0's)")


def test_tied_embedding_across_stages_of_tensor_groups_matches_one_device():
    x, y = lm_data("gpt2", n=EXAMPLES)
    reference = trained_reference(make=make_causal_lm, x=x, y=y, batch_size=16)
    strategy = tfdist.Strategy(pipeline=2, tensor=2, microbatches=2, devices=devices(4))
    result = train(strategy, make=make_causal_lm, x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=12)
    # The copy on the last stage is split by vocabulary like the table.
    model = result[2]
    ((table, copy),) = strategy.train_step(model).compute.pipeline.runners[1].copies
    assert [v.shape for v in table.value.values] == [(VOCAB // 2, WIDTH)] * 2
    assert [v.shape for v in copy.values] == [(VOCAB // 2, WIDTH)] * 2
