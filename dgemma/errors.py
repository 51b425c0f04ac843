"""User-facing errors: one line, shown by the CLI and server without a traceback."""


class DgemmaError(Exception):
    """A problem the user can fix (bad path, bad checkpoint, bad option)."""


class CheckpointError(DgemmaError):
    """The checkpoint is missing, unsupported or inconsistent."""


class ConfigError(DgemmaError):
    """A configuration value is out of range or unsupported."""
