"""Decoding and validation under expert parallelism, 2 ranks, moe.ep_size=2 (DeepSpeed ZeRO-0, deepspeed
launcher): in-training BLEU/chrF (every rank decodes its share of lines with the experts gathered
into a full copy, no exchange while decoding) and the validation loss (ranks in lock-step; here
rank 1 has fewer batches than rank 0 and joins rank 0's last exchanges) give exactly what one process
holding every expert gives; for MoE-FFN experts, and for MoCE's conv experts spread over the ranks
(moe.moce_partition) with MoE-FFN experts in the same model."""
from __future__ import annotations

import json
import textwrap

import pytest

from helpers import deepspeed_cmd, launcher_env, run, tiny_model

DRIVER = textwrap.dedent('''
    import json, sys
    import torch
    sys.path.insert(0, "tests/integration")
    from test_engine_replay import fixed_batches
    from scaletrain.cli import _strip_launcher_args
    from scaletrain.config import load_config
    from scaletrain.data.shards import load_manifest
    from scaletrain.engine import build_engine
    from scaletrain.models import build_model
    from scaletrain.eval.in_training import BleuValidator
    from scaletrain.train.unit import TranslationUnit, validation_loss
    from scaletrain.vocab import ByteVocab, PAD

    argv = _strip_launcher_args(sys.argv[1:])
    out, shards, overrides = argv[0], argv[1], argv[2:]
    cfg = load_config("small", overrides)
    eng = build_engine(cfg)
    vocab = ByteVocab(load_manifest(cfg.data.shards).languages)
    torch.manual_seed(0)
    eng.setup(build_model(cfg.model, vocab.size, moe=cfg.moe, parallel=eng.parallel))
    torch.manual_seed(0)
    single = build_model(cfg.model, vocab.size, moe=cfg.moe).eval()  # every expert, one process, same seed
    # raw bytes (no stop at invalid UTF-8): an untrained model then gives many different hypotheses to compare
    val = BleuValidator.for_run(cfg, vocab, n_per_direction=4, max_len_a=0.5, max_len_b=12,
                                    stop_invalid_utf8=False)
    model = eng.inference_module(lambda: build_model(cfg.model, vocab.size, moe=cfg.moe))
    res = val.run(model, rank=eng.rank, world_size=eng.world_size)
    ref = val.run(single, rank=0, world_size=1)
    batches = fixed_batches(shards, 4)
    mine = batches[:3] if eng.rank == 0 else batches[3:]  # uneven: 3 batches and 1
    unit = TranslationUnit(eng, cfg.optim.label_smoothing, PAD, vocab.langs)
    v = validation_loss(eng, unit, mine, 10)
    nll = n = 0.0
    with torch.no_grad():
        for b in batches:
            logits = single(b.src, b.tgt_in)
            lp = torch.log_softmax(logits.float(), -1).gather(-1, b.tgt_out.unsqueeze(-1)).squeeze(-1)
            m = b.tgt_out != PAD
            nll, n = nll - float(lp[m].sum()), n + int(m.sum())
    experts = sum(p.numel() for p in eng.module.parameters() if getattr(p, "expert", False))
    json.dump({"partitioned": eng.partitioned(), "copy": model is not eng.module, "metrics": res.metrics,
               "ref": ref.metrics, "hyps": res.hypotheses, "ref_hyps": ref.hypotheses, "local": res.local_lines,
               "valid": v, "valid_ref": nll / n, "experts": experts}, open(f"{out}/val_rank{eng.rank}.json", "w"))
''')


MOE_EXPERTS = 2 * 4 * (32 * 32 + 32 + 32 * 32 + 32)  # 4 FFN experts in each of 2 layers
CONV = "model.arch=moce", "model.conv.kernels=[0,1,3,5]", "moe.moce_partition=true"  # conv experts over the ranks


@pytest.mark.slow
@pytest.mark.parametrize("model", ["moe", "moce+moe"])
def test_two_ranks_ep2_decoding_and_validation_equal_one_process(django_shards, tmp_path, model):
    driver = tmp_path / "ep_val_driver.py"
    driver.write_text(DRIVER)
    over = [f"data.shards={django_shards}", *tiny_model(dropout=None), "data.max_bytes=60",
            "engine.ds_config=ds_configs/zero0.json", "engine.precision=fp32", "tracking.enabled=false",
            "moe.num_experts=4", "moe.every=1", "moe.ffn_dim=32", "moe.ep_size=2", "optim.label_smoothing=0",
            *(CONV if model == "moce+moe" else ())]
    run(deepspeed_cmd(2, str(driver), str(tmp_path), str(django_shards), *over), launcher_env(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"val_rank{r}.json").read_text()) for r in (0, 1))
    assert r0["partitioned"] and r1["partitioned"] and r0["copy"]  # the EP path really ran
    if model == "moe":
        assert r0["experts"] == r1["experts"] == MOE_EXPERTS // 2
    else:  # rank 0 owns the 5-tap conv expert, rank 1 the 3- and 1-tap ones (Dh = 16)
        assert (r0["experts"], r1["experts"]) == (MOE_EXPERTS // 2 + 16 * 16 * 5 + 16, MOE_EXPERTS // 2 + 16 * 16 * 4 + 32)
    assert r0["local"] == r1["local"] == 20
    assert r0["metrics"] == r1["metrics"] == r0["ref"]  # same numbers everywhere, = one process
    assert r0["hyps"] == r0["ref_hyps"] and len(set(r0["hyps"])) > 5
    assert r0["valid"] == r1["valid"] == pytest.approx(r0["valid_ref"], rel=1e-5)
