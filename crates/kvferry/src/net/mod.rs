//! TCP transport (being built).
