"""Checking a submitted spec before it is queued: the YAML guard, and the spec-check process with its fit check."""
