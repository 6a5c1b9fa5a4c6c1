"""``scaletrain export --format ct2``: the Hugging Face export (``scaletrain.export.hf``) converted to
CTranslate2 with CTranslate2's own ``TransformersConverter``.

CTranslate2's stock loader for ``MarianConfig`` assumes two conventions of models converted from
Marian-NMT that ours do not share: the decoder starts from a zero embedding (ours starts from the
target-language tag's embedding) and the vocabulary ends with an extra ``<pad>`` row that it drops
(our last row is a language tag). The conversion therefore runs the converter with a loader that
is the stock BART/Marian loader (``BartLoader``: post-LN layers, no embedding LayerNorm, the stored
position table, fused q/k/v) minus those two conventions, and with ``decoder_start_token = None``:
decoding starts from the target prefix, i.e. the target tag, as in scaletrain. Nothing else in the
conversion is ours; the converted directory loads with ``ctranslate2.Translator`` alone.

Translating (``translate_ct2`` does this): tokens are the HF tokenizer's (``convert_ids_to_tokens``
of the source with its tag and ``</s>``); ``target_prefix=[["__en__"]]``; ``SUPPRESS`` lists what
our decoder never emits (pad, bos, language tags; ``disable_unk``). Greedy output then equals ours
(``tests/integration/test_export_ct2.py``).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from scaletrain.errors import ScaletrainError
from scaletrain.export.hf import export_hf
from scaletrain.fileio import default_mode
from scaletrain.vocab import LANG_OFFSET

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "README.md"]


def _ct2():
    try:
        import ctranslate2
        import ctranslate2.converters.transformers as ct2t
    except ImportError:
        raise ScaletrainError("--format ct2 needs CTranslate2: pip install ctranslate2 "
                              "(or pip install 'scaletrain[ct2]')") from None
    return ctranslate2, ct2t


@contextlib.contextmanager
def _byte_marian_loader():
    """Register, for the duration of a conversion, the loader described in the module doc."""
    _, ct2t = _ct2()

    class ByteMarianLoader(ct2t.BartLoader):
        @property
        def architecture_name(self):
            return "MarianMTModel"

        def get_model_spec(self, model):
            model.config.normalize_before = False  # post-LN
            model.config.normalize_embedding = False  # no LayerNorm on the embeddings
            return super().get_model_spec(model)

        def set_config(self, config, model, tokenizer):
            super().set_config(config, model, tokenizer)
            config.decoder_start_token = None  # the target prefix (the target tag) starts decoding

    old = ct2t._MODEL_LOADERS.get("MarianConfig")
    ct2t._MODEL_LOADERS["MarianConfig"] = ByteMarianLoader()
    try:
        yield
    finally:
        if old is None:
            ct2t._MODEL_LOADERS.pop("MarianConfig", None)
        else:
            ct2t._MODEL_LOADERS["MarianConfig"] = old


def convert_hf_dir(hf_dir: str | Path, out: str | Path, quantization: str | None = None, force: bool = False) -> Path:
    """Convert a ``scaletrain export --format hf`` directory to a CTranslate2 model directory."""
    _, ct2t = _ct2()
    hf_dir = Path(hf_dir)
    with _byte_marian_loader():
        conv = ct2t.TransformersConverter(str(hf_dir), copy_files=[f for f in TOKENIZER_FILES
                                                                   if (hf_dir / f).is_file()])
        conv.convert(str(out), quantization=quantization, force=force)
    return Path(out)


def export_ct2(ckpt: str | Path, out: str | Path, *, quantization: str | None = None, eval_json=None,
               overwrite: bool = False) -> Path:
    """Checkpoint -> HF export (temporary) -> CTranslate2 directory ``out``."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ScaletrainError(f"--out {out} exists and is not empty; choose another directory or pass --overwrite")
    _ct2()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        hf = export_hf(ckpt, Path(tmp) / "hf", eval_json=eval_json)
        conv = convert_hf_dir(hf, Path(tmp) / "ct2", quantization=quantization)
        default_mode(conv)
        if out.exists():
            shutil.rmtree(out)
        os.replace(conv, out)
    return out


def suppressed_tokens(tokenizer) -> list[list[str]]:
    """What our decoder never emits, as CTranslate2 ``suppress_sequences`` (pad, bos, language tags)."""
    tags = [t for t, i in sorted(tokenizer.get_vocab().items(), key=lambda x: x[1]) if i >= LANG_OFFSET]
    return [[tokenizer.pad_token], [tokenizer.bos_token], *[[t] for t in tags]]


def translate_ct2(translator, tokenizer, texts: list[str], src_lang: str, tgt_lang: str, *, max_len: int = 256,
                  beam: int = 1, batch_size: int = 64) -> list[list[int]]:
    """Greedy (``beam=1``) CTranslate2 translation of ``texts``; returns the generated ids per line
    (no tag, no EOS), as ``scaletrain.eval.generate.generate`` does. ``max_len`` bytes at most."""
    src = [tokenizer.convert_ids_to_tokens(tokenizer(f"__{src_lang}__" + t)["input_ids"]) for t in texts]
    res = translator.translate_batch(
        src, target_prefix=[[f"__{tgt_lang}__"]] * len(src), beam_size=beam, max_decoding_length=max_len,
        suppress_sequences=suppressed_tokens(tokenizer), disable_unk=True, max_batch_size=batch_size,
        return_end_token=False, min_decoding_length=0, max_input_length=0,
    )
    out = []
    for r in res:
        toks = r.hypotheses[0]
        if toks and toks[0] == f"__{tgt_lang}__":
            toks = toks[1:]
        out.append(tokenizer.convert_tokens_to_ids(toks))
    return out
