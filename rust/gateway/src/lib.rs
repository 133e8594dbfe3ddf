//! kvroute's data plane: an HTTP/1.1 front door (hyper on tokio) that serves completions itself on the
//! core `Router`, unified or PD (`plane::pd`, src/pd.rs), in approximate or exact mode (src/exact.rs:
//! the engines' tokenizer and chat template), and forwards every other request to the Python gateway.
//!
//! Why two planes: the Python gateway holds all the semantics (admin API, health probes, /metrics, the
//! bodies the prompts here leave to it, and the PD conventions the Rust ones are tested against), but
//! a Python relay alone costs about as much CPU as the whole routing-overhead budget. The hot path —
//! parse, tokenize or hash, route, relay — therefore runs here, with no GIL, on the same `Router` and
//! `KvIndex` the Python side uses; everything else is forwarded byte for byte to the Python gateway on
//! an internal loopback port.

pub mod approx;
pub mod exact;
pub mod metrics;
mod plane;
pub mod prompt;

pub use approx::ApproxCache;
pub use exact::{ExactError, ExactPrompter};
pub use metrics::{MetricsSnapshot, ROUTING_BUCKETS};
pub use plane::pd::{bootstrap_room, JsonFields, PdConvention};
pub use plane::{DataPlane, PlaneConfig, PlaneError, UnhealthyHook, WorkerRow, CLIENT_HEADER, REQUEST_ID_BASE};
pub use prompt::{approx_prompt, ApproxPrompt};
