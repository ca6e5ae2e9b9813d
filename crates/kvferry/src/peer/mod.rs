//! Producer and consumer (being built).
