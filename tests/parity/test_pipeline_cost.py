"""Pipeline stages of real-size keras-hub models, balanced from their configs
(no data, no training): GPT-2 small and BERT base, each cut into 4 stages
whose estimated costs are within 15% of the mean. Here rather than in
tests/unit: building a 110-124 M parameter model takes about 10 s on CPU."""

import re

import keras_hub
import pytest

import tfdist
from helpers import devices

GPT2_SMALL = dict(vocabulary_size=50257, num_layers=12, num_heads=12, hidden_dim=768,
                  intermediate_dim=3072, max_sequence_length=1024)
BERT_BASE = dict(vocabulary_size=30522, num_layers=12, num_heads=12, hidden_dim=768,
                 intermediate_dim=3072, max_sequence_length=512)


@pytest.fixture(scope="module")
def gpt2():
    return keras_hub.models.GPT2Backbone(**GPT2_SMALL)


@pytest.fixture(scope="module")
def bert():
    return keras_hub.models.BertBackbone(**BERT_BASE)


def stage_lines(model, sequence_length, pipeline=4):
    strategy = tfdist.Strategy(pipeline=pipeline, microbatches=pipeline,
                               devices=devices(pipeline))
    return strategy.describe(model, sequence_length=sequence_length).splitlines()[:pipeline]


def ratios(lines):
    return [float(re.search(r"\(([\d.]+)x mean\)", line).group(1)) for line in lines]


def layers(line):
    return line.split("layers: ")[1].split(", ")


def test_gpt2_small_stages_are_balanced_at_sequence_1024(gpt2):
    lines = stage_lines(gpt2, 1024)
    assert max(ratios(lines)) <= 1.15, "\n".join(lines)
    # The embeddings are lookups: they share stage 0 with three of the 12 blocks.
    assert layers(lines[0])[:2] == ["token_embedding", "position_embedding"]
    assert [sum(n.startswith("transformer_layer") for n in layers(line))
            for line in lines] == [3, 3, 3, 3]


def test_bert_base_stages_are_balanced_at_sequence_512(bert):
    lines = stage_lines(bert, 512)
    assert max(ratios(lines)) <= 1.15, "\n".join(lines)
    assert [sum(n.startswith("transformer_layer") for n in layers(line))
            for line in lines] == [3, 3, 3, 3]


def test_a_task_model_is_cut_inside_its_backbone(bert):
    classifier = keras_hub.models.BertTextClassifier(backbone=bert, num_classes=3,
                                                     preprocessor=None)
    lines = stage_lines(classifier, 512)
    assert max(ratios(lines)) <= 1.15, "\n".join(lines)
    assert layers(lines[0])[0] == "token_embedding" and layers(lines[3])[-1] == "logits"


def test_a_tied_output_embedding_is_held_by_stage_0_and_copied_to_the_last(gpt2):
    lm = keras_hub.models.GPT2CausalLM(backbone=gpt2, preprocessor=None)
    lines = stage_lines(lm, 1024)
    # The output projection (768 x 50,257 per position) weighs about four
    # blocks: the last stage takes it with fewer blocks.
    assert max(ratios(lines)) <= 1.15, "\n".join(lines)
    assert layers(lines[0])[0] == "token_embedding"
    assert lines[3].endswith("; tied: token_embedding (a copy of stage 0's)")
    params = [int(re.search(r"params ([\d,]+)", line).group(1).replace(",", ""))
              for line in lines]
    assert sum(params) == lm.count_params()  # the table counted once, on stage 0


def test_blocks_called_by_keyword_are_costed_by_their_sequence():
    """keras-hub's BART calls its decoder blocks by keyword only
    (`block(decoder_sequence=x, encoder_sequence=e, decoder_padding_mask=m, ...)`),
    which Keras lists by name: the mask came first and was taken for the
    sequence, costing each decoder block ~1/100 of its work and putting all
    six on the last stage."""
    bart = keras_hub.models.BartBackbone(
        vocabulary_size=1000, num_layers=6, num_heads=4, hidden_dim=256,
        intermediate_dim=1024, max_sequence_length=512)
    lines = stage_lines(bart, 512)
    assert max(ratios(lines)) <= 1.3, "\n".join(lines)
    decoder_blocks = [sum(n.startswith("transformer_decoder_layer") for n in layers(line))
                      for line in lines]
    assert max(decoder_blocks) <= 3, "\n".join(lines)
