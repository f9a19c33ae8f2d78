"""Inference backends. Each turns token ids into a stream of text pieces."""
