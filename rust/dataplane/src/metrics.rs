//! The gateway's counters and their Prometheus text exposition (`/metrics`): requests, rejections,
//! retries, upstream errors, tokens, per-worker gauges (engine load as observed) and routing time.

use std::collections::HashMap;
use std::fmt::Write;

use kvroute_core::router::Observed;
use parking_lot::Mutex;

use crate::plane::WorkerRow;

/// Routing latency buckets (seconds): tokenize/hash and route take microseconds; 10 us .. 100 ms.
pub const ROUTING_BUCKETS: [f64; 12] = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1];
/// `ROUTING_BUCKETS` as their `le` labels.
const ROUTING_LABELS: [&str; 12] =
    ["1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.1"];

/// A copy of the counters at one moment.
#[derive(Clone, Debug, Default)]
pub struct MetricsSnapshot {
    /// (endpoint, status class such as "2xx" or "disconnected") -> requests answered.
    pub requests: HashMap<(String, String), u64>,
    /// Requests turned away early (429), by reason.
    pub rejections: HashMap<String, u64>,
    pub retries: u64,
    /// Failed dispatches by worker url.
    pub upstream_errors: HashMap<String, u64>,
    pub client_disconnects: u64,
    /// Endpoint picker: requests Envoy served from a fallback endpoint instead of the pick.
    pub fallbacks_served: u64,
    /// Endpoint picker: leases ended by their TTL (the gateway never reported the response's end).
    pub leases_expired: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Per bucket of `ROUTING_BUCKETS`, plus the +Inf bucket (not cumulative).
    pub routing_counts: Vec<u64>,
    pub routing_sum: f64,
    pub routing_count: u64,
}

/// One lock around all counters: each request takes it a few times, far below its other costs.
pub struct Metrics {
    inner: Mutex<MetricsSnapshot>,
}

impl Default for Metrics {
    fn default() -> Self {
        let s = MetricsSnapshot { routing_counts: vec![0; ROUTING_BUCKETS.len() + 1], ..Default::default() };
        Metrics { inner: Mutex::new(s) }
    }
}

impl Metrics {
    pub fn request(&self, endpoint: &str, class: &str) {
        let mut g = self.inner.lock();
        if let Some(n) = g.requests.get_mut(&(endpoint.to_string(), class.to_string())) {
            *n += 1;
        } else {
            g.requests.insert((endpoint.to_string(), class.to_string()), 1);
        }
    }

    pub fn disconnect(&self, endpoint: &str) {
        self.request(endpoint, "disconnected");
        self.inner.lock().client_disconnects += 1;
    }

    pub fn rejection(&self, reason: &str) {
        *self.inner.lock().rejections.entry(reason.to_string()).or_insert(0) += 1;
    }

    pub fn fallback_served(&self) {
        self.inner.lock().fallbacks_served += 1;
    }

    pub fn lease_expired(&self) {
        self.inner.lock().leases_expired += 1;
    }

    pub fn retry(&self) {
        self.inner.lock().retries += 1;
    }

    pub fn upstream_error(&self, url: &str) {
        *self.inner.lock().upstream_errors.entry(url.to_string()).or_insert(0) += 1;
    }

    /// One admitted dispatch: its prompt and (predicted) cached token counts.
    pub fn tokens(&self, prompt_tokens: u64, cached_tokens: u64) {
        let mut g = self.inner.lock();
        g.prompt_tokens += prompt_tokens;
        g.cached_tokens += cached_tokens;
    }

    /// Time to hash and route one request (its first attempt).
    pub fn routing_time(&self, seconds: f64) {
        let mut g = self.inner.lock();
        let b = ROUTING_BUCKETS.partition_point(|&bound| bound < seconds);
        g.routing_counts[b] += 1;
        g.routing_sum += seconds;
        g.routing_count += 1;
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        self.inner.lock().clone()
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Exact mode's prefix store (src/exact/reuse.rs).
pub fn render_reuse(out: &mut String, r: &crate::exact::ReuseStats) {
    header(
        out,
        "kvroute_prefix_reuse_total",
        "counter",
        "Exact mode: long chat prompts whose tokenization reused an earlier prompt's encoded prefix (hit) or found none (miss).",
    );
    let _ = writeln!(out, "kvroute_prefix_reuse_total{{outcome=\"hit\"}} {}", r.hits);
    let _ = writeln!(out, "kvroute_prefix_reuse_total{{outcome=\"miss\"}} {}", r.misses);
    header(out, "kvroute_prefix_reuse_tokens", "gauge", "Exact mode: token ids the prefix store holds.");
    let _ = writeln!(out, "kvroute_prefix_reuse_tokens {}", r.tokens);
}

/// The self-check's series (docs/events.md, "The self-check").
pub fn render_check(out: &mut String, c: &kvroute_core::check::CheckSnapshot) {
    use kvroute_core::check::Outcome;
    header(
        out,
        "kvroute_prefix_check_total",
        "counter",
        "Requests whose engine usage was checked against the predicted prefix hit, by outcome (match, over, under, prompt_length).",
    );
    for o in Outcome::ALL {
        let _ = writeln!(out, "kvroute_prefix_check_total{{outcome=\"{}\"}} {}", o.name(), c.outcomes[o as usize]);
    }
    header(
        out,
        "kvroute_prefix_check_error_tokens_total",
        "counter",
        "Prompt tokens predicted cached but not reused (over) or reused but not predicted (under).",
    );
    let _ = writeln!(out, "kvroute_prefix_check_error_tokens_total{{direction=\"over\"}} {}", c.over_tokens);
    let _ = writeln!(out, "kvroute_prefix_check_error_tokens_total{{direction=\"under\"}} {}", c.under_tokens);
    header(
        out,
        "kvroute_prefix_check_alarms_total",
        "counter",
        "Self-check alarms raised (each logged once as a WARNING naming the likely cause).",
    );
    let _ = writeln!(out, "kvroute_prefix_check_alarms_total {}", c.alarms);
    header(out, "kvroute_prefix_check_alarm", "gauge", "1 while the self-check's alarm is up.");
    let _ = writeln!(out, "kvroute_prefix_check_alarm {}", u8::from(c.alarmed));
}

/// The Prometheus text exposition of `m` and the workers' rows (with what each engine last
/// reported through `Router.observe`, when it did).
pub fn render_metrics(m: &MetricsSnapshot, workers: &[(WorkerRow, Option<Observed>)]) -> String {
    let mut out = String::with_capacity(4096);
    header(&mut out, "kvroute_requests_total", "counter", "Requests answered, by endpoint and HTTP status class.");
    let mut requests: Vec<_> = m.requests.iter().collect();
    requests.sort();
    for ((endpoint, status), n) in requests {
        let _ = writeln!(out, "kvroute_requests_total{{endpoint=\"{}\",status=\"{}\"}} {n}", escape(endpoint), escape(status));
    }
    let labelled = |out: &mut String, name: &str, label: &str, help: &str, series: &HashMap<String, u64>| {
        header(out, name, "counter", help);
        let mut rows: Vec<_> = series.iter().collect();
        rows.sort();
        for (k, n) in rows {
            let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {n}", escape(k));
        }
    };
    labelled(&mut out, "kvroute_rejections_total", "reason", "Requests turned away early (HTTP 429), by reason.", &m.rejections);
    header(
        &mut out,
        "kvroute_retries_total",
        "counter",
        "Dispatches retried on another worker after a failure before any byte reached the client.",
    );
    let _ = writeln!(out, "kvroute_retries_total {}", m.retries);
    labelled(
        &mut out,
        "kvroute_upstream_errors_total",
        "worker",
        "Failed dispatches (connection refused/reset, 5xx, broken stream, failed health probe), by worker.",
        &m.upstream_errors,
    );
    header(
        &mut out,
        "kvroute_client_disconnects_total",
        "counter",
        "Requests whose client went away; their upstream request was cancelled.",
    );
    let _ = writeln!(out, "kvroute_client_disconnects_total {}", m.client_disconnects);
    header(
        &mut out,
        "kvroute_epp_fallbacks_served_total",
        "counter",
        "Endpoint picker: requests the gateway served from a fallback endpoint instead of the pick (its load moved there).",
    );
    let _ = writeln!(out, "kvroute_epp_fallbacks_served_total {}", m.fallbacks_served);
    header(
        &mut out,
        "kvroute_epp_leases_expired_total",
        "counter",
        "Endpoint picker: routed requests whose load was released by the lease TTL, the gateway never having reported their end.",
    );
    let _ = writeln!(out, "kvroute_epp_leases_expired_total {}", m.leases_expired);
    header(&mut out, "kvroute_prompt_tokens_total", "counter", "Prompt tokens routed (approximate mode: estimated from bytes).");
    let _ = writeln!(out, "kvroute_prompt_tokens_total {}", m.prompt_tokens);
    header(&mut out, "kvroute_cached_tokens_total", "counter", "Prompt tokens the router expected the chosen worker to have cached.");
    let _ = writeln!(out, "kvroute_cached_tokens_total {}", m.cached_tokens);
    let hit = if m.prompt_tokens > 0 { m.cached_tokens as f64 / m.prompt_tokens as f64 } else { 0.0 };
    header(&mut out, "kvroute_cache_hit_ratio", "gauge", "Estimated prefix-cache hit rate: cached / prompt tokens since start.");
    let _ = writeln!(out, "kvroute_cache_hit_ratio {hit}");
    let per_worker =
        |out: &mut String, name: &str, kind: &str, help: &str, value: &dyn Fn(&WorkerRow, Option<&Observed>) -> Option<String>| {
            header(out, name, kind, help);
            for (w, o) in workers {
                if let Some(v) = value(w, o.as_ref()) {
                    let _ = writeln!(out, "{name}{{worker=\"{}\",role=\"{}\"}} {v}", escape(&w.url), w.role.name());
                }
            }
        };
    per_worker(&mut out, "kvroute_worker_in_flight", "gauge", "Requests the gateway has in flight on each worker.", &|w, _| {
        Some(w.in_flight.to_string())
    });
    per_worker(
        &mut out,
        "kvroute_worker_healthy",
        "gauge",
        "1 while a worker is routed to, 0 while it is marked unhealthy and probed.",
        &|w, _| Some(u8::from(w.healthy).to_string()),
    );
    per_worker(&mut out, "kvroute_worker_requests_total", "counter", "Requests dispatched to each worker.", &|w, _| {
        Some(w.served.to_string())
    });
    per_worker(
        &mut out,
        "kvroute_worker_observed_waiting",
        "gauge",
        "Requests waiting in each engine's queue, as its /metrics last reported (--metrics-interval).",
        &|_, o| o.and_then(|o| o.waiting).map(|v| v.to_string()),
    );
    per_worker(
        &mut out,
        "kvroute_worker_observed_running",
        "gauge",
        "Requests running on each engine, as its /metrics last reported (--metrics-interval).",
        &|_, o| o.and_then(|o| o.running).map(|v| v.to_string()),
    );
    per_worker(
        &mut out,
        "kvroute_worker_observed_kv_usage",
        "gauge",
        "Each engine's KV cache usage (0..1), as its /metrics last reported (--metrics-interval).",
        &|_, o| o.and_then(|o| o.kv_usage).map(|v| v.to_string()),
    );
    header(&mut out, "kvroute_routing_seconds", "histogram", "Time to tokenize/hash and route one request.");
    let mut cum = 0;
    for (label, n) in ROUTING_LABELS.iter().zip(&m.routing_counts) {
        cum += n;
        let _ = writeln!(out, "kvroute_routing_seconds_bucket{{le=\"{label}\"}} {cum}");
    }
    let _ = writeln!(out, "kvroute_routing_seconds_bucket{{le=\"+Inf\"}} {}", m.routing_count);
    let _ = writeln!(out, "kvroute_routing_seconds_sum {}", m.routing_sum);
    let _ = writeln!(out, "kvroute_routing_seconds_count {}", m.routing_count);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_bisect_left() {
        let m = Metrics::default();
        m.routing_time(1e-5); // on a bound: that bucket (Python's bisect_left)
        m.routing_time(3e-5);
        m.routing_time(1.0);
        m.tokens(10, 4);
        m.tokens(10, 0);
        let s = m.snapshot();
        assert_eq!(s.routing_counts[0], 1);
        assert_eq!(s.routing_counts[2], 1);
        assert_eq!(s.routing_counts[ROUTING_BUCKETS.len()], 1);
        assert_eq!((s.routing_count, s.prompt_tokens, s.cached_tokens), (3, 20, 4));
    }

    #[test]
    fn exposition_sorts_series_and_shows_observed_load() {
        let m = Metrics::default();
        m.upstream_error("http://b:1");
        m.upstream_error("http://b:1");
        m.upstream_error("http://a:1");
        m.rejection("slo");
        m.rejection("client_concurrency");
        m.request("/v1/completions", "2xx");
        m.routing_time(3e-5);
        let row = |id, url: &str| WorkerRow {
            id,
            url: url.into(),
            role: kvroute_core::router::Role::Both,
            bootstrap_port: None,
            healthy: id == 0,
            in_flight: 2,
            served: 5,
        };
        let seen = Observed { waiting: Some(3), running: Some(1), kv_usage: Some(0.25) };
        let text = render_metrics(&m.snapshot(), &[(row(0, "http://a:1"), Some(seen)), (row(1, "http://b:1"), None)]);
        assert!(
            text.contains(
                "kvroute_upstream_errors_total{worker=\"http://a:1\"} 1\nkvroute_upstream_errors_total{worker=\"http://b:1\"} 2\n"
            ),
            "{text}"
        );
        assert!(text.contains("kvroute_rejections_total{reason=\"client_concurrency\"} 1\nkvroute_rejections_total{reason=\"slo\"} 1\n"));
        assert!(text.contains("kvroute_requests_total{endpoint=\"/v1/completions\",status=\"2xx\"} 1\n"));
        assert!(text.contains("kvroute_worker_healthy{worker=\"http://a:1\",role=\"both\"} 1\nkvroute_worker_healthy{worker=\"http://b:1\",role=\"both\"} 0\n"));
        assert!(
            text.contains("kvroute_worker_observed_waiting{worker=\"http://a:1\",role=\"both\"} 3\n# HELP"),
            "only workers that reported"
        );
        assert!(text.contains("kvroute_worker_observed_kv_usage{worker=\"http://a:1\",role=\"both\"} 0.25\n"));
        assert!(text.contains("kvroute_routing_seconds_bucket{le=\"2.5e-05\"} 0\nkvroute_routing_seconds_bucket{le=\"5e-05\"} 1\n"));
        assert!(text.contains("kvroute_routing_seconds_count 1\n"));
    }
}
