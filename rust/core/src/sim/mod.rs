//! Building blocks of kvroute's cluster simulator: CPython-compatible randomness, the seed's
//! chat workload, and simulated prefill engines whose LRU caches publish KV events.

pub mod engines;
pub mod lru;
pub mod pyrandom;
pub mod workload;

pub use engines::{Prefill, PrefillEngines, SimError};
pub use lru::LruBlockCache;
pub use pyrandom::PyRandom;
pub use workload::{seed_chat, ChatShape, ChatWorkload};
