//! The data plane's counters, in the shape of the Python gateway's `GatewayMetrics`, so `/metrics`
//! (rendered by Python) can fold them in.

use std::collections::HashMap;

use parking_lot::Mutex;

/// Routing latency buckets (seconds): the Python gateway's `ROUTING_BUCKETS`.
pub const ROUTING_BUCKETS: [f64; 12] = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1];

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
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Per bucket of `ROUTING_BUCKETS`, plus the +Inf bucket (not cumulative).
    pub routing_counts: Vec<u64>,
    pub routing_sum: f64,
    pub routing_count: u64,
    /// Requests forwarded to the Python gateway (not counted in `requests`: Python counts them).
    pub forwarded: u64,
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

    pub fn retry(&self) {
        self.inner.lock().retries += 1;
    }

    pub fn upstream_error(&self, url: &str) {
        *self.inner.lock().upstream_errors.entry(url.to_string()).or_insert(0) += 1;
    }

    pub fn forwarded(&self) {
        self.inner.lock().forwarded += 1;
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
}
