"""Fixtures of the materializer tests: the backends tests' store factory, shared."""

from tests.backends.conftest import factory  # noqa: F401 - re-exported as a fixture
