"""Test package: lets the ranks that tests/ranks.py starts import test modules as `tests.test_x`."""
