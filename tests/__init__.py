"""Tests; a package so that test helpers import as ``tests.<module>`` from the repository root."""
