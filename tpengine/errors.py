"""Errors users catch; a light module (no torch) so the ledger and its users import it freely."""


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died, raised or stopped answering; the engine is shut down."""


class InvalidRequestError(ValueError):
    """A request the engine rejects. `param` names the input at fault, as SamplingParams and the prompt
    call it ("temperature", "stop_token_ids", "prompt", ...), so a server can point at its own field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
