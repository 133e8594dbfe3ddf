//! The engine model's configuration: one simulated vLLM-style engine (scheduler, KV pool, timing),
//! lowered to AISimulate's `EngineConfig` and timing provider.

use std::sync::Arc;

use aisimulate_core::engine::{Backend, EngineConfig, TimingModel, TimingModelConfig};
use anyhow::{ensure, Result};
use serde::{Deserialize, Serialize};

/// Per-engine latency: AISimulate's built-in polynomial, or a fit of your own hardware.
///
/// `Polynomial` coefficients: prefill of a batch of `t` new tokens takes
/// `prefill_a * t^2 + prefill_b * t + prefill_c` ms; a decode step takes
/// `max(decode_min_ms, decode_a * u^2 + decode_b * u + decode_c)` ms, where `u` is the fraction of
/// the KV pool held by running requests. The built-in one (`Builtin`) has the same shape with
/// AISimulate's constants (see `BUILTIN`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Timing {
    /// AISimulate's default polynomial (`TimingModelConfig::Polynomial`).
    Builtin,
    /// Your own fit, same shape as the built-in one.
    Polynomial(PolyFit),
    /// Constant pass times (tests and parity checks).
    Fixed { prefill_ms: f64, decode_ms: f64 },
}

/// A polynomial fit of prefill and decode pass times; see `Timing`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolyFit {
    pub prefill_a: f64,
    pub prefill_b: f64,
    pub prefill_c: f64,
    pub decode_a: f64,
    pub decode_b: f64,
    pub decode_c: f64,
    #[serde(default = "one")]
    pub decode_min_ms: f64,
}

fn one() -> f64 {
    1.0
}

/// AISimulate 0.13's polynomial (`engine/common/perf_model.rs`), written out so the docs and the
/// Router's prefill speed can name it.
pub const BUILTIN: PolyFit = PolyFit {
    prefill_a: 4.209989e-07,
    prefill_b: 1.518344e-02,
    prefill_c: 1.650142e+01,
    decode_a: -25.74,
    decode_b: 54.01,
    decode_c: 5.74,
    decode_min_ms: 1.0,
};

impl PolyFit {
    fn check(&self) -> Result<()> {
        for (name, v) in [
            ("prefill_a", self.prefill_a),
            ("prefill_b", self.prefill_b),
            ("prefill_c", self.prefill_c),
            ("decode_a", self.decode_a),
            ("decode_b", self.decode_b),
            ("decode_c", self.decode_c),
            ("decode_min_ms", self.decode_min_ms),
        ] {
            ensure!(v.is_finite(), "timing.{name} must be a finite number, got {v}");
        }
        ensure!(self.decode_min_ms > 0.0, "timing.decode_min_ms must be > 0, got {}", self.decode_min_ms);
        // A prefill fit that predicts a negative or zero pass time somewhere in the range an engine
        // runs would stall the simulation; check both ends of that range (a decode step is held at
        // `decode_min_ms` or more).
        for t in [1.0, 131_072.0] {
            let ms = self.prefill_ms(t);
            ensure!(ms > 0.0, "timing: the prefill fit predicts {ms} ms for {t} tokens; expected > 0");
        }
        Ok(())
    }

    /// One prefill pass over `tokens` new tokens, ms.
    pub fn prefill_ms(&self, tokens: f64) -> f64 {
        if tokens <= 0.0 {
            return 0.0;
        }
        self.prefill_a * tokens * tokens + self.prefill_b * tokens + self.prefill_c
    }

    /// One decode step with `used` (0..=1) of the KV pool held by running requests, ms.
    pub fn decode_ms(&self, used: f64) -> f64 {
        let u = used.clamp(0.0, 1.0);
        (self.decode_a * u * u + self.decode_b * u + self.decode_c).max(self.decode_min_ms)
    }

    /// Marginal prefill speed for a prompt of `tokens`, tokens per second: what the Router is
    /// told as the worker's `prefill_tokens_per_s`.
    pub fn prefill_tokens_per_s(&self, tokens: f64) -> f64 {
        let t = tokens.max(1.0);
        t / self.prefill_ms(t) * 1_000.0
    }
}

struct PolyTiming(PolyFit);

impl TimingModel for PolyTiming {
    fn prefill_batch_validation_can_fail(&self) -> bool {
        false
    }
    fn prefill_prediction_can_fail(&self) -> bool {
        false
    }
    fn predict_prefill_ms(&self, batch_size: usize, mean_isl: usize, mean_prefix: usize) -> Result<f64> {
        Ok(self.0.prefill_ms((batch_size * mean_isl.saturating_sub(mean_prefix)) as f64))
    }
    fn predict_decode_ms(&self, batch_size: usize, active_kv_tokens: usize, _mean_context: usize, total_kv_tokens: usize) -> Result<f64> {
        if batch_size == 0 {
            return Ok(0.0);
        }
        let used = if total_kv_tokens == 0 { 1.0 } else { active_kv_tokens as f64 / total_kv_tokens as f64 };
        Ok(self.0.decode_ms(used))
    }
}

/// One simulated engine (every worker of a pool is alike).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineModel {
    /// Tokens per KV block; also the Router's block size.
    pub block_size: usize,
    /// KV pool size in blocks: running requests and the prefix cache share it.
    pub num_gpu_blocks: usize,
    /// Most requests running at once (vLLM `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Token budget of one scheduler step (vLLM `max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    pub enable_chunked_prefill: bool,
    pub enable_prefix_caching: bool,
    pub timing: Timing,
    /// KV bytes per token, for the prefill-to-decode transfer of a disaggregated run.
    pub kv_bytes_per_token: usize,
    /// Prefill-to-decode link bandwidth, GB/s (disaggregated runs).
    pub kv_transfer_gb_s: f64,
}

impl Default for EngineModel {
    /// AISimulate's vLLM defaults: 64-token blocks, 16,384 of them (1,048,576 tokens of KV),
    /// 256 sequences, an 8,192-token step budget, chunked prefill and prefix caching on, and the
    /// built-in polynomial timing; PD transfers of a Llama-3-70B-sized KV (80 layers x 8 KV heads
    /// x 128 dims x K and V x 2 bytes = 327,680 bytes per token) over 200 Gb/s (25 GB/s), the
    /// Router's own defaults.
    fn default() -> Self {
        EngineModel {
            block_size: 64,
            num_gpu_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8_192,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            timing: Timing::Builtin,
            kv_bytes_per_token: 327_680,
            kv_transfer_gb_s: 25.0,
        }
    }
}

impl EngineModel {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.block_size >= 1, "engine.block_size must be >= 1, got {}", self.block_size);
        ensure!(self.num_gpu_blocks >= 1, "engine.num_gpu_blocks must be >= 1, got {}", self.num_gpu_blocks);
        ensure!(self.max_num_seqs >= 1, "engine.max_num_seqs must be >= 1, got {}", self.max_num_seqs);
        ensure!(
            self.max_num_batched_tokens >= self.block_size,
            "engine.max_num_batched_tokens must be >= block_size ({}), got {}",
            self.block_size,
            self.max_num_batched_tokens
        );
        ensure!(self.kv_bytes_per_token >= 1, "engine.kv_bytes_per_token must be >= 1, got {}", self.kv_bytes_per_token);
        ensure!(
            self.kv_transfer_gb_s.is_finite() && self.kv_transfer_gb_s > 0.0,
            "engine.kv_transfer_gb_s must be a finite number > 0, got {}",
            self.kv_transfer_gb_s
        );
        match &self.timing {
            Timing::Builtin => {}
            Timing::Polynomial(fit) => fit.check()?,
            Timing::Fixed { prefill_ms, decode_ms } => {
                ensure!(
                    prefill_ms.is_finite() && *prefill_ms > 0.0 && decode_ms.is_finite() && *decode_ms > 0.0,
                    "timing: fixed prefill_ms and decode_ms must be finite and > 0, got {prefill_ms} and {decode_ms}"
                );
            }
        }
        Ok(())
    }

    /// The fit the Router's prefill speed is derived from.
    pub fn fit(&self) -> Option<PolyFit> {
        match &self.timing {
            Timing::Builtin => Some(BUILTIN),
            Timing::Polynomial(f) => Some(*f),
            Timing::Fixed { .. } => None,
        }
    }

    /// Prefill speed to register the workers with (tokens per second), at a typical prompt of
    /// `typical_tokens`: the fit's marginal speed there; for fixed timing, one budget per pass.
    pub fn prefill_tokens_per_s(&self, typical_tokens: f64) -> f64 {
        match &self.timing {
            Timing::Fixed { prefill_ms, .. } => self.max_num_batched_tokens as f64 / prefill_ms * 1_000.0,
            _ => self.fit().expect("polynomial").prefill_tokens_per_s(typical_tokens.min(self.max_num_batched_tokens as f64)),
        }
    }

    /// Decode step time at batch 0, seconds: the Router's `decode_step_s` for these engines.
    pub fn decode_step_s(&self) -> f64 {
        match &self.timing {
            Timing::Fixed { decode_ms, .. } => decode_ms / 1_000.0,
            _ => self.fit().expect("polynomial").decode_ms(0.0) / 1_000.0,
        }
    }

    /// The Router's decode speed for these engines, tokens per second, at a typical context of
    /// `typical_context` tokens per running request: the fit's decode step grows with the share
    /// `u` of the KV pool that running requests hold, about `decode_b * u` ms (its linear term),
    /// and `batch` such requests hold `u = batch * typical_context / pool tokens`, so one more
    /// request adds `decode_b * typical_context / pool_tokens` ms: the Router's `1 / decode_tokens_per_s`.
    /// None for fixed timing (a step does not grow with the batch).
    pub fn decode_tokens_per_s(&self, typical_context: f64) -> Option<f64> {
        let fit = self.fit()?;
        let pool = (self.num_gpu_blocks * self.block_size) as f64;
        (fit.decode_b > 0.0).then(|| pool / (fit.decode_b / 1_000.0 * typical_context.max(1.0)))
    }

    /// AISimulate's engine configuration; with `kv_events`, KV events and their token ids are on
    /// (the Router's index is fed from them).
    pub fn to_aisim(&self, kv_events: bool) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            enable_chunked_prefill: self.enable_chunked_prefill,
            enable_prefix_caching: self.enable_prefix_caching,
            emit_kv_events: kv_events,
            emit_kv_token_ids: kv_events,
            kv_transfer_bytes_per_token: Some(self.kv_bytes_per_token),
            kv_transfer_bandwidth: Some(self.kv_transfer_gb_s),
            timing_model: match &self.timing {
                Timing::Fixed { prefill_ms, decode_ms } => TimingModelConfig::Fixed { prefill_ms: *prefill_ms, decode_ms: *decode_ms },
                _ => TimingModelConfig::Polynomial,
            },
            ..EngineConfig::for_backend(Backend::Vllm)
        }
    }

    /// A timing provider when the fit is the user's own (the built-in and fixed ones are AISimulate's).
    pub fn timing_provider(&self) -> Option<Arc<dyn TimingModel>> {
        match &self.timing {
            Timing::Polynomial(fit) => Some(Arc::new(PolyTiming(*fit))),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_fit_matches_aisimulate_polynomial() {
        // The same numbers AISimulate's polynomial gives (perf_model.rs), so a Polynomial(BUILTIN)
        // run and a Builtin run time the same passes.
        let t = PolyTiming(BUILTIN);
        let ms = t.predict_prefill_ms(2, 4096, 96).unwrap();
        let tokens = 8000.0_f64;
        assert!((ms - (4.209989e-07 * tokens * tokens + 1.518344e-02 * tokens + 1.650142e+01)).abs() < 1e-9);
        assert_eq!(t.predict_decode_ms(0, 0, 0, 100).unwrap(), 0.0);
        assert!((t.predict_decode_ms(4, 50, 0, 100).unwrap() - (-25.74 * 0.25 + 54.01 * 0.5 + 5.74)).abs() < 1e-9);
    }

    #[test]
    fn bad_configs_are_refused_with_the_field_named() {
        let bad = EngineModel { num_gpu_blocks: 0, ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("num_gpu_blocks"));
        let neg = EngineModel { timing: Timing::Polynomial(PolyFit { prefill_c: -100.0, ..BUILTIN }), ..Default::default() };
        assert!(neg.validate().unwrap_err().to_string().contains("prefill fit"));
        let nan = EngineModel { timing: Timing::Fixed { prefill_ms: f64::NAN, decode_ms: 1.0 }, ..Default::default() };
        assert!(nan.validate().is_err());
        EngineModel::default().validate().unwrap();
    }

    #[test]
    fn engine_model_reads_from_json_with_defaults() {
        let m: EngineModel =
            serde_json::from_str(r#"{"num_gpu_blocks": 4096, "timing": {"kind": "fixed", "prefill_ms": 5, "decode_ms": 2}}"#).unwrap();
        assert_eq!(m.num_gpu_blocks, 4096);
        assert_eq!(m.block_size, 64);
        assert!(serde_json::from_str::<EngineModel>(r#"{"num_gpu_blockz": 1}"#).is_err());
    }
}
