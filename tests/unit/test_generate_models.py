"""Decoding the project's real models: the incremental path agrees with the full forward pass."""
from __future__ import annotations

import pytest
import torch

from helpers import full_forward_logprob
from scaletrain.eval import generate as G
from scaletrain.eval.decode_step import allowed_mask
from scaletrain.eval.requests import translate_examples
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
            tok = int((torch.log_softmax(lg.double(), -1) + allowed_mask(lg.shape[-1], "cpu", torch.float64)).argmax())
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
    res = translate_examples(model, EXAMPLES, VOCAB, batch_tokens=64, beam=2, max_len_a=0, max_len_b=4)
    assert len(res.texts) == len(EXAMPLES) and all(len(t) <= 4 for t in res.tokens)
    # decoding leaves no inference-mode tensors behind: training (with routing statistics) still works
    model.train()
    b = collate(EXAMPLES)
    model(b.src, b.tgt_in).sum().backward()
    assert any(p.grad is not None for p in model.parameters())


class _Keeper(torch.nn.Module):
    """A toy decoder that keeps state created while decoding: a replaced buffer, a tuple, a dict of lists."""

    max_positions = 64

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.kept: dict = {"per_step": []}
        self.last = None

    def encode(self, src):
        from toy_decoders import Rows

        return Rows(src.shape[0])

    def decode_step(self, tokens, step, enc, cache):
        self.calls = self.calls + 1  # a new tensor each step (made under inference mode)
        self.last = (tokens.clone(), step)
        self.kept["per_step"].append(torch.ones(2))
        logits = torch.full((tokens.shape[0], VOCAB.size), -5.0)
        logits[:, BYTE_OFFSET + ord("a")] = 1.0
        logits[:, EOS] = 2.0 if step >= 2 else -50.0
        return logits, None

    def reorder_cache(self, cache, index):
        return None


@pytest.mark.parametrize("beam", [1, 2])
def test_decoding_leaves_only_normal_tensors_on_the_model(beam):
    """Decoding runs in inference mode; what the model kept from it is a normal tensor afterwards, so training
    can update it in place (an inference tensor raises "Inplace update to inference tensor outside
    InferenceMode")."""
    model = _Keeper()
    b = collate(EXAMPLES)
    assert G.generate(model, b.src, b.tgt_in[:, 0], beam=beam, max_len_a=0, max_len_b=4)[0]
    kept = [model.calls, model.last[0], *model.kept["per_step"]]
    assert not any(t.is_inference() for t in kept) and len(kept) > 3
    for t in kept:
        t.add_(1)  # in place, outside inference mode
    assert dict(model.named_buffers())["calls"] is model.calls


@pytest.mark.parametrize("arch", ["transformer", "moce"])
def test_inference_mode_decodes_the_same_hypotheses_as_no_grad(arch, monkeypatch):
    """Decoding in inference mode (for speed) gives exactly the tokens and scores of decoding under no_grad,
    greedy and beam, with and without the decoding bounds."""
    model = tiny(arch).eval()
    b = collate(EXAMPLES)

    def decode():
        return [[(h.tokens, h.score, h.cut) for h in G.generate_with_scores(
            model, b.src, b.tgt_in[:, 0], beam=beam, lenpen=1.2, max_len_a=0, max_len_b=12, stop_invalid_utf8=utf8,
            row_limits=torch.tensor([12, 3, 7, 12]))] for beam in (1, 4) for utf8 in (False, True)]

    fast = decode()
    monkeypatch.setattr(G.torch, "inference_mode", torch.no_grad)
    assert decode() == fast
    assert any(len(h[0]) > 3 for run in fast for h in run)  # hypotheses long enough to differ
