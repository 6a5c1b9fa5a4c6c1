"""Beam-search speed: scaletrain.eval.generate vs Hugging Face transformers generate(), same size, same lengths.

    python benchmarks/bench_generate.py [--beam 4] [--batch 16] [--src-bytes 40] [--out-len 48] [--reps 3]

Both sides are encoder-decoder Transformers of the same dimensions (default: the `small` recipe - d 256,
4 heads, FFN 1024, 3+3 layers, post-LN, tied embeddings, vocab = bytes + specials + 15 language tags) with
random weights, decoding the same random byte sources with beam search. Output lengths are forced equal:
EOS is forbidden until exactly ``--out-len`` decoder steps have run (ours: min_len = max_len =
out_len - 1 bytes, then the forced EOS; HF: min_new_tokens = max_new_tokens = out_len), so both run the
same number of decoder steps over the same number of beams. The HF model is MarianMTModel (post-LN,
sinusoidal positions, tied embeddings: the closest HF architecture to ours), with its KV cache.

Prints sentences/s of each (median of --reps interleaved rounds, after a warm-up) and the RATIO ours/HF:
the median and range of the per-round ratios (each round runs both back to back).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


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


def n_params(m) -> int:
    return sum(p.numel() for p in m.parameters())


def timeit_interleaved(fns, reps):
    """Seconds of every run of each function, runs interleaved (a, b, a, b, ...) after one warm-up each,
    so a noisy neighbour slows both sides alike: ``times[i][r]`` is function i in round r."""
    outs = [fn() for fn in fns]  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - t0)
    return times, outs


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

    def run_ours():
        return G.generate(ours, src, tags, beam=args.beam, lenpen=1.0, max_len_a=0, max_len_b=L - 1, min_len=L - 1)

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

    (ts_ours, ts_hf), (out_ours, out_hf) = timeit_interleaved(
        [lambda: (run_ours(), sync())[0], lambda: (run_hf(), sync())[0]], args.reps)
    # same amount of work: every hypothesis has the forced length on both sides
    assert all(len(o) == L - 1 for o in out_ours), [len(o) for o in out_ours]
    assert out_hf.shape[1] == L + 1, out_hf.shape  # decoder start + L generated tokens
    t_ours, t_hf = statistics.median(ts_ours), statistics.median(ts_hf)
    ratios = sorted(h / o for o, h in zip(ts_ours, ts_hf))  # per round: the two runs were adjacent in time
    print(f"device {dev}, torch threads {torch.get_num_threads()}, beam {args.beam}, batch {B}, "
          f"src {S} bytes, {L} decoder steps per sentence, median of {args.reps} interleaved rounds")
    print(f"params: scaletrain {n_params(ours):,}  HF Marian {n_params(hf):,}")
    print(f"{'decoder':<28}{'seconds':>10}{'sentences/s':>14}{'ratio':>8}")
    print(f"{'HF transformers generate()':<28}{t_hf:>10.3f}{B / t_hf:>14.1f}{1.0:>8.2f}")
    print(f"{'scaletrain.eval.generate':<28}{t_ours:>10.3f}{B / t_ours:>14.1f}{t_hf / t_ours:>8.2f}")
    print(f"RATIO ours/HF per round: median {statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
