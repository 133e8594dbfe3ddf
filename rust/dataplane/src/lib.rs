//! kvroute's data plane: the gateway's one request path. An HTTP/1.1 server (hyper on tokio) that
//! serves completions on the core `Router`, unified or PD (`plane::pd`, src/plane/pd.rs), in approximate or
//! exact mode (src/exact.rs: the engines' tokenizer and chat template), relays to `http://` and
//! `https://` engines (rustls), and answers `/v1/models`, `/health` and `/metrics` itself.
//!
//! Its owner (the Python control plane, `kvroute.gateway`) configures it, registers workers, probes
//! their health, feeds `Router.observe` from the engines' `/metrics`, and serves the admin API on a
//! loopback port the plane passes `/admin` requests to. No Python runs per request.

pub mod approx;
pub mod exact;
pub mod metrics;
mod plane;
pub mod prompt;

pub use approx::ApproxCache;
pub use exact::{ExactError, ExactPrompter};
pub use metrics::{render_metrics, MetricsSnapshot, ROUTING_BUCKETS};
pub use plane::pd::{bootstrap_room, JsonFields, PdConvention};
pub use plane::{DataPlane, PlaneConfig, PlaneError, ServedModel, UnhealthyHook, WorkerRow, REQUEST_ID_BASE};
pub use prompt::{approx_prompt, ApproxPrompt, BadRequest};
