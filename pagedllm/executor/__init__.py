"""Executors: how the engine core reaches its workers (one process, several, or a Ray cluster)."""
