"""Pytest set-up for tests/ and the docstring examples in tfdist/.

Makes 8 logical CPU devices before TensorFlow initialises, so every test tier
and every `>>>` example sees the same devices: `tfdist.Strategy(data=8)` works
anywhere in the suite.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402

NUM_DEVICES = 8
tfdist.use_virtual_devices(NUM_DEVICES)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    """`keras`, `np`, `tf` and `tfdist` are imported in every `>>>` example."""
    doctest_namespace.update(keras=keras, np=np, tf=tf, tfdist=tfdist)
