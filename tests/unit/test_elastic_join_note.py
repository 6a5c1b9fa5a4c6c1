"""torchrun run by hand with restarts and its rendezvous store shared with the workers (torch's default): rank 0
says once that a node that comes back cannot join unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set for
torchrun (``scaletrain.engine.env.elastic_join_note``); ``launch.sh --elastic`` sets it, and growing back is
tested there (tests/integration/test_elastic_restart.py)."""
from __future__ import annotations

import logging

import pytest

from helpers import local_backend_class, tiny_model
from scaletrain.config import load_config
from scaletrain.engine import Engine
from scaletrain.engine.env import elastic_join_note

AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3",
         "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "job"}


def test_the_shared_store_with_restarts_gets_the_line():
    line = elastic_join_note(AGENT)
    assert line == ("torchrun restarts this job (--max-restarts=3) with its rendezvous store shared with the "
                    "workers: a node that comes back while the job runs cannot join it (the new rendezvous round "
                    "times out) unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set for torchrun (launch.sh "
                    "--elastic sets it)")


@pytest.mark.parametrize("change", [
    {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},  # set for torchrun (launch.sh --elastic)
    {"TORCHELASTIC_USE_AGENT_STORE": "False"},  # what torch then tells the workers
    {"TORCHELASTIC_MAX_RESTARTS": "0"},  # no restart, no join (torchrun's default)
    {"TORCHELASTIC_RESTART_COUNT": "1"},  # said at the first attempt only
    {"TORCHELASTIC_USE_AGENT_STORE": None, "TORCHELASTIC_MAX_RESTARTS": None, "TORCHELASTIC_RESTART_COUNT": None,
     "TORCHELASTIC_RUN_ID": None},  # not under torchrun (deepspeed, accelerate without restarts, one process)
])
def test_no_line_where_a_returning_node_can_join_or_cannot_come(change):
    env = {k: v for k, v in {**AGENT, **change}.items() if v is not None}
    assert elastic_join_note(env) is None


class _Engine(Engine):
    def __init__(self, cfg):
        super().__init__(cfg, local_backend_class()())


@pytest.mark.parametrize("disabled", [False, True])
def test_rank_0_of_the_first_attempt_says_it_once(django_shards, tmp_path, monkeypatch, caplog, disabled):
    from scaletrain.train import Trainer

    for k, v in AGENT.items():
        monkeypatch.setenv(k, v)
    if disabled:
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    else:
        monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    cfg = load_config("small", [*tiny_model(), "data.max_bytes=40", "data.max_tokens=600", "tracking.enabled=false",
                                f"data.shards={django_shards}", f"train.out_dir={tmp_path}"])
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        trainer = Trainer(cfg, engine=_Engine(cfg))
        trainer.close()
    said = [r for r in caplog.records if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in r.getMessage()]
    assert len(said) == (0 if disabled else 1), [r.getMessage() for r in said]
    if said:
        assert said[0].levelno == logging.WARNING and said[0].getMessage() == elastic_join_note(AGENT)
