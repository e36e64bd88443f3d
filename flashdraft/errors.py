"""One exception type for user errors: the CLI prints its message on one line and exits 2."""


class FlashdraftError(Exception):
    """A user-facing error: bad input, a mismatched file, a refused configuration.

    The message must name the file, field or tensor, what was found and what was expected.
    """


class Interrupted(Exception):
    """SIGTERM or SIGINT stopped a command gracefully, its finished work on disk so that a re-run
    resumes it. The CLI prints the message on one line with the command that resumes, and exits
    with `status`: 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), what a shell
    reports for a process that signal ended. An empty message: another rank's line says it."""

    def __init__(self, signum: int, message: str, resume_flag: str = "") -> None:
        super().__init__(message)
        self.signum = signum
        self.status = 128 + signum
        self.resume_flag = resume_flag  # what the re-run adds to the command (train: --resume)
