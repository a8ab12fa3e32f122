"""Renderings of analysis results: terminal, JSON, markdown, HTML and Perfetto."""
