"""Errors users can act on. The CLI prints these as one line; anything else is a bug."""


class DflowError(Exception):
    """Base class of every error dflow-rt raises on purpose."""


class CheckpointError(DflowError):
    """A model directory, config field or weight file that cannot be used as asked."""

    def __init__(self, path: object, problem: str):
        self.path = str(path)
        super().__init__(f"{path}: {problem}")


class InputError(DflowError, ValueError):
    """A request that cannot be served: prompt too long, bad token ids, bad settings."""
