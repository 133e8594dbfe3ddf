//! kvroute on a realistic engine model: NVIDIA AISimulate's engines (continuous batching, chunked
//! prefill, one KV pool for running requests and the prefix cache, preemption, GPU timing), with
//! kvroute's Router as the placement policy, fed by the engines' KV events through its `KvIndex`.

pub mod engine;
pub mod placement;
pub mod run;
pub mod summary;

pub use engine::{EngineModel, PolyFit, Timing, BUILTIN};
pub use run::{
    load_trace, replay_setup, run, trace_from_rows, trace_from_rows_in_blocks, Knowledge, Placer, RunResult, RunSpec, Topology,
    WorkerSpeed, TRACE_BLOCK_SIZE,
};
pub use summary::{RequestRecord, Slo, Summary};
