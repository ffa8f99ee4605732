"""Errors a user can act on: the CLIs print them as one line (no traceback) and exit non-zero."""


class UserFacingError(Exception):
    """Base of errors whose message alone tells the user what is wrong and what to do."""


class StartInputError(UserFacingError):
    """Bad start-up input found only once the node started (a memory budget that cannot hold the model on this
    peer's ranks): ``geomesh-peer join`` exits 2, as for a bad flag."""
