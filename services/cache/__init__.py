"""cache: response cache (exact match now; semantic later)."""
