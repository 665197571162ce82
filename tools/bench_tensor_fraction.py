"""What each device holds of keras-hub models under `tensor`, measured.

    python tools/bench_tensor_fraction.py [--tensor=2] [--models=llama,qwen3] [--out=results.jsonl]

Each model: an unchanged keras-hub backbone (tiny configuration: width 64, 4
heads, 2 blocks, vocabulary 512) with a token classifier on top, built in
`Strategy(tensor=t)`'s scope and trained one step (SGD), so that its layers
are split as in training. Then, from the variables themselves: the bytes the
first device holds over the model's bytes (`fraction`), the same for the
Transformer blocks' weights alone (`blocks_fraction`: 1/t is ideal, their
norms stay whole), and the layers with matrices the plan leaves whole, with
the reason `describe` gives. One JSON line per model, then a table.
"""

import collections

from absl import app, flags

from results import emit

flags.DEFINE_integer("tensor", 2, "Devices of the tensor group.")
flags.DEFINE_list("models", None, "Models to measure (default: all of MODELS).")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
VOCAB, WIDTH, HEADS, FF, BLOCKS, SEQ = 512, 64, 4, 128, 2, 16

_COMMON = dict(vocabulary_size=VOCAB, num_layers=BLOCKS, hidden_dim=WIDTH, intermediate_dim=FF)
_GQA = dict(_COMMON, num_query_heads=HEADS, num_key_value_heads=HEADS // 2)
# keras-hub class name -> its arguments beyond the common ones.
MODELS = {
    "GPT2Backbone": dict(_COMMON, num_heads=HEADS, max_sequence_length=SEQ),
    "BertBackbone": dict(_COMMON, num_heads=HEADS, max_sequence_length=SEQ),
    "LlamaBackbone": _GQA,
    "MistralBackbone": _GQA,
    "Phi3Backbone": _GQA,
    "QwenBackbone": _GQA,
    "Qwen3Backbone": dict(_GQA, head_dim=WIDTH // HEADS),
    "GemmaBackbone": dict(_GQA, head_dim=WIDTH // HEADS),
    "BloomBackbone": dict(_COMMON, num_heads=HEADS),
    "FalconBackbone": dict(_COMMON, num_attention_heads=HEADS),
    "GPTNeoXBackbone": dict(_COMMON, num_heads=HEADS, max_sequence_length=SEQ),
    "OPTBackbone": dict(_COMMON, num_heads=HEADS, max_sequence_length=SEQ),
    "RoformerV2Backbone": dict(_COMMON, num_heads=HEADS, head_size=WIDTH // HEADS),
    "DistilBertBackbone": dict(_COMMON, num_heads=HEADS, max_sequence_length=SEQ),
    "DebertaV3Backbone": dict(_COMMON, num_heads=HEADS, max_sequence_length=SEQ),
    "MixtralBackbone": dict(_GQA, num_experts=4),
    "Qwen3MoeBackbone": dict(_GQA, moe_intermediate_dim=FF // 2, num_experts=4),
}


def measure(name):
    import keras
    import keras_hub
    import numpy as np

    import tfdist
    from tfdist.tensor.layouts import Replicated
    from tfdist.tensor.plan import plan

    strategy = tfdist.Strategy(tensor=FLAGS.tensor)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        backbone = getattr(keras_hub.models, name)(**MODELS[name])
        features = backbone.output
        if isinstance(features, dict):
            features = features["sequence_output"]
        model = keras.Model(backbone.input, keras.layers.Dense(VOCAB)(features))
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = {key: (rng.integers(0, VOCAB, (8, SEQ)) if "token" in key else np.ones((8, SEQ))
               if "mask" in key else np.zeros((8, SEQ))).astype("int32")
         for key in backbone.input}
    model.fit(x, rng.integers(0, VOCAB, (8, SEQ)), batch_size=8, epochs=1, verbose=0)

    def held(weights):  # elements on the first device over elements
        return (sum(w.value.values[0].shape.num_elements() for w in weights)
                / sum(int(np.prod(w.shape)) for w in weights))

    blocks = [layer for layer in backbone.layers if layer.weights and any(
        part in layer.name for part in ("layer_", "block", "encoder", "decoder"))]
    whole = collections.Counter(
        d.reason for d in plan(model, FLAGS.tensor) if isinstance(d.layout, Replicated)
        and any(len(w.shape) >= 2 for w in d.layer.trainable_weights))
    return {"bench": "tensor_fraction", "model": name, "tensor": FLAGS.tensor,
            "fraction": round(held(model.trainable_weights), 3),
            "blocks_fraction": round(held([w for b in blocks for w in b.trainable_weights]), 3),
            "whole": dict(whole)}


def main(argv):
    del argv
    import tfdist

    tfdist.use_virtual_devices(FLAGS.tensor)
    rows = []
    for name in FLAGS.models or MODELS:
        record = measure(name)
        emit(record, FLAGS.out)
        rows.append(record)
    print(f"\n| model | fraction per device | blocks' fraction | whole (tensor={FLAGS.tensor}) |")
    print("|---|---|---|---|")
    for r in rows:
        reasons = "; ".join(f"{n} x {why}" for why, n in r["whole"].items()) or "-"
        print(f"| {r['model']} | {r['fraction']} | {r['blocks_fraction']} | {reasons} |")


if __name__ == "__main__":
    app.run(main)
