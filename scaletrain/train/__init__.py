"""Training: the loop (:mod:`.trainer`), its components, the NMT unit and the job's state."""
from scaletrain.train.baseline import unigram_nll
from scaletrain.train.state import TrainState
from scaletrain.train.trainer import Trainer, TrainResult, seed_everything, train

__all__ = ["Trainer", "TrainResult", "TrainState", "seed_everything", "train", "unigram_nll"]
