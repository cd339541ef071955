"""Shared e2e fixtures: ``base`` (the quickstart base model) lives in tests/conftest.py."""
