"""The one exception type that is shown to users as a single line.

Anything raised as :class:`FixresError` is a problem with the user's input or environment (a bad
flag, a missing folder, a peer rank that never arrived). The launcher prints it as
``fixres_dist: rank R: <message>`` on stderr and exits with status 1, without a traceback. Any
other exception is a bug and keeps its traceback.
"""


class FixresError(Exception):
    """A user-facing error; its message is one line that says what is wrong and what to do."""
