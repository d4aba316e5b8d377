"""Metrics kept in the engine core: the periodic stats log."""
