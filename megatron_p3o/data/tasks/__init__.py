"""Small verifiable tasks for CPU recipes and tests."""
