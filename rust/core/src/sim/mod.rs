//! Building blocks of kvroute's cluster simulator: the seed's chat workload (drawn with
//! `crate::random::PyRandom`) and simulated prefill engines whose LRU caches publish KV events.

pub mod engines;
pub mod lru;
pub mod workload;

pub use engines::{Prefill, PrefillEngines, SimError};
pub use lru::LruBlockCache;
pub use workload::{seed_chat, ChatShape, ChatWorkload};
