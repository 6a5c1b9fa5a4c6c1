"""Former home of the subword baseline; kept only so that existing imports keep working.

New code imports from the modules that now hold each part:

    SubwordVocab, WORD_START                       scaletrain.vocab.subword (or scaletrain.vocab)
    SPM_TYPE, spm_file_name, lengths_file_name,    scaletrain.data.spm_models
    spm_entries, find_spm_model, load_token_lengths
    DEFAULT_*, iter_train_sentences,               scaletrain.data.spm_train
    check_spm_args, train_spm_bytes,
    write_token_lengths, add_spm_model

Nothing inside ``scaletrain`` imports this module except ``scaletrain.checkpoint`` (to be switched to
``scaletrain.vocab``); then it can be deleted.
"""
from scaletrain.data.spm_models import (  # noqa: F401
    SPM_TYPE,
    find_spm_model,
    lengths_file_name,
    load_token_lengths,
    spm_entries,
    spm_file_name,
)
from scaletrain.data.spm_train import (  # noqa: F401
    DEFAULT_COVERAGE,
    DEFAULT_SEED,
    DEFAULT_SENTENCES,
    DEFAULT_TRAIN_THREADS,
    add_spm_model,
    check_spm_args,
    iter_train_sentences,
    train_spm_bytes,
    write_token_lengths,
)
from scaletrain.vocab.subword import WORD_START, SubwordVocab  # noqa: F401
