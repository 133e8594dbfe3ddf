//! kvroute-core: block hashing, the concurrent KV prefix index, and the router on top of them.
//! Pure Rust (no Python), so it can be tested, benchmarked and fuzzed on its own.

pub mod check;
pub mod events;
pub mod hash;
pub mod index;
pub mod random;
pub mod router;

pub use hash::DEFAULT_SEED;
pub use index::{IndexError, IndexStats, KvIndex, MatchScratch, Matches, Tier, TierMask, WorkerId, ANY_TIER};
pub use router::{Decision, RouteRequest, Router, RouterConfig, RouterError};
pub mod sim;
