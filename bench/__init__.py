"""Benchmarks. Each prints one JSON document on stdout; progress goes to stderr."""
