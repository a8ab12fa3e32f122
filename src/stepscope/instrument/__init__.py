"""Instruments: the hooks and wrappers that feed phase spans to a Tracer."""
