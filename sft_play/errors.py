"""Errors the user can act on: printed as a message, without a traceback, exit status 2."""


class UserError(Exception):
    """A problem the user can fix; the message says what is wrong and what to do."""


class OutOfMemory(UserError):
    """Training ran out of memory and could not back off any further."""
