"""Pure helpers shared by the recording side and the analysis/report side.

Robust statistics (:mod:`.robust`), the one wait rule (:mod:`.waits`) and the escapers, one per
output format (:mod:`.escape`). They import nothing heavy (no duckdb, rich or matplotlib), so the
live view and the metric exporters use them without pulling the analysis or the report in.
"""
