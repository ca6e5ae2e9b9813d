//! Device layer (being built): streams, events, bounded waits; host, sim and cuda backends.
