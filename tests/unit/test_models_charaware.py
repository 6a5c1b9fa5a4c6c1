"""Character-aware gated (CG) target embeddings (Renduchintala et al. 2018): tiny configs, CPU, seconds."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import decode_all
from scaletrain.errors import ScaletrainError
from scaletrain.models import CharAwareEmbeddings, ModelConfig, build_model, count_parameters
from scaletrain.models.charaware import charaware_parameter_count, char_table, pieces_from_state_dict
from scaletrain.models.config import CharAwareConfig, ConvConfig, LobefConfig
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.vocab import PAD

D = 32
N_SPECIALS, N_TAGS = 4, 4


def make_pieces(n=100, seed=0) -> list[str]:
    """4 specials (''), n distinct random pieces over 'abcdefgh' (half with the U+2581 word mark), 4 tags ('')."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        p = ("\u2581" if rng.random() < 0.5 else "") + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 6)))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return [""] * N_SPECIALS + out + [""] * N_TAGS


PIECES = make_pieces()
V = len(PIECES)  # 108
TAG0 = N_SPECIALS + 100  # first language tag id


def cfg(charaware=None, **kw) -> ModelConfig:
    """``charaware``: keys of model.charaware over the test's char dim 16."""
    base = dict(
        d_model=D, n_heads=4, encoder_layers=1, decoder_layers=2, ffn_dim=64, dropout=0.0, max_positions=64,
        embedding="charaware", charaware=CharAwareConfig(**{"dim": 16, **(charaware or {})}),
    )
    base.update(kw)
    return ModelConfig(**base)


def make(seed=0, pieces=PIECES, **kw):
    torch.manual_seed(seed)
    return build_model(cfg(**kw), len(pieces), pieces)


def batch(seed=1, B=3):
    """src: tag, pieces, eos; tgt_in: tag, pieces (right padded, rows of different lengths)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.zeros(B, 9, dtype=torch.long)
    tgt = torch.zeros(B, 7, dtype=torch.long)
    lens = []
    for i in range(B):
        ls, lt = 5 + i, 4 + i
        src[i, 0], src[i, 1 : ls + 1], src[i, ls + 1] = TAG0, torch.randint(4, TAG0, (ls,), generator=g), 2
        tgt[i, 0], tgt[i, 1 : lt + 1] = TAG0 + 1, torch.randint(4, TAG0, (lt,), generator=g)
        lens.append(lt + 1)
    return src, tgt, lens


COMPOSABLE = torch.tensor([p != "" for p in PIECES])


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread is fastest, and on a busy 2-core machine two threads spin
    against each other (the toy training run goes from ~2 s to ~60 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------
def test_shapes_and_one_matrix_for_decoder_input_and_softmax():
    m = make()
    emb = m.embeddings
    assert isinstance(emb, CharAwareEmbeddings)
    src, tgt, _ = batch()
    assert m(src, tgt).shape == (3, 7, V)
    assert emb.char_ids.shape == (V, 20 + 2) and emb.composed().shape == (V, D)
    h = torch.randn(3, 7, D)

    def check(E):
        dec = emb(tgt, "decoder")
        real = tgt.ne(PAD)
        torch.testing.assert_close(dec[real], E[tgt[real]] * D**0.5, rtol=0, atol=1e-6)
        assert dec[~real].abs().max() == 0
        torch.testing.assert_close(emb(h, "output"), h @ E.T, rtol=0, atol=1e-5)

    for train in (True, False):
        m.train(train)
        with torch.set_grad_enabled(train):
            E1 = emb.mixed().detach()
            check(E1)
            with torch.no_grad():  # change the composition only: both uses follow (eval cache invalidated)
                emb.convs[1].weight.add_(0.2 * torch.randn_like(emb.convs[1].weight))
            E2 = emb.mixed().detach()
            changed = (E2 - E1).abs().amax(1) > 1e-4
            assert changed[COMPOSABLE].all() and not changed[~COMPOSABLE].any()
            check(E2)
    # the encoder reads the standard rows (share_embeddings: the std part of E; else its own matrix)
    torch.testing.assert_close(emb(src, "raw"), emb.std_weight[src] * src.ne(PAD)[..., None], rtol=0, atol=0)
    sep = make(share_embeddings=False).embeddings
    torch.testing.assert_close(sep(src, "encoder"), sep.encoder_weight[src] * src.ne(PAD)[..., None] * D**0.5)
    assert not torch.equal(sep.encoder_weight, sep.std_weight)


@pytest.mark.parametrize("gate", ["vector", "scalar"])
def test_gate_at_one_and_zero_gives_standard_and_composed_rows_exactly(gate):
    emb = make(charaware={"gate": gate}).embeddings
    assert emb.gate_weight.shape == (V, D if gate == "vector" else 1)
    assert torch.equal(emb.gate()[COMPOSABLE], torch.full_like(emb.gate()[COMPOSABLE], 0.5))  # init w_gate = 0
    with torch.no_grad():
        std, comp = emb.std_weight.clone(), emb.composed()
        emb.gate_weight.fill_(1e4)
        assert torch.equal(emb.mixed(), std)
        emb.gate_weight.fill_(-1e4)
        E = emb.mixed()
        assert torch.equal(E[COMPOSABLE], comp[COMPOSABLE])
        assert torch.equal(E[~COMPOSABLE], std[~COMPOSABLE])  # '' pieces: gate fixed to 1
        # a mid gate is the convex mix of eq. 9
        emb.gate_weight.fill_(0.3)
        g = torch.sigmoid(torch.tensor(0.3))
        torch.testing.assert_close(emb.mixed()[COMPOSABLE], (g * std + (1 - g) * comp)[COMPOSABLE])


def test_composed_row_depends_only_on_its_own_characters():
    pieces = list(PIECES)
    pieces[10] = pieces[20]  # two ids with the same spelling
    emb = make(pieces=pieces).embeddings
    with torch.no_grad():
        c = emb.composed()
        assert torch.equal(c[10], c[20])
        assert (c[10] - c[11]).abs().max() > 1e-4
        # change one character of piece 30 (to another char of the vocabulary): only row 30 moves
        ids = emb.char_ids
        assert ids[30, 1] != ids[31, 1]
        ids[30, 1] = ids[31, 1]
        c2 = emb.composed()
    diff = (c2 - c).abs().amax(1)
    assert diff[30] > 1e-4
    assert diff[torch.arange(V) != 30].max() == 0


def test_padding_characters_do_not_matter_and_long_pieces_are_truncated():
    long = "\u2581" + "abcdefgh" * 3  # 25 characters
    pieces = list(PIECES) + [long, long[:20], "ab"]
    a = make(pieces=pieces, charaware={"max_len": 20}).embeddings
    b = make(pieces=pieces, charaware={"max_len": 30}).embeddings
    assert a.char_ids.shape[1] == 22 and b.char_ids.shape[1] == 32
    assert torch.equal(a.char_codepoints, b.char_codepoints)  # same char vocabulary, same parameters
    with torch.no_grad():
        ca, cb = a.composed(), b.composed()
    n = len(PIECES)
    # every piece of <= 20 chars: identical whatever the table width
    keep = torch.arange(n + 3) != n  # all but the 25-char piece
    torch.testing.assert_close(ca[: n + 3][keep], cb[: n + 3][keep], rtol=0, atol=1e-6)
    # adversarial weights: every window over real characters is negative, a window over padding alone
    # would give 0 and win the max; windows start inside the spelling, so the widths still agree
    with torch.no_grad():
        for e in (a, b):
            e.char_embed.weight.abs_()
            for conv in e.convs:
                conv.weight.abs_().neg_()
                conv.bias.zero_()
        ca2, cb2 = a.composed(), b.composed()
    assert (ca2 - ca).abs().max() > 1e-3
    torch.testing.assert_close(ca2[: n + 3][keep], cb2[: n + 3][keep], rtol=0, atol=1e-6)
    # the 25-char piece is its first 20 characters at charaware.max_len=20, but not at 30
    assert torch.equal(ca[n], ca[n + 1])
    assert (cb[n] - cb[n + 1]).abs().max() > 1e-4
    code_points, table = char_table(["ab", ""], 4)
    assert code_points == [ord("a"), ord("b")] and table.tolist() == [[1, 3, 4, 2, 0, 0], [0] * 6]


def test_decode_step_matches_full_forward_with_the_eval_cache(monkeypatch):
    m = make().eval()
    src, tgt, lens = batch()
    calls = []
    real = CharAwareEmbeddings.composed
    monkeypatch.setattr(CharAwareEmbeddings, "composed", lambda self: calls.append(1) or real(self))
    with torch.no_grad():
        full = m(src, tgt)
        inc = decode_all(m, src, tgt)
    assert len(calls) == 1  # one composition for the full forward and all 7 decoding steps
    for i, n in enumerate(lens):
        torch.testing.assert_close(inc[i, :n], full[i, :n], atol=1e-5, rtol=0)
    # training: one composition per forward (decoder input and softmax share it), gradients reach every part
    assert m.embeddings._cache is not None
    m.train()
    assert m.embeddings._cache is None  # the mode switch drops the eval cache (and its memory)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    loss = label_smoothed_ce(m(src, tgt), torch.roll(tgt, -1, 1), 0.0)[0]
    assert len(calls) == 2
    loss.backward()
    emb = m.embeddings
    for p in (emb.std_weight, emb.gate_weight, emb.char_embed.weight, emb.convs[3].weight, emb.highways[1].gate.weight):
        assert p.grad is not None and p.grad.abs().max() > 0
    assert emb.gate_weight.grad[~COMPOSABLE].abs().max() == 0  # '' pieces use the standard row only
    opt.step()
    # back to eval: the cache is rebuilt from the updated parameters
    m.eval()
    with torch.no_grad():
        after = m(src, tgt)
        inc2 = decode_all(m, src, tgt)
        assert len(calls) == 3
        assert (after - full).abs().max() > 1e-3
        E = emb.mixed()
        torch.testing.assert_close(emb.matrix(), E, rtol=0, atol=0)
    for i, n in enumerate(lens):
        torch.testing.assert_close(inc2[i, :n], after[i, :n], atol=1e-5, rtol=0)


def test_state_dict_round_trip_and_rebuild_without_the_tokenizer():
    m = make(seed=0).eval()
    src, tgt, _ = batch()
    sd = m.state_dict()
    assert "embeddings.char_ids" in sd and "embeddings.char_codepoints" in sd
    fresh = make(seed=5).eval()
    with torch.no_grad():
        assert (fresh(src, tgt) - m(src, tgt)).abs().max() > 1e-3
        fresh(src, tgt)  # fill the eval cache: loading must invalidate it
        fresh.load_state_dict(sd)
        assert torch.equal(fresh(src, tgt), m(src, tgt))
    pieces = pieces_from_state_dict(sd)
    assert pieces == PIECES
    torch.manual_seed(9)
    rebuilt = build_model(cfg(), V, pieces).eval()
    rebuilt.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(rebuilt(src, tgt), m(src, tgt))
    with pytest.raises(ScaletrainError, match="charaware"):
        pieces_from_state_dict(make(embedding="learned").state_dict())


# hand count for pieces ['']*4 + ['▁ab', 'abc', 'b', '▁c'] + ['']*2: V = 10, 4 characters -> char vocab 7
SMALL = [""] * 4 + ["\u2581ab", "abc", "b", "\u2581c"] + [""] * 2


@pytest.mark.parametrize(
    "kw,expected",
    [
        # std 10*32 + gate 10*32 + chars 7*16 + convs (3+4+5+6)*16*8 + 4*8 + highway 2*2*(32*32+32)
        ({}, 320 + 320 + 112 + 2304 + 32 + 4224),  # 7312
        ({"share_embeddings": False}, 7312 + 320),  # + encoder matrix
        ({"charaware": {"gate": "scalar"}}, 7312 - 320 + 10),  # one gate per type
        # filters 10 -> T = 40 != d: convs 18*16*10 + 40, highway 4*(1600+40), projection 40*32+32
        ({"charaware": {"filters": 10}}, 320 + 320 + 112 + 2880 + 40 + 6560 + 1312),  # 11544
        ({"charaware": {"highway_layers": 0, "kernels": [3]}}, 320 + 320 + 112 + (3 * 16 * 32 + 32)),  # filters 32/1
    ],
)
def test_parameter_count_matches_hand_computation(kw, expected):
    c = cfg(**kw)
    emb = build_model(c, len(SMALL), SMALL).embeddings
    n = sum(p.numel() for p in emb.parameters())
    assert n == expected
    assert charaware_parameter_count(c, len(SMALL), n_chars=4) == expected
    assert emb.char_embed.weight.shape == (7, 16)


def test_toy_copy_task_learns():
    torch.manual_seed(0)
    m = build_model(cfg(decoder_layers=1, pre_ln=True), V, PIECES)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(100):
        body = torch.randint(4, TAG0, (32, 5), generator=g)
        src = torch.cat([torch.full((32, 1), TAG0), body, torch.full((32, 1), 2)], 1)
        tgt_in = torch.cat([torch.full((32, 1), TAG0 + 1), body], 1)
        tgt_out = torch.cat([body, torch.full((32, 1), 2)], 1)
        loss, _, n = label_smoothed_ce(m(src, tgt_in), tgt_out, 0.0)
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
        losses.append((loss / n).item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 4.0  # ~ log(V) at the start
    assert last < 0.25 * first, (first, last)


@pytest.mark.parametrize("arch", ["msha", "moce", "byte_ncf"])
def test_other_architectures_take_the_charaware_embeddings(arch):
    kw = {
        "msha": {"conv": ConvConfig(kernels=[0, 1, 3, 5])},
        "moce": {"conv": ConvConfig(kernels=[0, 1, 3])},
        "byte_ncf": {"lobef": LobefConfig(byte_layers=1)},
    }[arch]
    m = make(arch=arch, **kw).eval()
    assert isinstance(m.embeddings, CharAwareEmbeddings)
    src, tgt, lens = batch()
    with torch.no_grad():
        full = m(src, tgt)
        inc = decode_all(m, src, tgt)
    assert full.shape == (3, 7, V)
    for i, n in enumerate(lens):
        torch.testing.assert_close(inc[i, :n], full[i, :n], atol=1e-5, rtol=0)


def test_other_embeddings_ignore_pieces():
    torch.manual_seed(0)
    a = build_model(cfg(embedding="learned"), V, PIECES)
    torch.manual_seed(0)
    b = build_model(cfg(embedding="learned"), V)
    assert count_parameters(a) == count_parameters(b)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"charaware": {"kernels": []}}, "model.charaware.kernels"),
        ({"charaware": {"kernels": [3, 0]}}, "model.charaware.kernels"),
        ({"charaware": {"kernels": [3, 3]}}, "model.charaware.kernels"),
        ({"charaware": {"kernels": "3,4"}}, "model.charaware.kernels"),
        ({"charaware": {"dim": 0}}, "model.charaware.dim"),
        ({"charaware": {"filters": -1}}, "model.charaware.filters"),
        ({"charaware": {"highway_layers": 1.5}}, "model.charaware.highway_layers"),
        ({"charaware": {"max_len": 0}}, "model.charaware.max_len"),
        ({"charaware": {"gate": "matrix"}}, "model.charaware.gate"),
        ({"embedding": "chars"}, "model.embedding"),
    ],
)
def test_bad_config_names_the_key(kw, key):
    with pytest.raises(ScaletrainError, match=key.replace(".", r"\.")):
        build_model(cfg(**kw), V, PIECES)


def test_missing_or_wrong_pieces():
    with pytest.raises(ScaletrainError, match=r"model\.embedding=charaware.*data\.tokenizer: spm"):
        build_model(cfg(), V)
    with pytest.raises(ScaletrainError, match=f"got {V - 1} pieces for a vocabulary of {V} ids"):
        build_model(cfg(), V, PIECES[:-1])
    with pytest.raises(ScaletrainError, match="must be strings"):
        build_model(cfg(), V, PIECES[:-1] + [None])
    with pytest.raises(ScaletrainError, match="no piece has any character"):
        build_model(cfg(), V, [""] * V)
