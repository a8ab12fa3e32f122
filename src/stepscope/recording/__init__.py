"""The core: clock, recorder, resolver, session, sinks, the record schema, and the protocols
instruments and listeners plug in through (it imports neither)."""
