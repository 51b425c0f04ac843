"""User-facing errors: one line, shown by the CLI and server without a traceback."""


class DgemmaError(Exception):
    """A problem the user can fix (bad path, bad checkpoint, bad option)."""


class CheckpointError(DgemmaError):
    """The checkpoint is missing, unsupported or inconsistent."""


class ConfigError(DgemmaError):
    """A configuration value is out of range or unsupported."""


class SamplingParamsError(ConfigError, ValueError):
    """A request parameter is out of range (a ValueError for callers, a ConfigError for the CLI/server), raised by
    every layer that checks one. `param` names it (`prompt`, `max_new_tokens`, `stop`, ...) so the server can point
    at the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
