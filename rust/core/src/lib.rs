//! kvroute-core: block hashing and the concurrent KV prefix index behind kvroute's router.
//! Pure Rust (no Python), so it can be tested, benchmarked and fuzzed on its own.

pub mod hash;
pub mod index;

pub use hash::DEFAULT_SEED;
pub use index::{IndexError, IndexStats, KvIndex, MatchScratch, Matches, Tier, TierMask, WorkerId, ANY_TIER};
pub mod sim;
