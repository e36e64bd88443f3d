"""A report of checks, one line each: facts, passed checks, warnings and failures with their fix.
`flashdraft doctor` prints one for every kind of file; the cache format's own checks
(`flashdraft.data.cache_doctor.doctor_cache`) write into it too."""

from __future__ import annotations


class Checks:
    """The doctor's report: facts, passed checks, and failures with their fix."""

    def __init__(self, held: bool = False) -> None:
        self.failures: list[str] = []
        self.warnings: list[str] = []  # served differently or needing care, but not wrong: exit code stays 0
        self.passed = 0
        self.held: list[str] | None = [] if held else None  # lines kept back to follow a verdict (`print_held`)

    def _line(self, line: str) -> None:
        if self.held is None:
            print(line)
        else:
            self.held.append(line)

    def about(self, line: str) -> None:
        self._line(f"     {line}")

    def ok(self, line: str) -> None:
        self._line(f"ok   {line}")
        self.passed += 1

    def fail(self, line: str, fix: str) -> None:
        self._line(f"FAIL {line}; fix: {fix}")
        self.failures.append(line)

    def warn(self, line: str, fix: str) -> None:
        self._line(f"warn {line}; fix: {fix}")
        self.warnings.append(line)

    def print_held(self, what: str, into: Checks) -> None:
        """A held report: its verdict in one line first (`what`: whose checks), then its lines, counted in `into`."""
        print(f"     {what}: {self.passed} ok, {len(self.warnings)} warn, {len(self.failures)} FAIL")
        for line in self.held or []:
            print(line)
        into.passed += self.passed
        into.warnings += self.warnings
        into.failures += self.failures

    def check(self, passed: bool, line: str, fix: str) -> None:
        if passed:
            self.ok(line)
        else:
            self.fail(line, fix)

    def summary(self) -> bool:
        warned = f" ({len(self.warnings)} warning(s))" if self.warnings else ""
        print(("all checks passed" if not self.failures else f"{len(self.failures)} check(s) failed") + warned)
        return not self.failures
