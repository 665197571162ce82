"""Test session set-up: 8 logical CPU devices, before TensorFlow initialises."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfdist  # noqa: E402

NUM_DEVICES = 8
tfdist.use_virtual_devices(NUM_DEVICES)
