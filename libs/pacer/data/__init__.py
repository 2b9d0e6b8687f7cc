"""Criteo data: readers, the fixed-width record file, the synthetic generator."""
