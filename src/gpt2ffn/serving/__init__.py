"""Serving: the continuous-batching engine (engine.py) and per-request sampling (sampling.py)."""
