"""The package's version: what ``meta.json`` and the exports report as ``stepscope``'s."""

__version__ = "0.1.0"
