"""Errors that mean the user has to change something: the message says what is wrong and how to fix it.

The CLI prints these without a traceback and exits with status 2. Anything else is a bug and keeps
its traceback.
"""


class ShardwiseError(Exception):
    """A user mistake (config, data, checkpoint, device); the message names the fix."""


class ConfigError(ShardwiseError):
    """The run configuration is invalid."""


class DataError(ShardwiseError):
    """Input data or a tokenizer is missing or unusable."""


class CheckpointError(ShardwiseError):
    """A checkpoint is missing, incomplete, does not match the model, or is not what shardwise writes
    (damaged or altered: it is refused unread rather than trusted)."""


class DeviceError(ShardwiseError):
    """The requested device or backend is not available."""


class TrainingError(ShardwiseError):
    """Training cannot continue (for example a NaN loss)."""
