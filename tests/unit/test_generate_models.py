"""Decoding the project's real models: the incremental path agrees with the full forward pass."""
from __future__ import annotations

import pytest
import torch

from helpers import full_forward_logprob
from scaletrain.eval import generate as G
from scaletrain.data.batch import Example, collate
from scaletrain.models import ModelConfig, build_model
from scaletrain.vocab import BYTE_OFFSET, EOS, LANG_OFFSET, ByteVocab

VOCAB = ByteVocab(["en", "de", "th"])
EXAMPLES = [
    Example(0, 1, b"hello world", b"hallo welt"),
    Example(1, 0, b"guten tag, wie geht es dir?", b"good day"),
    Example(0, 2, b"a", "ก".encode()),
    Example(2, 0, "สวัสดี".encode(), b"hi"),
]


def tiny(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, d_model=32, n_heads=4, encoder_layers=1, decoder_layers=2, ffn_dim=64,
                      max_positions=64, dropout=0.1)
    return build_model(cfg, VOCAB.size)


@pytest.mark.parametrize("arch", ["transformer", "moce"])
def test_real_model_greedy_beam_batch(arch):
    model = tiny(arch)
    model.train()
    batch = collate(EXAMPLES)
    tags = batch.tgt_in[:, 0]
    greedy = G.generate(model, batch.src, tags, beam=1, max_len_a=0, max_len_b=5)
    beam = G.generate_with_scores(model, batch.src, tags, beam=3, lenpen=1.0, max_len_a=0, max_len_b=5)
    assert model.training  # mode restored
    model.eval()
    for i, ex in enumerate(EXAMPLES):
        one = collate([ex])
        # batch == single sentence (right padding does not change outputs)
        assert G.generate(model, one.src, one.tgt_in[:, 0], beam=1, max_len_a=0, max_len_b=5)[0] == greedy[i]
        assert G.generate(model, one.src, one.tgt_in[:, 0], beam=3, max_len_a=0, max_len_b=5)[0] == beam[i].tokens
        # greedy == step-by-step argmax of the full forward pass (the incremental cache is consistent)
        out = []
        for _ in range(5):
            with torch.no_grad():
                lg = model(one.src, torch.cat([one.tgt_in[:, :1], torch.tensor([out], dtype=torch.long)], 1))[0, -1]
            tok = int((torch.log_softmax(lg.double(), -1) + G._allowed_mask(lg.shape[-1], "cpu", torch.float64)).argmax())
            if tok == EOS:
                break
            out.append(tok)
        assert greedy[i] == out
        # beam scores are the full-forward log-probs of the returned tokens, normalised by length
        ref = full_forward_logprob(model, one.src, int(one.tgt_in[0, 0]), beam[i].tokens) / (len(beam[i].tokens) + 1)
        assert beam[i].score == pytest.approx(ref, abs=1e-4)
        assert all(BYTE_OFFSET <= t < LANG_OFFSET for t in beam[i].tokens + greedy[i])


def test_real_model_translate_then_keep_training():
    model = tiny("moce")
    res = G.translate_examples(model, EXAMPLES, VOCAB, batch_tokens=64, beam=2, max_len_a=0, max_len_b=4)
    assert len(res.texts) == len(EXAMPLES) and all(len(t) <= 4 for t in res.tokens)
    # decoding leaves no inference-mode tensors behind: training (with routing statistics) still works
    model.train()
    b = collate(EXAMPLES)
    model(b.src, b.tgt_in).sum().backward()
    assert any(p.grad is not None for p in model.parameters())
