"""The training tests' tiny hybrid target and its records (cached features), one per test module."""

import pytest

from tests.conftest import make_target
from tests.train.helpers import make_records


@pytest.fixture(scope="module")
def target():
    return make_target("hybrid")


@pytest.fixture(scope="module")
def records(target):
    return make_records(target, n=8)
