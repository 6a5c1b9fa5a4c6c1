"""Validation during training on 2 ranks, ZeRO-3, under the deepspeed launcher: every rank gets the numbers one
process gets (the in-process tests of scaletrain.eval.in_training are tests/unit/test_eval_validation.py)."""
from __future__ import annotations

import json
import textwrap

import pytest

from helpers import deepspeed_cmd, launcher_env, run, tiny_model

DRIVER = textwrap.dedent('''
    import json, sys
    import torch
    from scaletrain.cli import _strip_launcher_args
    from scaletrain.config import load_config
    from scaletrain.data.shards import load_manifest
    from scaletrain.engine import build_engine
    from scaletrain.models import build_model
    from scaletrain.eval.in_training import BleuValidator
    from scaletrain.vocab import ByteVocab

    argv = _strip_launcher_args(sys.argv[1:])
    out, overrides = argv[0], argv[1:]
    cfg = load_config("small", overrides)
    eng = build_engine(cfg)
    vocab = ByteVocab(load_manifest(cfg.data.shards).languages)
    torch.manual_seed(0)
    eng.setup(build_model(cfg.model, vocab.size))
    # an untrained model's hypotheses mostly stop at their first invalid byte: decode raw bytes, so the
    # ranks are compared on many different hypotheses
    val = BleuValidator.for_run(cfg, vocab, n_per_direction=4, max_len_a=0.5, max_len_b=12,
                                    stop_invalid_utf8=False)
    model = eng.inference_module(lambda: build_model(cfg.model, vocab.size))
    res = val.run(model, rank=eng.rank, world_size=eng.world_size)
    ref = val.run(model, rank=0, world_size=1)  # every rank alone, same weights: the single-process answer
    json.dump({"partitioned": eng.partitioned(), "copy": model is not eng.module, "metrics": res.metrics,
               "ref": ref.metrics, "local": res.local_lines, "lines": res.lines, "hyps": res.hypotheses,
               "ref_hyps": ref.hypotheses}, open(f"{out}/val_rank{eng.rank}.json", "w"))
''')


@pytest.mark.slow
def test_two_ranks_zero3_validation_equals_single_process(django_shards, tmp_path):
    driver = tmp_path / "val_driver.py"
    driver.write_text(DRIVER)
    over = [f"data.shards={django_shards}", *tiny_model(dropout=None), "data.max_bytes=60",
            "engine.ds_config=ds_configs/zero3.json", "tracking.enabled=false"]
    run(deepspeed_cmd(2, str(driver), str(tmp_path), *over), launcher_env(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"val_rank{r}.json").read_text()) for r in (0, 1))
    assert r0["partitioned"] and r1["partitioned"] and r0["copy"]  # the ZeRO-3 path really ran
    assert r0["lines"] == r1["lines"] == 40 and r0["local"] + r1["local"] == 40 and r0["local"] == 20
    assert r0["metrics"] == r1["metrics"] == r0["ref"] == r1["ref"]  # same numbers everywhere, = one process
    assert r0["hyps"] == r0["ref_hyps"] == r1["ref_hyps"] and len(set(r0["hyps"])) > 5
    assert r0["metrics"]["valid/chrf_avg/all"] >= 0 and "valid/bleu_avg/non-latin" in r0["metrics"]


