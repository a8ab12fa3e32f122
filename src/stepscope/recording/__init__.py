"""The core: clock, recorder, resolver, session, sinks and the record schema."""
