"""The single-device references' on-disk cache (helpers.trained_reference):
its key follows everything that decides a reference, and recipes without a
stable text (lambdas) stay in the process."""

import functools
import importlib
import os
import sys

import keras
import numpy as np
import pytest

import helpers
from helpers import data, make_model, reference_key


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory and process dict; `train` counted, not run."""
    monkeypatch.setattr(helpers, "REFERENCES_DIR", str(tmp_path))
    monkeypatch.setattr(helpers, "_REFERENCES", {})
    calls = []

    def fake_train(*, make, x, y, **kwargs):
        calls.append(make)
        return [0.5, 0.25], [np.arange(6, dtype="float32").reshape(2, 3),
                             np.ones(4, "int64")], object()

    monkeypatch.setattr(helpers, "train", fake_train)
    return tmp_path, calls


def _write_recipe(directory, body):
    (directory / "recipe_module.py").write_text(
        f"def make():\n    return {body}\n")


def test_key_follows_the_recipes_source(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _write_recipe(tmp_path, "1")
    module = importlib.import_module("recipe_module")
    try:
        before = reference_key(make=module.make)
        _write_recipe(tmp_path, "2 + 0")
        module = importlib.reload(module)
        assert reference_key(make=module.make) not in (None, before)
    finally:
        sys.modules.pop("recipe_module", None)


def test_key_follows_the_data_the_arguments_and_the_dtype_policy():
    x, y = data()
    key = reference_key(make=make_model, x=x, y=y)
    assert key == reference_key(make=make_model) == reference_key(make=make_model, x=x, y=y)
    changed = x.copy()
    changed[0, 0] += 1
    assert reference_key(make=make_model, x=changed, y=y) != key
    assert reference_key(make=make_model, x=x.astype("float64"), y=y) != key
    assert reference_key(make=make_model, batch_size=16) != key
    assert reference_key(make=make_model, batch_size=16) != reference_key(
        make=make_model, batch_size=17)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        assert reference_key(make=make_model) != key
    finally:
        keras.config.set_dtype_policy(previous)
    assert reference_key(make=make_model) == key


def test_recipes_without_a_stable_text_have_no_key():
    assert reference_key(make=lambda: make_model()) is None
    optimizer = keras.optimizers.SGD(0.1)

    def closure_over_an_object():
        return make_model(optimizer=optimizer)

    assert reference_key(make=closure_over_an_object) is None
    # Callbacks (their repr is an address) in the arguments of train.
    assert reference_key(make=make_model, fit_kwargs={"callbacks": [object()]}) is None


def test_nested_functions_and_partials_are_keyed_by_their_values():
    def recipe(name):
        def make():
            return make_model(seed=len(name))
        return make

    assert reference_key(make=recipe("a")) not in (None, reference_key(make=recipe("bb")))
    assert reference_key(make=recipe("a")) == reference_key(make=recipe("a"))
    one, two = functools.partial(make_model, seed=1), functools.partial(make_model, seed=2)
    assert reference_key(make=one) not in (None, reference_key(make=two))
    assert reference_key(make=one) != reference_key(make=make_model)


def test_a_reference_is_written_once_and_read_by_another_process(cache):
    directory, calls = cache
    first = helpers.trained_reference(make=make_model, batch_size=16)
    assert len(calls) == 1 and first[2] is None
    assert os.listdir(directory) == [f"{reference_key(make=make_model, batch_size=16)}.npz"]
    helpers._REFERENCES.clear()  # as in another process of the run
    second = helpers.trained_reference(make=make_model, batch_size=16)
    assert len(calls) == 1
    assert second[0] == first[0] == [0.5, 0.25]
    for ours, theirs in zip(second[1], first[1], strict=True):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(ours, theirs)


def test_a_lambda_is_kept_in_the_process_only(cache):
    directory, calls = cache
    make = lambda: make_model()  # noqa: E731
    helpers.trained_reference(make=make)
    helpers.trained_reference(make=make)
    assert len(calls) == 1 and os.listdir(directory) == []
    helpers._REFERENCES.clear()
    helpers.trained_reference(make=make)
    assert len(calls) == 2
