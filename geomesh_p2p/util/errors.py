"""Errors a user can act on: the CLIs print them as one line (no traceback) and exit non-zero."""


class UserFacingError(Exception):
    """Base of errors whose message alone tells the user what is wrong and what to do."""
