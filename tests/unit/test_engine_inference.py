"""Engine.inference_module: the engine alone decides whether decoding needs a gathered copy."""
from __future__ import annotations

import torch

from helpers import local_engine
from scaletrain.config import load_config
from scaletrain.engine.deepspeed_backend import is_partitioned
from scaletrain.models import ModelConfig, build_model
from scaletrain.vocab import ByteVocab

VOCAB = ByteVocab(["en", "de", "ja"])
CFG = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64, max_positions=64,
                  dropout=0.0)


def FakeEngine(model, partitioned):
    """The real Engine, world of one, over a backend whose ``partitioned()`` answer the test chooses."""
    eng = local_engine(load_config("small", ["engine.compile=false"]), partitioned=partitioned)
    eng.setup(model)
    return eng


def _model():
    torch.manual_seed(0)
    return build_model(CFG, VOCAB.size)


def test_full_parameters_decode_with_the_module_itself_in_eval_mode():
    model = _model().train()
    eng = FakeEngine(model, partitioned=False)
    built = []
    out = eng.inference_module(lambda: built.append(1) or build_model(CFG, VOCAB.size))
    assert out is model and not model.training and built == []


def test_partitioned_parameters_decode_with_a_gathered_copy_without_touching_rng():
    model = _model()
    eng = FakeEngine(model, partitioned=True)
    rng = torch.get_rng_state()
    copy = eng.inference_module(lambda: build_model(CFG, VOCAB.size))
    assert torch.equal(torch.get_rng_state(), rng)
    assert copy is not model and not copy.training
    for (k, a), (_, b) in zip(model.state_dict().items(), copy.state_dict().items()):
        assert torch.equal(a, b), k


def test_zero3_partitioning_is_detected_from_deepspeed_marks():
    model = _model()
    assert not is_partitioned(model)
    for p in model.parameters():
        p.ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    assert is_partitioned(model)
