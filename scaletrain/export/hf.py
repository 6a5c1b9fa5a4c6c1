"""``scaletrain export --format hf``: a checkpoint of the byte Transformer as a Hugging Face
``MarianMTModel`` directory that ``transformers`` loads with ``AutoTokenizer`` /
``AutoModelForSeq2SeqLM`` alone (no scaletrain code).

Which models map (``marian_problems`` says why one does not, in one line):
    * ``model.arch: transformer`` with ``model.embedding: learned`` (no byte front-end, no
      convolutional attention, no MoCE, no one-hot or character-aware embeddings);
    * post-LN (``model.pre_ln: false``): Marian layers normalise after the residual, and have no
      final encoder/decoder LayerNorm;
    * shared embeddings (``model.share_embeddings: true``): Marian ties encoder input, decoder
      input and output projection to one matrix;
    * the byte vocabulary (``data.tokenizer: byte``).
  Of the bundled recipes, ``base`` and ``small`` map; ``embeddingless`` (one-hot), ``byte_ncf`` /
  ``byte_wsf`` (LOBEF front-ends), ``msc`` / ``msha`` / ``moce_*`` (convolutional attention),
  ``subword_base`` (SentencePiece) and ``subword_cg`` (character-aware) do not.

How our model becomes Marian (the details that make the logits equal):
    * weights: ``embeddings.weight`` -> ``model.shared.weight`` (tied to both embed_tokens and
      ``lm_head``); per layer q/k/v/out projections, fc1/fc2 and the three (two in the encoder)
      post-residual LayerNorms under Marian's names; ``final_logits_bias`` is zero (we have none);
    * embedding scale: ``scale_embedding`` = ``model.scale_embeddings`` (sqrt(d_model));
    * positions: both put sin in the first half and cos in the second, but our table is fairseq's
      (frequencies ``10000^(-i/(d/2-1))``, first real token at row 1, row 0 reserved for padding)
      while Marian computes ``10000^(-i/(d/2))`` from row 0. The export stores our rows 1..N as
      Marian's ``embed_positions.weight`` rows 0..N-1 (which ``from_pretrained`` loads). Marian's
      ``save_pretrained`` does not save that table and recomputes it with its own formula on the
      next load: re-save an exported model only with ``safe_serialization`` and the table, or
      export again (the model card says so);
    * language tags: our source is ``[__src__] + bytes + [EOS]`` and the decoder starts with the
      target tag (``scaletrain.data.batch``). The tokenizer reads the source tag from the text
      (``"__de__Guten Morgen"``) and appends ``</s>``; ``decoder_start_token_id`` is the target
      tag (the config holds ``__en__``'s, or the first language's; pass another to ``generate``);
    * decoding: ``generation_config.json`` suppresses what our decoder never emits (pad, bos, unk,
      language tags), forces EOS at the length limit (``forced_eos_token_id``) as ours does, and is
      greedy by default; greedy ``generate()`` then gives our greedy output token for token.

The tokenizer is a ``tokenizers`` JSON (``PreTrainedTokenizerFast``): a byte-level pre-tokenizer,
a BPE model without merges whose vocabulary maps each byte's character to id ``byte + 4``, the
specials ``<pad> <s> </s> <unk>`` at 0..3 and the language tags ``__xx__`` as special added tokens
from id 260 in manifest order (``scaletrain.vocab``).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from scaletrain.checkpoint import load_checkpoint_vocab, load_model_weights, resolve_checkpoint
from scaletrain.config import from_dict
from scaletrain.data.shards import load_manifest
from scaletrain.errors import ScaletrainError
from scaletrain.export.single_file import DTYPES
from scaletrain.fileio import default_mode
from scaletrain.models.transformer import sinusoidal_table
from scaletrain.vocab import BOS, BYTE_OFFSET, EOS, LANG_OFFSET, N_BYTES, PAD, SPECIALS, UNK

SPECIAL_NAMES = ("<pad>", "<s>", "</s>", "<unk>")  # ids PAD, BOS, EOS, UNK
MAPPING_RECIPES = ("base", "small")


def marian_problems(model_cfg, tokenizer: str = "byte") -> list[str]:
    """Why a model config does not map onto MarianMTModel ([] when it does)."""
    p = []
    if model_cfg.arch != "transformer":
        p.append(f"model.arch is {model_cfg.arch} (only the plain transformer maps)")
    if model_cfg.embedding != "learned":
        p.append(f"model.embedding is {model_cfg.embedding} (only learned embeddings map)")
    if model_cfg.pre_ln:
        p.append("model.pre_ln is true (Marian is post-LN)")
    if not model_cfg.share_embeddings:
        p.append("model.share_embeddings is false (Marian ties input and output embeddings)")
    if model_cfg.activation not in ("relu", "gelu"):
        p.append(f"model.activation is {model_cfg.activation}")
    if tokenizer != "byte":
        p.append(f"the vocabulary is {tokenizer} (only the byte vocabulary has an HF tokenizer here)")
    return p


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ``ByteLevel`` pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer(langs: list[str]):
    """The ``tokenizers.Tokenizer`` of the byte vocabulary with ``langs``' tags (ids as ``ByteVocab``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors  # export only

    assert SPECIALS[PAD] == "<pad>" and BYTE_OFFSET == len(SPECIAL_NAMES) and LANG_OFFSET == BYTE_OFFSET + N_BYTES
    table = _bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(SPECIAL_NAMES)}
    vocab.update({table[b]: BYTE_OFFSET + b for b in range(N_BYTES)})
    tags = [f"__{l}__" for l in langs]
    vocab.update({t: LANG_OFFSET + i for i, t in enumerate(tags)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_NAMES])
    # rstrip: "__de__ Hallo" and "__de__Hallo" give the same ids (sources never start with a space)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=True) for t in tags])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A $B </s>",
                                                       special_tokens=[("</s>", EOS)])
    for i, s in enumerate(SPECIAL_NAMES):
        assert tok.token_to_id(s) == i
    return tok


def marian_state_dict(sd: dict[str, torch.Tensor], model_cfg, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our Transformer's state dict under MarianMTModel's names (positions table included)."""
    out: dict[str, torch.Tensor] = {}
    used = set()

    def take(ours: str, theirs: str) -> None:
        if ours not in sd:
            raise ScaletrainError(f"checkpoint has no weight {ours!r}: not a plain byte Transformer")
        out[theirs] = sd[ours]
        used.add(ours)

    take("embeddings.weight", "model.shared.weight")
    attn = ("q_proj", "k_proj", "v_proj", "out_proj")

    def layer(a: str, b: str, norms: tuple[tuple[str, str], ...], cross: bool) -> None:
        """One encoder (``cross=False``) or decoder layer: attention, feed-forward, then its LayerNorms."""
        for p in ("weight", "bias"):
            for n in attn:
                take(f"{a}.self_attn.{n}.{p}", f"{b}.self_attn.{n}.{p}")
                if cross:
                    take(f"{a}.cross_attn.{n}.{p}", f"{b}.encoder_attn.{n}.{p}")
            take(f"{a}.ffn.fc1.{p}", f"{b}.fc1.{p}")
            take(f"{a}.ffn.fc2.{p}", f"{b}.fc2.{p}")
            for ours, theirs in norms:
                take(f"{a}.{ours}.norm.{p}", f"{b}.{theirs}.{p}")

    for i in range(model_cfg.encoder_layers):
        layer(f"encoder_layers.{i}", f"model.encoder.layers.{i}",
              (("attn_res", "self_attn_layer_norm"), ("ffn_res", "final_layer_norm")), cross=False)
    for i in range(model_cfg.decoder_layers):
        layer(f"decoder_layers.{i}", f"model.decoder.layers.{i}", (("self_res", "self_attn_layer_norm"),
              ("cross_res", "encoder_attn_layer_norm"), ("ffn_res", "final_layer_norm")), cross=True)
    left = sorted(k for k in sd if k not in used and not k.endswith("_float_tensor"))
    if left:
        raise ScaletrainError(f"checkpoint weights with no Marian counterpart: {', '.join(left[:5])}")
    pos = sinusoidal_table(model_cfg.max_positions + 1, model_cfg.d_model)[1:]
    out["model.encoder.embed_positions.weight"] = pos
    out["model.decoder.embed_positions.weight"] = pos.clone()
    out["final_logits_bias"] = torch.zeros(1, sd["embeddings.weight"].shape[0])
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in out.items()}


def default_target(langs: list[str]) -> str:
    return "en" if "en" in langs else langs[0]


def marian_config(model_cfg, vocab_size: int, langs: list[str]) -> dict:
    """MarianConfig keyword arguments for our model config."""
    return dict(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, max_position_embeddings=model_cfg.max_positions,
        d_model=model_cfg.d_model, encoder_layers=model_cfg.encoder_layers, decoder_layers=model_cfg.decoder_layers,
        encoder_attention_heads=model_cfg.n_heads, decoder_attention_heads=model_cfg.n_heads,
        encoder_ffn_dim=model_cfg.ffn_dim, decoder_ffn_dim=model_cfg.ffn_dim,
        activation_function=model_cfg.activation, dropout=model_cfg.dropout,
        attention_dropout=model_cfg.attention_dropout, activation_dropout=model_cfg.activation_dropout,
        scale_embedding=bool(model_cfg.scale_embeddings), share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        decoder_start_token_id=LANG_OFFSET + langs.index(default_target(langs)), forced_eos_token_id=EOS,
        architectures=["MarianMTModel"],
    )


def generation_config(model_cfg, langs: list[str]) -> dict:
    suppress = [PAD, BOS, UNK] + [LANG_OFFSET + i for i in range(len(langs))]
    return dict(
        decoder_start_token_id=LANG_OFFSET + langs.index(default_target(langs)), eos_token_id=EOS,
        pad_token_id=PAD, bos_token_id=BOS, forced_eos_token_id=EOS, suppress_tokens=suppress,
        max_length=model_cfg.max_positions + 1, num_beams=1, do_sample=False,
    )


def _metrics_section(eval_json: str | Path | None) -> str:
    if eval_json is None:
        return ("No evaluation was attached (`scaletrain export --format hf --eval-json FILE` takes the JSON "
                "`scaletrain evaluate` writes to `RUN/eval/<name>/eval.json`, or to `--json FILE`).\n")
    try:
        r = json.loads(Path(eval_json).read_text(encoding="utf-8"))
        m = r["model"]
        rows = m["directions"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ScaletrainError(f"--eval-json {eval_json}: not a `scaletrain evaluate --json` report ({e})") from None
    named = f"Evaluation `{r['name']}`: " if r.get("name") else ""
    lines = [f"{named}Split `{r.get('split')}` of `{r.get('shards')}`, {r.get('lines')} lines, beam {r.get('beam')}, "
             f"length penalty {r.get('lenpen')}, checkpoint step {r.get('step')} (scored with the scaletrain model; "
             "sacrebleu " + str(m.get("sacrebleu_version")) + ").", "",
             "| direction | lines | BLEU | chrF | BLEU tokenizer |", "|---|---:|---:|---:|---|"]
    for d in rows:
        b = "n/a" if d.get("bleu") is None else f"{d['bleu']:.2f}"
        c = "n/a" if d.get("chrf") is None else f"{d['chrf']:.2f}"
        lines.append(f"| {d['direction']} | {d.get('n_lines')} | {b} | {c} | {d.get('tokenize')} |")
    lines += ["", "sacrebleu signatures:", ""]
    lines += [f"- {k}: `{v}`" for k, v in sorted((m.get("signatures") or {}).items())]
    return "\n".join(lines) + "\n"


def model_card(cfg, langs: list[str], step, ckpt: Path, eval_json=None) -> str:
    mc = cfg.model
    src_tag = f"__{langs[1] if len(langs) > 1 and langs[0] == default_target(langs) else langs[0]}__"
    tgt = default_target(langs)
    data = cfg.data.shards
    source = ""
    try:
        m = load_manifest(data)
        t = m.source.get("type") if isinstance(m.source, dict) else None
        dirs = ", ".join(m.splits["train"].directions) if "train" in m.splits else ""
        source = f" (source: {t}; training directions: {dirs})" if t else ""
    except Exception:  # the shards need not be on this machine
        pass
    return f"""---
language: [{', '.join(langs)}]
library_name: transformers
pipeline_tag: translation
tags: [translation, byte-level, marian, scaletrain]
---

# Byte-level multilingual translation model (scaletrain export)

A byte-level Transformer trained with scaletrain and exported as a `MarianMTModel`: it loads with
`transformers` alone. Checkpoint: `{ckpt.name}` (step {step}).

## Model

- Transformer encoder-decoder, post-LN, {mc.encoder_layers} encoder / {mc.decoder_layers} decoder layers,
  d_model {mc.d_model}, {mc.n_heads} heads, feed-forward {mc.ffn_dim} ({mc.activation}), embeddings shared
  and scaled by sqrt(d_model), sinusoidal positions (scaletrain's table, stored in the weights).
- Vocabulary: ids 0-3 `<pad> <s> </s> <unk>`, 4-259 the 256 byte values, then the language tags
  {', '.join(f'`__{l}__`' for l in langs)} (ids {LANG_OFFSET}-{LANG_OFFSET + len(langs) - 1}).
- Languages: {', '.join(langs)}.

## Data

Trained on the shard directory `{data}`{source}.

## Usage

The source text starts with its language tag; the target language is the decoder's first token:

```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("THIS_DIR")
model = AutoModelForSeq2SeqLM.from_pretrained("THIS_DIR")
x = tok(["{src_tag}..."], return_tensors="pt")
y = model.generate(**x, decoder_start_token_id=tok.convert_tokens_to_ids("__{tgt}__"), max_new_tokens=256)
print(tok.batch_decode(y, skip_special_tokens=True))
```

Greedy `generate()` reproduces scaletrain's greedy decoding token for token (the generation config
suppresses pad, bos, unk and the language tags and forces `</s>` at the length limit; scaletrain's
length limit `max_len_a * source_bytes + max_len_b` is yours to pass as `max_new_tokens`).

Caveat: Marian does not save its position table with `save_pretrained` and recomputes it with its own
formula when loading a directory without it. This export stores scaletrain's table in
`model.safetensors`; keep that file (re-export rather than re-save) or the positions change.

## Metrics

{_metrics_section(eval_json)}"""


def export_hf(ckpt: str | Path, out: str | Path, dtype: str = "fp32", eval_json=None, overwrite: bool = False) -> Path:
    """Write a MarianMTModel directory for the checkpoint ``ckpt`` to ``out`` (see the module doc)."""
    from transformers import GenerationConfig, MarianConfig  # heavy: loaded only when exporting

    if dtype not in DTYPES:
        raise ScaletrainError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ck = resolve_checkpoint(ckpt)
    cfg = from_dict(yaml.safe_load((ck / "config.yaml").read_text()))
    langs = json.loads((ck / "langs.json").read_text())
    vocab = load_checkpoint_vocab(ck, langs)
    problems = marian_problems(cfg.model, getattr(vocab, "kind", "byte"))
    if problems:
        raise ScaletrainError(f"{ck}: --format hf exports the byte Transformer that maps onto MarianMTModel "
                              f"(recipes {', '.join(MAPPING_RECIPES)}); this model does not: {'; '.join(problems)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ScaletrainError(f"--out {out} exists and is not empty; choose another directory or pass --overwrite")
    sd = {k: v for k, v in load_model_weights(ck).items()}
    hf_sd = marian_state_dict(sd, cfg.model, DTYPES[dtype])
    state = json.loads((ck / "trainer_state.json").read_text()) if (ck / "trainer_state.json").is_file() else {}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(hf_sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        MarianConfig(**marian_config(cfg.model, vocab.size, langs)).save_pretrained(tmp)
        GenerationConfig(**generation_config(cfg.model, langs)).save_pretrained(tmp)
        byte_tokenizer(langs).save(str(tmp / "tokenizer.json"))
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": cfg.model.max_positions,
                   "clean_up_tokenization_spaces": False,
                   "additional_special_tokens": [f"__{l}__" for l in langs]}
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
        (tmp / "special_tokens_map.json").write_text(json.dumps(
            {k: tok_cfg[k] for k in ("pad_token", "bos_token", "eos_token", "unk_token", "additional_special_tokens")},
            indent=1))
        (tmp / "README.md").write_text(model_card(cfg, langs, state.get("step"), ck, eval_json), encoding="utf-8")
        default_mode(tmp)  # safetensors writes its file 0600: every file gets the mode open() gives (0644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

