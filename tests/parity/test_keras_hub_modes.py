"""keras-hub models (GPT-2, BERT, Llama and Gemma backbones with a token
classifier, GPT2CausalLM) in the modes test_tensor_blocks.py and
test_tied_embeddings.py do not cover: data 4 x ZeRO 1, data 2 x ZeRO 2 x
microbatches 2, GPipe and data x tensor x ZeRO 1, each against one device
(12+ steps' losses and final weights, fp32, rtol 1e-4), SGD with momentum and
Adam alternating over the cases. Dropout is off (`dropout=0.0`): each replica
draws its own masks, so no multi-device run could match one device's."""

import keras
import pytest

from helpers import assert_parity, strategy_on_its_devices, train, trained_reference
from test_tensor_blocks import MAKERS, lm_data
from test_tied_embeddings import EXAMPLES, make_causal_lm

keras_hub = pytest.importorskip("keras_hub")

MODELS = {**MAKERS, "causal_lm": make_causal_lm}
_ADAM = {}


def maker(name, optimizer):
    """The recipe of model `name` (its own SGD with momentum, or Adam), one
    function per pair so that `trained_reference` trains each once."""
    if optimizer == "sgd":
        return MODELS[name]
    if name not in _ADAM:
        def make():
            model = MODELS[name]()
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=model.loss,
                          weighted_metrics=[])
            return model
        _ADAM[name] = make
    return _ADAM[name]


# Each mode's features combined where they are independent (ZeRO with data
# parallelism and with microbatches), so that every feature meets every model
# in four trainings.
MODES = [dict(data=4, zero=1), dict(data=2, zero=2, microbatches=2),
         dict(pipeline=2, microbatches=2, schedule="gpipe"), dict(data=2, tensor=2, zero=1)]
# Every model in every mode, the optimizer alternating.
CASES = [(name, ("sgd", "adam")[(m + i) % 2], mode)
         for m, name in enumerate(MODELS) for i, mode in enumerate(MODES)]


def case_id(case):
    name, optimizer, config = case
    return "-".join([name, optimizer, *(f"{k}{v}" for k, v in config.items())])


@pytest.mark.parametrize("name, optimizer, config", CASES, ids=map(case_id, CASES))
def test_matches_one_device(name, optimizer, config):
    # The causal LM's last batch has 5 examples (uneven over replicas).
    x, y = lm_data("bert" if name == "bert" else "gpt2",
                   n=EXAMPLES if name == "causal_lm" else 192)
    make = maker(name, optimizer)
    reference = trained_reference(make=make, x=x, y=y, batch_size=16)
    result = train(strategy_on_its_devices(**config), make=make, x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=12)
