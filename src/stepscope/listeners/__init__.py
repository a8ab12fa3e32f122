"""Observers of the recording: live line, auto-profile, profiler windows, exports, heartbeat."""
