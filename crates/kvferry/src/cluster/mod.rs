//! Rank runtime (being built): leader, worker processes, step responses, aggregation.
