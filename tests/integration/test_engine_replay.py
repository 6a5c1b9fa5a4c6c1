"""A fixed, replayable batch source and the driver the engine tests run under the launchers.

Equivalence needs the *same global batch* whatever the layout: the batches of a step are the
global micro-batches ``step * W * k .. step * W * k + W * k - 1`` (W ranks, k accumulation steps);
rank r reads micro-batches ``r * k .. r * k + k - 1`` of them. So 1 process with k=2 and 2 ranks with
k=1 see exactly the same examples per update. ``merge=k`` concatenates k consecutive micro-batches
into one batch (k-step accumulation vs a k-times larger batch).

As a script (under ``deepspeed``, ``accelerate launch`` or plain ``python``)::

    test_engine_replay.py OUT SHARDS JOBS_JSON

trains each job in turn in this process (DeepSpeed initialises once per process), then writes
OUT/NAME/result_rank{r}.json (loss trajectory, loss on a fixed batch, data hashes) and
OUT/NAME/params_rank{r}.pt (the full fp32 parameters, ZeRO-3 gathered).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "tests"):  # as a script: the package, and helpers
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from helpers import tiny_model  # noqa: E402
from scaletrain.data.batch import Batch  # noqa: E402
from scaletrain.vocab import PAD  # noqa: E402

# A tiny model, fixed data, no dropout: differences can only come from the engine.
TINY = [
    *tiny_model(), "data.max_bytes=40", "data.max_tokens=600",
    "optim.lr=3e-3", "optim.warmup_steps=5", "optim.clip_norm=1.0", "train.log_every=1", "train.valid_every=0",
    "train.valid_max_batches=1", "train.save_every=0", "train.max_minutes=0", "tracking.enabled=false",
    "engine.threads=1",
]


def _pad_cat(ts: list[torch.Tensor]) -> torch.Tensor:
    n = max(t.shape[1] for t in ts)
    return torch.cat([torch.nn.functional.pad(t, (0, n - t.shape[1]), value=PAD) for t in ts])


def merge_batches(bs: list[Batch]) -> Batch:
    return Batch(
        _pad_cat([b.src for b in bs]), _pad_cat([b.tgt_in for b in bs]), _pad_cat([b.tgt_out for b in bs]),
        torch.cat([b.src_lang for b in bs]), torch.cat([b.tgt_lang for b in bs]),
        sum(b.n_src_tokens for b in bs), sum(b.n_tgt_tokens for b in bs),
    )


def fixed_batches(shards, n: int, max_tokens: int = 600, max_bytes: int = 40) -> list[Batch]:
    from scaletrain.data.stream import ShardStream

    s = ShardStream(shards, "train", rank=0, world_size=1, seed=7, max_tokens=max_tokens, max_bytes=max_bytes)
    it = iter(s)
    return [next(it) for _ in range(n)]


class Replay:
    """Rank ``rank`` of ``world`` with ``gas`` micro-batches per step over a fixed global sequence."""

    def __init__(self, batches: list[Batch], rank: int, world: int, gas: int, merge: int = 1):
        self.batches, self.rank, self.world, self.gas, self.merge = batches, rank, world, gas, merge
        self.pos = 0  # micro-batches this rank has yielded

    def global_index(self, pos: int) -> int:
        step, j = divmod(pos, self.gas)
        return (step * self.world * self.gas + self.rank * self.gas + j) * self.merge

    def __iter__(self):
        while True:
            i = self.global_index(self.pos)
            if i + self.merge > len(self.batches):
                raise RuntimeError(f"Replay: out of batches at global index {i}")
            self.pos += 1
            yield merge_batches(self.batches[i : i + self.merge]) if self.merge > 1 else self.batches[i]

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, st: dict) -> None:
        self.pos = int(st["pos"])


def pair_hash(src: bytes, tgt: bytes) -> str:
    return hashlib.sha1(len(src).to_bytes(4, "little") + src + tgt).hexdigest()[:16]


def batch_pair_hashes(b: Batch) -> list[str]:
    """One hash per example: its source and target token ids (language tags included), pads dropped."""
    out = []
    for s, t in zip(b.src, b.tgt_out):
        s = s[s != PAD].numpy().astype("int32").tobytes()
        t = t[t != PAD].numpy().astype("int32").tobytes()
        out.append(pair_hash(s, t))
    return out


class Recording:
    """Wraps a stream and records a hash of every example it yields (disjointness checks)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __iter__(self):
        for b in self.inner:
            self.seen.extend(batch_pair_hashes(b))
            yield b

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, st):
        self.inner.load_state_dict(st)


def fixed_batch_loss(model, batch: Batch, label_smoothing: float) -> float:
    """Label-smoothed loss per target token of one batch, eval mode (the export round-trip check)."""
    from scaletrain.models.loss import label_smoothed_ce

    was = model.training
    model.eval()
    with torch.no_grad():
        logits = model(batch.src, batch.tgt_in)
        loss, _, ntok = label_smoothed_ce(logits.float(), batch.tgt_out, epsilon=label_smoothing, ignore_index=PAD)
    model.train(was)
    return float(loss) / int(ntok)


def run_job(out: Path, shards: str, job: dict) -> None:
    from scaletrain.cli import _setup_logging
    from scaletrain.config import load_config
    from scaletrain.engine import build_engine
    from scaletrain.train import Trainer

    _setup_logging(False)
    name = job["name"]
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    overrides = [f"data.shards={shards}", f"train.out_dir={d}", *TINY, *job.get("overrides", [])]
    cfg = load_config("small", overrides)
    eng = build_engine(cfg)
    dp, gas = eng.parallel, cfg.engine.grad_accum  # the data split: the parallel context's data-parallel rank
    stream = None
    if job.get("replay", True):
        need = cfg.train.max_steps * dp.world_size * gas * job.get("merge", 1)
        stream = Replay(fixed_batches(shards, need), dp.rank, dp.world_size, gas, job.get("merge", 1))
    if job.get("record"):
        from scaletrain.data.loader import ShardLoader

        stream = Recording(stream or ShardLoader.for_run(cfg.data, "train", parallel=dp, grad_accum=gas))
    trainer = Trainer(cfg, engine=eng, stream=stream)
    res = trainer.fit()
    trainer.close()
    params = eng.full_state_dict()
    probe = fixed_batches(shards, 1, max_tokens=600, max_bytes=40)[0]
    from scaletrain.models import build_model

    probe_model = build_model(cfg.model, trainer.vocab.size, moe=cfg.moe)
    probe_model.load_state_dict(params)
    result = {
        **res.__dict__, "world_size": eng.world_size, "rank": eng.rank, "engine": eng.backend.name,
        "zero_stage": eng.zero_stage, "probe_loss": fixed_batch_loss(probe_model, probe, cfg.optim.label_smoothing),
        "seen": getattr(stream, "seen", None),
    }
    torch.save(params, d / f"params_rank{eng.rank}.pt")
    if job.get("whole"):  # the optimizer's state made whole, by name (resume at another layout)
        w = eng.whole_state()
        torch.save({"masters": w.masters or {k: params[k] for k in eng.trainable()}, "moments": w.moments,
                    "step": w.step}, d / f"whole_rank{eng.rank}.pt")
    (d / f"result_rank{eng.rank}.json").write_text(json.dumps(result))
    eng.parallel.barrier()


def main(argv: list[str]) -> None:
    from scaletrain.cli import _strip_launcher_args

    argv = _strip_launcher_args(argv)
    out, shards, jobs = Path(argv[0]), argv[1], json.loads(argv[2])
    for job in jobs:
        run_job(out, shards, job)


# ---- unit tests of the replay itself (fast) ----------------------------------------------------------
def _toy(n):
    out = []
    for i in range(n):
        L = 3 + i % 4
        src = torch.full((2, L), 10 + i)
        out.append(Batch(src, src.clone(), src.clone(), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 2 * L, 2 * L))
    return out


def _ids(stream, n):
    it = iter(stream)
    return [int(next(it).src[0, 0]) - 10 for _ in range(n)]


def test_replay_same_global_batch_for_any_layout():
    bs = _toy(24)
    # 1 rank x 2 accumulation steps == 2 ranks x 1: per step the same set of global micro-batches
    one = _ids(Replay(bs, 0, 1, 2), 8)
    r0, r1 = _ids(Replay(bs, 0, 2, 1), 4), _ids(Replay(bs, 1, 2, 1), 4)
    for s in range(4):
        assert sorted(one[2 * s : 2 * s + 2]) == sorted([r0[s], r1[s]]) == [2 * s, 2 * s + 1]
    # 2 ranks x 2 accumulation: rank 1 reads 2,3 then 6,7
    assert _ids(Replay(bs, 1, 2, 2), 4) == [2, 3, 6, 7]


def test_replay_merge_and_resume():
    bs = _toy(8)
    m = next(iter(Replay(bs, 0, 1, 1, merge=2)))
    assert m.src.shape == (4, max(bs[0].src.shape[1], bs[1].src.shape[1]))
    assert m.n_tgt_tokens == bs[0].n_tgt_tokens + bs[1].n_tgt_tokens
    assert (m.src[2:, bs[1].src.shape[1]:] == PAD).all() or bs[1].src.shape[1] >= bs[0].src.shape[1]
    r = Replay(bs, 0, 1, 1)
    _ids(r, 3)
    r2 = Replay(bs, 0, 1, 1)
    r2.load_state_dict(r.state_dict())
    assert _ids(r2, 2) == [3, 4]


if __name__ == "__main__":
    from scaletrain.engine.shutdown import finishing_distributed

    with finishing_distributed():  # as `scaletrain train` ends: groups and threads finished first
        main(sys.argv[1:])
