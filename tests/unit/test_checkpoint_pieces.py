"""What each replica writes and reads of a sharded checkpoint: the rectangles
of the full tensor that hold its shard, each element written exactly once."""

import numpy as np
import pytest
import tensorflow as tf

from tfdist.checkpoint import _shard_rectangles, flat_rectangles
from tfdist.sharding.layout import AxisLayout, MeshShardLayout, ShardLayout


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2), ()])
def test_flat_ranges_are_rectangles_in_element_order(shape):
    full = np.arange(int(np.prod(shape))).reshape(shape)
    size = full.size
    for start in range(size + 1):
        for stop in range(start, size + 1):
            found = flat_rectangles(start, stop, shape)
            values = [full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].ravel()
                      for offsets, lengths in found]
            joined = np.concatenate(values) if values else np.array([], int)
            np.testing.assert_array_equal(joined, full.ravel()[start:stop])
            assert len(found) <= max(1, 2 * len(shape) - 1)


LAYOUTS = [
    ShardLayout((3, 5), 4), ShardLayout((10,), 3), ShardLayout((2, 3, 4), 8), ShardLayout((2,), 3),
    AxisLayout((4, 6), axis=1, parts=2), AxisLayout((6, 4), axis=0, parts=3),
    MeshShardLayout((4, 6), tensor=2, data=2, split=AxisLayout((4, 6), axis=1, parts=2)),
    MeshShardLayout((5, 3), tensor=2, data=3),
    MeshShardLayout((6, 5), tensor=3, data=2, split=AxisLayout((6, 5), axis=0, parts=3)),
]


@pytest.mark.parametrize("layout", LAYOUTS,
                         ids=[f"{type(x).__name__}-{i}" for i, x in enumerate(LAYOUTS)])
def test_each_replica_reads_its_shard_and_the_first_holders_write_each_element_once(layout):
    shape = layout.shape.as_list()
    full = np.arange(int(np.prod(shape))).reshape(shape)
    replicas = (layout.num_shards if isinstance(layout, ShardLayout) else
                layout.parts * 2 if isinstance(layout, AxisLayout) else
                layout.tensor * layout.part.num_shards)
    written = np.zeros(shape, int)
    for replica in range(replicas):
        rectangles, first = _shard_rectangles(layout, replica)
        pieces = [full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
                  for offsets, lengths in rectangles]
        read = np.concatenate([p.ravel() for p in pieces]) if pieces else np.array([], int)
        shard = layout.shard(tf.constant(full), replica).numpy().ravel()
        # What it reads is its shard without the padding (zeros at its end).
        np.testing.assert_array_equal(read, shard[:read.size])
        assert not shard[read.size:].any()
        if first:
            for offsets, lengths in rectangles:
                written[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] += 1
    np.testing.assert_array_equal(written, np.ones(shape, int))
