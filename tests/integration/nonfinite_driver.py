"""dist_driver.py with a planted fault: rank NAN_RANK's loss is NaN (or NAN_VALUE: inf) at update NAN_STEP
(environment variables).

usage (under a launcher): NAN_RANK=1 NAN_STEP=3 [NAN_VALUE=inf] nonfinite_driver.py OUT_DIR RECIPE [KEY=VALUE ...]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scaletrain.train import trainer as trainer_mod  # noqa: E402
from scaletrain.train.unit import TranslationUnit  # noqa: E402

import dist_driver  # noqa: E402

RANK, STEP = int(os.environ["NAN_RANK"]), int(os.environ["NAN_STEP"])
VALUE = float(os.environ.get("NAN_VALUE", "nan"))
_real_loss, _real_fit = TranslationUnit.loss, trainer_mod.Trainer.fit
_state = {}


def fit(self):
    _state["trainer"] = self
    return _real_fit(self)


def loss(self, batch):
    loss_sum, nll_sum, ntok = _real_loss(self, batch)
    tr = _state.get("trainer")
    if tr is not None and self.engine.rank == RANK and tr.state.step + 1 == STEP and self.engine.module.training:
        loss_sum = loss_sum * VALUE
    return loss_sum, nll_sum, ntok


TranslationUnit.loss = loss
trainer_mod.Trainer.fit = fit

if __name__ == "__main__":
    from scaletrain.engine.shutdown import finishing_distributed

    with finishing_distributed():  # as `scaletrain train` ends: groups and threads finished first
        dist_driver.main()
