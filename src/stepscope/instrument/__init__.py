"""Instruments: the hooks and wrappers that feed phase spans to the recorder, through
:class:`stepscope.recording.protocols.Recorder` only."""
