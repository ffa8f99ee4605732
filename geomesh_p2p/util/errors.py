"""Errors a user can act on: the CLIs print them as one line (no traceback) and exit non-zero."""


class UserFacingError(Exception):
    """Base of errors whose message alone tells the user what is wrong and what to do."""


class StoppedAtStart(UserFacingError):
    """The user asked the node to stop (Ctrl+C, SIGTERM) before it had joined (during the proof of work):
    ``geomesh-peer join`` says so in one line and exits 0, as for any stop (fresh user, session 43: it exited 1)."""


class StartInputError(UserFacingError):
    """Bad start-up input found only once the node started (a memory budget that cannot hold the model on this
    peer's ranks): ``geomesh-peer join`` exits 2, as for a bad flag."""
