"""One exception type for user errors: the CLI prints its message on one line and exits 2."""


class FlashdraftError(Exception):
    """A user-facing error: bad input, a mismatched file, a refused configuration.

    The message must name the file, field or tensor, what was found and what was expected.
    """
