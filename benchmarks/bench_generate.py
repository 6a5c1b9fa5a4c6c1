"""Beam-search speed: scaletrain.eval.generate vs Hugging Face transformers generate(), same size, same lengths.

    python benchmarks/bench_generate.py [--beam 4] [--batch 16] [--src-bytes 40] [--out-len 48] [--reps 3]

Both sides are encoder-decoder Transformers of the same dimensions (default: the `small` recipe - d 256,
4 heads, FFN 1024, 3+3 layers, post-LN, tied embeddings, vocab = bytes + specials + 15 language tags) with
random weights, decoding the same random byte sources with beam search. Output lengths are forced equal:
EOS is forbidden until exactly ``--out-len`` decoder steps have run (ours: min_len = max_len =
out_len - 1 bytes, then the forced EOS; HF: min_new_tokens = max_new_tokens = out_len), so both run the
same number of decoder steps over the same number of beams. The HF model is MarianMTModel (post-LN,
sinusoidal positions, tied embeddings: the closest HF architecture to ours), with its KV cache.

Ours runs twice per round: without and with the bounds ``evaluate``, ``translate`` and the in-training BLEU
decode with (``stop_invalid_utf8`` and per-row length limits, as ``translate_examples`` passes them). So that
both do the same work, our model's logits are restricted to ASCII bytes (one added mask per step, in both
runs): every hypothesis stays valid UTF-8 and the guard never cuts one, as with a trained model.

Prints sentences/s of each (median of --reps interleaved rounds, after a warm-up) and the RATIO ours/HF:
the median and range of the per-round ratios (each round runs all of them back to back), by wall clock
and by CPU time of this process (single-threaded runs: on a machine shared with other jobs the CPU time is
the steadier measure, as the wall clock also counts the time other processes held the core).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def build_ours(args, vocab_size):
    from scaletrain.models import ModelConfig, build_model

    torch.manual_seed(0)
    cfg = ModelConfig(arch="transformer", d_model=args.d_model, n_heads=args.heads, encoder_layers=args.layers,
                      decoder_layers=args.layers, ffn_dim=args.ffn, dropout=0.0, max_positions=512)
    return build_model(cfg, vocab_size).eval()


def build_hf(args, vocab_size):
    from transformers import MarianConfig, MarianMTModel

    from scaletrain.vocab import BOS, EOS, PAD

    torch.manual_seed(0)
    cfg = MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=args.d_model, encoder_layers=args.layers,
        decoder_layers=args.layers, encoder_attention_heads=args.heads, decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn, decoder_ffn_dim=args.ffn, activation_function="relu", dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=512, scale_embedding=True,
        pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=BOS, forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )
    return MarianMTModel(cfg).eval()


class AsciiOnly(nn.Module):
    """``model`` with the logits of bytes >= 0x80 at -inf: a random model that writes valid UTF-8 only."""

    def __init__(self, model, vocab_size: int):
        super().__init__()
        from scaletrain.vocab import BYTE_OFFSET

        self.inner, self.cfg = model, model.cfg
        mask = torch.zeros(vocab_size)
        mask[BYTE_OFFSET + 0x80: BYTE_OFFSET + 0x100] = -float("inf")
        self.register_buffer("mask", mask)

    def encode(self, src):
        return self.inner.encode(src)

    def decode_step(self, tokens, step, enc, cache):
        logits, cache = self.inner.decode_step(tokens, step, enc, cache)
        return logits + self.mask.to(logits.dtype), cache

    def reorder_cache(self, cache, index):
        return self.inner.reorder_cache(cache, index)


def n_params(m) -> int:
    return sum(p.numel() for p in m.parameters())


def timeit_interleaved(fns, reps):
    """Wall-clock and CPU seconds of every run of each function, runs interleaved (a, b, a, b, ...) after
    one warm-up each, so a noisy neighbour slows both sides alike: ``wall[i][r]`` and ``cpu[i][r]`` are
    function i in round r."""
    outs = [fn() for fn in fns]  # warm-up
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            outs[i] = fn()
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)
    return wall, cpu, outs


def ratio_line(name: str, base: list[float], ours: list[float]) -> str:
    """The median and range of the per-round ratios base/ours (both runs of a round were adjacent in time)."""
    r = sorted(b / o for b, o in zip(base, ours))
    return f"RATIO {name} per round: median {statistics.median(r):.2f} [{r[0]:.2f}-{r[-1]:.2f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="sentences per generate call")
    ap.add_argument("--src-bytes", type=int, default=40)
    ap.add_argument("--out-len", type=int, default=48, help="decoder steps per sentence (EOS included)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from scaletrain.eval import generate as G
    from scaletrain.prepare.gettext import DEFAULT_LANGS
    from scaletrain.vocab import BYTE_OFFSET, EOS, PAD, ByteVocab

    vocab = ByteVocab(["en", *DEFAULT_LANGS])
    V = vocab.size
    dev = torch.device(args.device)
    ours = build_ours(args, V).to(dev)
    hf = build_hf(args, V).to(dev)

    g = torch.Generator().manual_seed(1)
    B, S = args.batch, args.src_bytes
    body = torch.randint(BYTE_OFFSET + 97, BYTE_OFFSET + 123, (B, S), generator=g)
    src = torch.cat([torch.full((B, 1), vocab.lang_id("en")), body, torch.full((B, 1), EOS)], 1).to(dev)
    tags = torch.full((B,), vocab.lang_id("de"), device=dev)
    hf_src = torch.cat([body, torch.full((B, 1), EOS)], 1).to(dev)  # Marian: no source tag
    L = args.out_len

    ascii_only = AsciiOnly(ours, V).to(dev)
    limits = torch.full((B,), L - 1)  # per-row limits, as translate_examples passes its length-ratio bounds

    def run_ours(bounds: bool):
        extra = dict(stop_invalid_utf8=True, row_limits=limits) if bounds else {}
        return G.generate_with_scores(ascii_only, src, tags, beam=args.beam, lenpen=1.0, max_len_a=0,
                                      max_len_b=L - 1, min_len=L - 1, **extra)

    def run_hf():
        with torch.inference_mode():
            return hf.generate(
                input_ids=hf_src, attention_mask=hf_src.ne(PAD), num_beams=args.beam, num_return_sequences=1,
                max_new_tokens=L, min_new_tokens=L, do_sample=False, length_penalty=1.0, early_stopping=False,
                use_cache=True,
            )

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    wall, cpu, (out_off, out_on, out_hf) = timeit_interleaved(
        [lambda: (run_ours(False), sync())[0], lambda: (run_ours(True), sync())[0], lambda: (run_hf(), sync())[0]],
        args.reps)
    # same amount of work: every hypothesis has the forced length on every side, and the bounds change nothing
    assert all(len(h.tokens) == L - 1 and not h.cut for h in out_off + out_on), [len(h.tokens) for h in out_on]
    assert [(h.tokens, h.score) for h in out_on] == [(h.tokens, h.score) for h in out_off]
    assert out_hf.shape[1] == L + 1, out_hf.shape  # decoder start + L generated tokens
    print(f"device {dev}, torch threads {torch.get_num_threads()}, beam {args.beam}, batch {B}, "
          f"src {S} bytes, {L} decoder steps per sentence, median of {args.reps} interleaved rounds")
    print(f"params: scaletrain {n_params(ours):,}  HF Marian {n_params(hf):,}")
    print(f"{'decoder':<34}{'seconds':>9}{'CPU s':>9}{'sentences/s':>13}{'ratio':>7}{'CPU ratio':>11}")
    names = ["scaletrain.eval.generate", "scaletrain, decoding bounds on", "HF transformers generate()"]
    t_hf, c_hf = statistics.median(wall[2]), statistics.median(cpu[2])
    for name, w, c in [(names[2], wall[2], cpu[2]), *zip(names[:2], wall[:2], cpu[:2])]:
        t, ct = statistics.median(w), statistics.median(c)
        print(f"{name:<34}{t:>9.3f}{ct:>9.3f}{B / t:>13.1f}{t_hf / t:>7.2f}{c_hf / ct:>11.2f}")
    print(ratio_line("ours/HF", wall[2], wall[0]))
    print(ratio_line("ours with bounds/HF", wall[2], wall[1]))
    print(ratio_line("ours/HF (CPU time)", cpu[2], cpu[0]))
    print(ratio_line("ours with bounds/HF (CPU time)", cpu[2], cpu[1]))
    print(ratio_line("time with bounds / without (CPU time)", cpu[1], cpu[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
