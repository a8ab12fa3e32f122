"""Observers of the recording: live line, auto-profile, profiler windows, exports, heartbeat.

Each sees the run through :class:`stepscope.recording.protocols.Run` and implements any of
:class:`stepscope.recording.protocols.Listener`'s methods; the face attaches them."""
