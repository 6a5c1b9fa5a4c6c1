"""`scaletrain export --format hf`: a briefly trained tiny byte Transformer (the `small` recipe's
architecture) exported as a MarianMTModel, loaded with transformers' Auto classes alone: the
tokenizer gives our source ids, the logits equal ours on real test lines (fp32), greedy
`generate()` equals our greedy decoding, and models that do not map are refused in one line."""
from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import ROOT, tiny_model  # noqa: E402
from scaletrain.config import dump_yaml, load_config  # noqa: E402
from scaletrain.data.batch import collate  # noqa: E402
from scaletrain.data.shards import load_manifest, read_split  # noqa: E402
from scaletrain.errors import ScaletrainError  # noqa: E402
from scaletrain.eval.generate import generate  # noqa: E402
from scaletrain.models import build_model  # noqa: E402
from scaletrain.vocab import EOS, LANG_OFFSET, PAD, ByteVocab  # noqa: E402

TINY = [*tiny_model(n_heads=4, layers=2, max_positions=160), "data.max_bytes=120"]


def save_checkpoint(path, cfg, model, langs, step=40):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.yaml").write_text(dump_yaml(cfg))
    (path / "langs.json").write_text(json.dumps(langs))
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))


@pytest.fixture(scope="module")
def trained(django_shards, tmp_path_factory):
    """A checkpoint dir of a tiny `small`-architecture model trained 40 steps on real train lines."""
    torch.manual_seed(0)
    cfg = load_config("small", [*TINY, f"data.shards={django_shards}"])
    langs = load_manifest(django_shards).languages
    vocab = ByteVocab(langs)
    model = build_model(cfg.model, vocab.size)
    train = [e for e in read_split(django_shards, "train") if len(e.src) < 40 and len(e.tgt) < 40][:256]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(40):
        b = collate(train[(step * 32) % 256:][:32])
        logits = model(b.src, b.tgt_in)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    ck = tmp_path_factory.mktemp("ck") / "step-0000040"
    save_checkpoint(ck, cfg, model, langs)
    return ck, model, langs


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    ck, _, _ = trained
    out = tmp_path_factory.mktemp("hf") / "model"
    p = subprocess.run([sys.executable, "-m", "scaletrain", "export", str(ck), "--format", "hf", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return out


def test_tokenizer_gives_our_ids(exported, django_shards):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(exported))
    langs = load_manifest(django_shards).languages
    exs = read_split(django_shards, "test")[:40]
    b = collate(exs)
    for i, e in enumerate(exs):
        text = f"__{langs[e.src_lang]}__" + e.src.decode("utf-8")
        ids = tok(text)["input_ids"]
        assert ids == [t for t in b.src[i].tolist() if t != PAD]
        assert tok.decode(ids, skip_special_tokens=True) == e.src.decode("utf-8")
    assert tok.convert_tokens_to_ids("__en__") == LANG_OFFSET + langs.index("en")
    assert tok.pad_token_id == PAD and tok.eos_token_id == EOS


def test_logits_equal(trained, exported, django_shards):
    from transformers import AutoModelForSeq2SeqLM

    _, ours, _ = trained
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(exported)).eval()
    assert type(hf).__name__ == "MarianMTModel"
    b = collate([e for e in read_split(django_shards, "test") if max(len(e.src), len(e.tgt)) < 150][:48])
    with torch.no_grad():
        a = ours(b.src, b.tgt_in)
        h = hf(input_ids=b.src, attention_mask=b.src.ne(PAD), decoder_input_ids=b.tgt_in).logits
    real = b.tgt_in.ne(PAD)
    assert a.shape == h.shape
    torch.testing.assert_close(h[real], a[real], rtol=1e-4, atol=1e-4)


def test_bf16_export_logits(trained, django_shards, tmp_path):
    """--dtype bf16 stores bf16 weights (and position table); loaded back in fp32 the logits equal
    ours run with the same bf16-rounded values (fp32 tolerance), and are within bf16 rounding of the
    fp32 model's."""
    import copy

    from transformers import AutoModelForSeq2SeqLM

    from scaletrain.export import export_hf

    ck, ours, _ = trained
    out = export_hf(ck, tmp_path / "hf16", dtype="bf16")
    from safetensors.torch import load_file

    assert load_file(str(out / "model.safetensors"))["model.shared.weight"].dtype == torch.bfloat16
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(out), dtype=torch.float32).eval()
    rounded = copy.deepcopy(ours)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        t = rounded.positions.table  # the stored position table is bf16 too
        t.copy_(t.to(torch.bfloat16).float())
    b = collate([e for e in read_split(django_shards, "test") if max(len(e.src), len(e.tgt)) < 150][:32])
    real = b.tgt_in.ne(PAD)
    with torch.no_grad():
        h = hf(input_ids=b.src, attention_mask=b.src.ne(PAD), decoder_input_ids=b.tgt_in).logits[real]
        torch.testing.assert_close(h, rounded(b.src, b.tgt_in)[real], rtol=1e-4, atol=1e-4)
        a = ours(b.src, b.tgt_in)[real]
    assert (h - a).abs().max() < 0.05 * a.abs().max()


def test_greedy_generate_equals_ours(trained, exported, django_shards):
    _, ours, langs = trained
    assert_same_greedy(ours, exported, django_shards, langs)


def test_greedy_suppresses_what_ours_never_emits(trained, django_shards, tmp_path):
    """Our decoder never emits pad/bos/unk/tags; a model whose raw argmax is often <unk> must still
    decode the same through HF (generation_config.suppress_tokens)."""
    import copy

    from scaletrain.export import export_hf

    _, ours, langs = trained
    m = copy.deepcopy(ours)
    with torch.no_grad():
        w = m.embeddings.weight
        w[3] = 2.0 * w[4 + ord("e")]  # <unk> (never an input) scores twice 'e'
    b = collate(read_split(django_shards, "test")[:8])
    with torch.no_grad():
        assert (m(b.src, b.tgt_in).argmax(-1) == 3).any()  # the raw argmax does pick <unk>
    cfg = load_config("small", [*TINY, f"data.shards={django_shards}"])
    save_checkpoint(tmp_path / "ck", cfg, m, langs)
    export_hf(tmp_path / "ck", tmp_path / "hf")
    assert_same_greedy(m, tmp_path / "hf", django_shards, langs, check_eos=False)


def assert_same_greedy(ours, exported, django_shards, langs, check_eos=True):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(exported))
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(exported)).eval()
    exs = [e for e in read_split(django_shards, "test") if len(e.src) < 60][:24]
    max_len = 30
    by_tgt: dict[int, list] = {}
    for e in exs:
        by_tgt.setdefault(e.tgt_lang, []).append(e)
    n_eos = 0
    for tgt, group in by_tgt.items():
        b = collate(group)
        mine = generate(ours, b.src, LANG_OFFSET + tgt, beam=1, max_len_a=0.0, max_len_b=max_len)
        enc = tok([f"__{langs[e.src_lang]}__" + e.src.decode() for e in group], return_tensors="pt", padding=True)
        with torch.no_grad():
            y = hf.generate(**enc, decoder_start_token_id=LANG_OFFSET + tgt, max_new_tokens=max_len + 1)
        for row, m in zip(y.tolist(), mine):
            assert row[0] == LANG_OFFSET + tgt
            got = row[1:]
            assert EOS in got  # forced at the limit like ours
            got = got[: got.index(EOS)]
            n_eos += len(got) < max_len
            assert got == m
            assert tok.decode(got, skip_special_tokens=True) == ByteVocab(langs).decode(m)
    if check_eos:
        assert n_eos > 0  # the trained model stops by itself on some lines, not only at the limit


def test_model_card_and_files(exported, trained):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "README.md"} <= names
    card = (exported / "README.md").read_text()
    _, _, langs = trained
    assert "MarianMTModel" in card and all(f"__{l}__" in card for l in langs)
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["model_type"] == "marian" and cfg["scale_embedding"] is True
    # every file gets the mode a plain open() gives under the umask (safetensors alone would write 0600)
    from scaletrain.fileio import umask

    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in exported.iterdir()}
    assert modes == {name: 0o666 & ~umask() for name in modes} and modes["model.safetensors"] & 0o044 == 0o044 & ~umask()


def test_model_card_shows_the_evaluation(trained, tmp_path):
    from scaletrain.eval.evaluate import evaluate_checkpoint, result_to_json
    from scaletrain.export import export_hf

    ck, _, langs = trained
    res = result_to_json(evaluate_checkpoint(ck, split="test", beam=1, max_lines=2, progress=False))
    (tmp_path / "ev.json").write_text(json.dumps(res))
    out = export_hf(ck, tmp_path / "hf", eval_json=tmp_path / "ev.json")
    card = (out / "README.md").read_text()
    assert f"Evaluation `{res['name']}`" in card and res["name"].startswith("test.first2.beam1.")
    for d in res["model"]["directions"]:
        assert f"| {d['direction']} | {d['n_lines']} |" in card
    for sig in res["model"]["signatures"].values():
        assert sig in card
    assert "Split `test`" in card
    with pytest.raises(ScaletrainError, match="not a `scaletrain evaluate --json` report"):
        (tmp_path / "bad.json").write_text("{}")
        export_hf(ck, tmp_path / "hf2", eval_json=tmp_path / "bad.json")


def test_refuses_models_that_do_not_map(django_shards, tmp_path):
    from scaletrain.export import export_hf

    for over, why in ((["model.pre_ln=true"], "pre_ln"), (["model.share_embeddings=false"], "share_embeddings"),
                      (["model.arch=msc", "model.conv.kernels=[0,1,3,5]"], "model.arch is msc")):
        cfg = load_config("small", [*TINY, f"data.shards={django_shards}", *over])
        langs = load_manifest(django_shards).languages
        model = build_model(cfg.model, ByteVocab(langs).size)
        ck = tmp_path / why.replace(" ", "_") / "step-0000001"
        save_checkpoint(ck, cfg, model, langs, step=1)
        with pytest.raises(ScaletrainError) as ei:
            export_hf(ck, tmp_path / "o")
        msg = str(ei.value)
        assert why in msg and "\n" not in msg and "base, small" in msg
        assert not (tmp_path / "o").exists()
