//! One run's figures, computed from AISimulate's per-request records: the same numbers for every
//! placement (kvroute's policies, round robin, a peer router), so they compare in one table.

use aisimulate_core::replay::{PerRequestRecord, ReplayRequestPool, ReplayTerminalStatus};
use serde::{Deserialize, Serialize};

/// Latency targets a request must meet to count as goodput (both, when both are set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Mean inter-token latency of the request, ms.
    pub itl_ms: Option<f64>,
}

/// What one request did, as far as the figures need.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub arrival_ms: f64,
    /// None: rejected (or never produced a token).
    pub ttft_ms: Option<f64>,
    pub itl_ms: Option<f64>,
    pub last_token_ms: Option<f64>,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// Prompt tokens the engine found in its prefix cache (first admission).
    pub cached_tokens: usize,
    /// Times the engine preempted the request and admitted it again.
    pub preemptions: usize,
    /// Where it was placed: the unified or prefill worker, and the decode worker (PD).
    pub prefill_worker: Option<usize>,
    pub decode_worker: Option<usize>,
    /// Prompt tokens the placement expected cached on its worker (the router's overlap).
    pub routed_overlap_tokens: Option<usize>,
    /// The router's predicted TTFT, ms (kvroute placements).
    pub predicted_ttft_ms: Option<f64>,
    pub rejected: bool,
}

impl RequestRecord {
    pub fn from_aisim(r: &PerRequestRecord, rejected: bool) -> Self {
        let failed = !matches!(r.terminal_status, ReplayTerminalStatus::Completed);
        let rejected = rejected || failed;
        let routed = |pools: &[ReplayRequestPool]| r.routing_history.iter().find(|h| pools.contains(&h.pool));
        let first = routed(&[ReplayRequestPool::Agg, ReplayRequestPool::Prefill]);
        RequestRecord {
            arrival_ms: r.arrival_time_ms,
            ttft_ms: if rejected { None } else { r.ttft_ms },
            itl_ms: if rejected { None } else { r.itl_ms },
            last_token_ms: if rejected { None } else { r.last_token_ms },
            input_tokens: r.input_length,
            output_tokens: if rejected { 0 } else { r.output_length },
            cached_tokens: r.first_admission_g1_reused_input_tokens.unwrap_or(r.reused_input_tokens),
            preemptions: r.readmission_count,
            prefill_worker: first.and_then(|h| h.scheduler_id).or(r.prefill_worker_idx),
            decode_worker: routed(&[ReplayRequestPool::Decode]).and_then(|h| h.scheduler_id).or(r.decode_worker_idx),
            routed_overlap_tokens: first.and_then(|h| h.reported_overlap_tokens),
            predicted_ttft_ms: None,
            rejected,
        }
    }
}

/// Nearest-rank percentile of sorted values (None for no values).
fn pct(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let k = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[k.clamp(1, sorted.len()) - 1])
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

/// The figures of one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub requests: usize,
    pub completed: usize,
    pub rejected: usize,
    pub rejected_share: f64,
    pub ttft_mean_ms: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    /// Share of all requests (rejected ones included) served within every set SLO.
    pub goodput_share: f64,
    /// Those requests per second of the trace's span.
    pub goodput_rps: f64,
    /// Output tokens per second, from the first arrival to the last token.
    pub output_tok_s: f64,
    /// Cached prompt tokens / prompt tokens, over served requests.
    pub prefix_hit_rate: f64,
    pub preemptions: usize,
    /// Simulated seconds, first arrival to last token.
    pub makespan_s: f64,
}

impl Summary {
    pub fn of(records: &[RequestRecord], slo: Slo) -> Summary {
        let n = records.len();
        let served: Vec<&RequestRecord> = records.iter().filter(|r| !r.rejected && r.ttft_ms.is_some()).collect();
        let ttft = sorted(served.iter().filter_map(|r| r.ttft_ms).collect());
        let itl = sorted(served.iter().filter_map(|r| r.itl_ms).collect());
        let good = served
            .iter()
            .filter(|r| {
                slo.ttft_ms.is_none_or(|b| r.ttft_ms.is_some_and(|t| t <= b)) && slo.itl_ms.is_none_or(|b| r.itl_ms.is_none_or(|t| t <= b))
            })
            .count();
        let first = records.iter().map(|r| r.arrival_ms).fold(f64::INFINITY, f64::min);
        let last_arrival = records.iter().map(|r| r.arrival_ms).fold(f64::NEG_INFINITY, f64::max);
        let last_token = served.iter().filter_map(|r| r.last_token_ms).fold(f64::NEG_INFINITY, f64::max);
        let makespan_s = if n == 0 { 0.0 } else { (last_token.max(last_arrival) - first).max(0.0) / 1_000.0 };
        let span_s = if n == 0 { 0.0 } else { (last_arrival - first).max(0.0) / 1_000.0 };
        let input: usize = served.iter().map(|r| r.input_tokens).sum();
        let cached: usize = served.iter().map(|r| r.cached_tokens.min(r.input_tokens)).sum();
        let output: usize = served.iter().map(|r| r.output_tokens).sum();
        let rejected = records.iter().filter(|r| r.rejected).count();
        Summary {
            requests: n,
            completed: served.len(),
            rejected,
            rejected_share: if n == 0 { 0.0 } else { rejected as f64 / n as f64 },
            ttft_mean_ms: (!ttft.is_empty()).then(|| ttft.iter().sum::<f64>() / ttft.len() as f64),
            ttft_p50_ms: pct(&ttft, 50.0),
            ttft_p99_ms: pct(&ttft, 99.0),
            itl_p50_ms: pct(&itl, 50.0),
            itl_p99_ms: pct(&itl, 99.0),
            goodput_share: if n == 0 { 0.0 } else { good as f64 / n as f64 },
            goodput_rps: if span_s > 0.0 { good as f64 / span_s } else { 0.0 },
            output_tok_s: if makespan_s > 0.0 { output as f64 / makespan_s } else { 0.0 },
            prefix_hit_rate: if input == 0 { 0.0 } else { cached as f64 / input as f64 },
            preemptions: records.iter().map(|r| r.preemptions).sum(),
            makespan_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(arrival: f64, ttft: Option<f64>, itl: Option<f64>, rejected: bool) -> RequestRecord {
        RequestRecord {
            arrival_ms: arrival,
            ttft_ms: ttft,
            itl_ms: itl,
            last_token_ms: ttft.map(|t| arrival + t + 100.0),
            input_tokens: 1000,
            output_tokens: if rejected { 0 } else { 10 },
            cached_tokens: 250,
            preemptions: 1,
            prefill_worker: Some(0),
            decode_worker: Some(0),
            routed_overlap_tokens: None,
            predicted_ttft_ms: None,
            rejected,
        }
    }

    #[test]
    fn summary_counts_rejections_against_goodput_and_out_of_latency() {
        let recs = vec![
            rec(0.0, Some(100.0), Some(10.0), false),
            rec(1000.0, Some(300.0), Some(10.0), false),
            rec(2000.0, Some(200.0), Some(50.0), false),
            rec(3000.0, None, None, true),
        ];
        let s = Summary::of(&recs, Slo { ttft_ms: Some(250.0), itl_ms: Some(20.0) });
        assert_eq!((s.requests, s.completed, s.rejected), (4, 3, 1));
        assert_eq!(s.rejected_share, 0.25);
        // Only the first meets both: 1 of 4 offered.
        assert_eq!(s.goodput_share, 0.25);
        assert_eq!(s.ttft_p50_ms, Some(200.0));
        assert_eq!(s.ttft_p99_ms, Some(300.0));
        assert_eq!(s.ttft_mean_ms, Some(200.0));
        assert_eq!(s.prefix_hit_rate, 0.25);
        assert_eq!(s.preemptions, 4);
        // Goodput per second of the 3 s arrival span.
        assert!((s.goodput_rps - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn empty_run_has_no_percentiles() {
        let s = Summary::of(&[], Slo::default());
        assert_eq!(s.ttft_p50_ms, None);
        assert_eq!(s.requests, 0);
    }
}
