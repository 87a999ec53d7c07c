"""The one exception type that means "the user asked for something we cannot do".

The CLI prints such errors as a single line and exits non-zero; anything else is a bug and keeps its traceback.
"""


class NHARetrofitError(Exception):
    """A user mistake or an unusable input, described in one line."""
