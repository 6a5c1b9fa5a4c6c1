"""CTranslate2 against our `translate` path: greedy decoding of real test lines on the CPU.

A model with the `small` recipe's architecture (random weights: every line decodes to the length
limit, so both sides do the same amount of work) is exported with `scaletrain export --format ct2`
(float32, and int8 with `--quantization int8`); the django test lines into English (sources under
180 bytes) are decoded greedily with at most ``--max-len`` bytes each by
``scaletrain.eval.requests.translate_examples`` (what `translate` / `evaluate` use) and by
``ctranslate2.Translator`` (``scaletrain.export.translate_ct2``), each on one thread. Printed:
seconds per side and CTranslate2's speed-up.

    OMP_NUM_THREADS=1 python benchmarks/bench_ct2.py --workdir /tmp/bench_ct2
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/bench_ct2")
    ap.add_argument("--lines", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=64)
    args = ap.parse_args()

    import ctranslate2
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from scaletrain.config import dump_yaml, load_config
    from scaletrain.export import export_ct2, translate_ct2
    from scaletrain.prepare import prepare_gettext
    from scaletrain.data.shards import read_split
    from scaletrain.eval.requests import translate_examples
    from scaletrain.models import build_model
    from scaletrain.vocab import ByteVocab

    torch.set_num_threads(1)
    root = Path(args.workdir)
    shutil.rmtree(root, ignore_errors=True)
    m = prepare_gettext(langs=["de", "ru", "ar", "hi", "ja"], out=root / "shards", progress=False)
    langs = m.languages
    cfg = load_config("small", [f"data.shards={root / 'shards'}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, ByteVocab(langs).size).eval()
    ck = root / "ck"
    ck.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ck / "model.safetensors"))
    (ck / "config.yaml").write_text(dump_yaml(cfg))
    (ck / "langs.json").write_text(json.dumps(langs))
    (ck / "trainer_state.json").write_text(json.dumps({"step": 0}))
    export_ct2(ck, root / "ct2")
    export_ct2(ck, root / "ct2_int8", quantization="int8")
    en = langs.index("en")
    exs = [e for e in read_split(root / "shards", "test") if e.tgt_lang == en and len(e.src) < 180][: args.lines]
    t0 = time.perf_counter()
    translate_examples(model, exs, ByteVocab(langs), batch_tokens=4096, beam=1, lenpen=1.0, max_len_a=0.0,
                       max_len_b=args.max_len)
    res = {"lines": len(exs), "max_len": args.max_len, "scaletrain_s": time.perf_counter() - t0}
    tok = AutoTokenizer.from_pretrained(str(root / "ct2"))
    by: dict[int, list] = {}
    for e in exs:
        by.setdefault(e.src_lang, []).append(e)
    for name in ("ct2", "ct2_int8"):
        tr = ctranslate2.Translator(str(root / name), device="cpu", intra_threads=1, inter_threads=1)
        t0 = time.perf_counter()
        for s, group in by.items():
            translate_ct2(tr, tok, [e.src.decode() for e in group], langs[s], "en", max_len=args.max_len)
        res[f"{name}_s"] = time.perf_counter() - t0
        res[f"{name}_speedup"] = res["scaletrain_s"] / res[f"{name}_s"]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
