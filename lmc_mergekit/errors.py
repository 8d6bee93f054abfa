"""The one exception type the tool raises for bad input."""


class LmcError(ValueError):
    """A user-facing error: one line that names the problem and, where there is one, the fix."""
