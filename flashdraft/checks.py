"""A report of checks, one line each: facts, passed checks, warnings and failures with their fix.
`flashdraft doctor` prints one for every kind of file; the cache format's own checks
(`flashdraft.data.cache_doctor.doctor_cache`) write into it too."""

from __future__ import annotations


class Checks:
    """The doctor's report: facts, passed checks, and failures with their fix."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.warnings: list[str] = []  # served differently or needing care, but not wrong: exit code stays 0

    def about(self, line: str) -> None:
        print(f"     {line}")

    def ok(self, line: str) -> None:
        print(f"ok   {line}")

    def fail(self, line: str, fix: str) -> None:
        print(f"FAIL {line}; fix: {fix}")
        self.failures.append(line)

    def warn(self, line: str, fix: str) -> None:
        print(f"warn {line}; fix: {fix}")
        self.warnings.append(line)

    def check(self, passed: bool, line: str, fix: str) -> None:
        if passed:
            self.ok(line)
        else:
            self.fail(line, fix)

    def summary(self) -> bool:
        warned = f" ({len(self.warnings)} warning(s))" if self.warnings else ""
        print(("all checks passed" if not self.failures else f"{len(self.failures)} check(s) failed") + warned)
        return not self.failures
