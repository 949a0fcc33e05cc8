"""The consumer and its supervisor: start, run, shut down (docs/lifecycle.md)."""
