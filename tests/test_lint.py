"""The code is as the formatter writes it and the linter passes it: `ruff format --check` and `ruff check` over the
package, its tests, benchmarks and scripts (what `make lint` runs), and a formatter opt-out only for a table whose
alignment carries meaning, at most MAX_FORMATTER_OPT_OUTS in all."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ["flashdraft", "tests", "benchmarks", "scripts"]
MAX_FORMATTER_OPT_OUTS = 20


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *TREES], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_code_is_as_ruff_format_writes_it():
    result = ruff("format", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_check_passes():
    result = ruff("check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_at_most_20_formatter_opt_outs():
    marker = "fmt: " + "skip"  # spelled apart so this file does not count itself
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for tree in TREES
        for path in sorted((ROOT / tree).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if marker in line or "fmt: " + "off" in line
    ]
    assert len(found) <= MAX_FORMATTER_OPT_OUTS, "\n".join(found)
