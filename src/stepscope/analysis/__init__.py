"""Offline analysis of recorded runs and traces (imports nothing until a module is used)."""
