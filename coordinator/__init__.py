"""Checkpoint coordination, the metadata store, barrier handling and the embedded runtime."""
