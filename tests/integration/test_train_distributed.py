"""End to end on the bundled corpus: 2 CPU ranks through the `deepspeed` launcher (gloo)."""
import json

import pytest
import torch

from helpers import DIST_DRIVER, deepspeed_cmd, launcher_env, run, tiny_model

TINY = [
    *tiny_model(d_model=64, n_heads=4, layers=2, ffn_dim=128, max_positions=128),
    "data.max_bytes=60", "data.max_tokens=1600",
    "optim.lr=3e-3", "optim.warmup_steps=10", "train.log_every=5", "train.valid_every=25", "train.valid_max_batches=8",
    "train.save_every=0", "train.max_minutes=0",
]


@pytest.mark.slow
@pytest.mark.quick  # the launched job of ./test.sh --quick
def test_two_ranks_deepspeed_loss_falls_params_identical(django_shards, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    args = [str(out), "small", f"data.shards={django_shards}", f"train.out_dir={out}", "train.max_steps=50", *TINY]
    p = run(deepspeed_cmd(2, DIST_DRIVER, *args), launcher_env(tmp_path))
    res = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world_size"] == 2 for r in res), p.stdout[-2000:]
    losses = res[0]["train_loss"]
    assert losses[0][0] == 5 and losses[-1][0] == 50
    first, last = losses[0][1], losses[-1][1]
    assert last < 0.75 * first, losses  # falls clearly
    valid = res[0]["valid_nll"]
    assert valid[-1][1] < valid[0][1]
    # every rank ran the same steps and both end with bit-identical parameters
    assert res[0]["steps"] == res[1]["steps"] == 50 and res[0]["tokens"] == res[1]["tokens"]
    p0 = torch.load(out / "params_rank0.pt")
    p1 = torch.load(out / "params_rank1.pt")
    assert p0.keys() == p1.keys()
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k
    # the final checkpoint is complete and named by `latest`
    ck = out / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-0000050"
    assert (ck / "step-0000050" / "rank00000.pt").is_file() and (ck / "step-0000050" / "rank00001.pt").is_file()
