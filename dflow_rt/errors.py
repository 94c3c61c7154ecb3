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


class RequestError(DflowError, RuntimeError):
    """A request that failed while decoding (its row produced a NaN or infinite logit).

    Only that request ends: its record keeps the reason in `Request.error`, and every other
    request in the batch decodes exactly as it would alone.
    """

    def __init__(self, rid: int, problem: str):
        self.rid = rid
        super().__init__(f"request {rid}: {problem}")


class BusyError(DflowError, RuntimeError):
    """`Runtime.step()` (or `cancel`/`pop`) called while a step of the same Runtime is running:
    from another thread, or re-entrantly from code a round calls. The call is refused at once."""
