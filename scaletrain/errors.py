"""Project exception: a message a user can act on. The CLI prints it without a traceback."""


class ScaletrainError(Exception):
    """An error caused by input or configuration, with a message that says what to do."""


class CorruptShardError(ScaletrainError):
    """A shard block whose bytes are not what ``prepare`` wrote (checksum, structure, language ids, truncation)."""
