"""Errors users catch; a light module (no torch) so the ledger and its users import it freely."""


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died, raised or stopped answering; the engine is shut down."""
