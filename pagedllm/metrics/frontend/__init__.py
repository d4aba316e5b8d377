"""Metrics kept in the API process: one timeline a request, Prometheus series, the dashboard's
samples."""
