//! Wire format (being built): frames, control messages, limits, checksums.
