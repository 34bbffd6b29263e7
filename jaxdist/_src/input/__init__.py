"""Distributed input: datasets, per-replica splitting, prefetch to devices."""
