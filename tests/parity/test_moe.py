"""Mixtures of experts: keras-hub's Mixtral, whose blocks add the router's
load-balancing loss (a product of two means over the batch's tokens) with
`add_loss`. Under data parallelism tfdist computes it from the global batch's
statistics (`tfdist.batch_statistics`): one device's loss and weights; where
it cannot (microbatches), it says so before training. The experts stay whole
under `tensor`, named as such."""

import warnings

import pytest

import tfdist
from helpers import assert_parity, devices, train, trained_reference
from test_tensor_blocks import lm_data, make_mixtral
from tfdist.tensor.plan import plan, warn_of_whole_layers

pytest.importorskip("keras_hub")


def test_router_loss_of_the_global_batch_under_data_parallelism():
    x, y = lm_data("mixtral")
    reference = trained_reference(make=make_mixtral, x=x, y=y, batch_size=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(tfdist.Strategy(data=2, devices=devices(2)), make=make_mixtral,
                       x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=12)
    assert not [w for w in caught if "add_loss" in str(w.message)]


def test_router_loss_per_microbatch_is_told_before_training():
    x, y = lm_data("mixtral", n=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tfdist.Strategy(microbatches=2, devices=devices(1)), make=make_mixtral,
              x=x, y=y, batch_size=16)
    told = [str(w.message) for w in caught]
    assert any("adds losses in its call (`add_loss`): they are computed on each of the 2 "
               "microbatches" in m and "batch_mean" in m for m in told), told


def test_experts_are_named_whole_under_tensor():
    strategy = tfdist.Strategy(tensor=2, devices=devices(2))
    with strategy.scope():
        model = make_mixtral()
    experts = "4 experts of a mixture of experts: each device holds every expert"
    rows = strategy.describe(model).splitlines()
    assert sum(experts in row for row in rows) == 2  # one layer of experts per block
    with pytest.warns(UserWarning, match=rf"tensor=2 leaves .*{experts}"):
        warn_of_whole_layers(model, plan(model, 2), 2)
