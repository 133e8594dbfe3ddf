//! The learned TTFT model against an engine the router does not know.

use super::*;

/// A FIFO engine the router does not know: it prefills at `speed` tokens/s after `overhead` s per
/// request. Requests arrive every `gap` s with seeded lengths; the router hears `prefill_done`
/// at each true finish time, in time order with the arrivals.
fn drive_unknown_engine(model: TtftModel, speed: f64, overhead: f64, gap: f64, n: u64) -> Vec<(f64, f64)> {
    let cfg = router_config!(policy: "ttft", ttft_model: model, block_size: 32);
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap(); // registered at 20000 tokens/s
    let mut rng = crate::random::SplitMix64::new(7);
    let (mut busy, mut pending): (f64, Vec<(f64, u64)>) = (0.0, Vec::new());
    let mut out = Vec::new();
    for id in 0..n {
        let now = id as f64 * gap;
        pending.sort_by(|a, b| a.0.total_cmp(&b.0));
        while pending.first().is_some_and(|p| p.0 <= now) {
            let (t, rid) = pending.remove(0);
            r.prefill_done(rid, Some(t)).unwrap();
        }
        let toks = prompt(id as u32 + 1000, 64 + rng.below(1500) as usize);
        let d = r.route(&RouteRequest { tokens: Some(&toks), now: Some(now), request_id: Some(id), ..Default::default() }).unwrap();
        busy = busy.max(now) + overhead + toks.len() as f64 / speed;
        pending.push((busy, id));
        out.push((d.predicted_ttft, busy - now));
    }
    out
}

#[test]
fn learned_ttft_model_finds_an_engines_speed_and_overhead() {
    // 2000 tokens/s (10x slower than registered) and 30 ms per request, loaded ~50% (mean ~780
    // tokens = 0.42 s every 0.8 s): queues form and drain, and the fit sees each prefill's work.
    let learned = drive_unknown_engine(TtftModel::Learned, 2000.0, 0.03, 0.8, 400);
    let configured = drive_unknown_engine(TtftModel::Configured, 2000.0, 0.03, 0.8, 400);
    let err = |v: &[(f64, f64)]| v[200..].iter().map(|(p, m)| (p - m).abs()).sum::<f64>() / 200.0;
    let mean = configured[200..].iter().map(|x| x.1).sum::<f64>() / 200.0;
    // Configured: 20000 tokens/s predicts a tenth of the prefill time (the queue it corrects by
    // prefill_done's feedback, but not the work of the request itself).
    assert!(err(&configured) > 0.25 * mean, "configured error {} vs mean TTFT {mean}", err(&configured));
    // Learned: the FIFO engine's exact service time, so the virtual queue is exact too.
    assert!(err(&learned) < 1e-6, "learned error {} vs mean TTFT {mean}", err(&learned));
    assert_eq!(RouterConfig::default().ttft_model, TtftModel::Configured);
    let r = Router::new(router_config!(ttft_model: TtftModel::Learned), None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    assert!(r.load(0).unwrap().prefill_fit.fitted.is_none(), "no samples, no fit");
}

#[test]
fn prefill_fit_waits_for_samples_and_keeps_a_sane_shape() {
    let mut f = PrefillFit::default();
    for _ in 0..PrefillFit::MIN_SAMPLES - 1 {
        f.add(1000.0, 0.5, 1e-4);
    }
    assert!(f.fitted.is_none());
    // Every x equal: no slope to see; the configured slope stays, the rest is overhead.
    f.add(1000.0, 0.5, 1e-4);
    let (a, b) = f.fitted.unwrap();
    assert_eq!(b, 1e-4);
    assert!((a - 0.4).abs() < 1e-9, "{a}");
    // Exact line y = 0.02 + x / 5000 over spread x: recovered.
    let mut g = PrefillFit::default();
    for i in 0..100 {
        let x = (i * 37 % 2000) as f64;
        g.add(x, 0.02 + x / 5000.0, 1e-4);
    }
    let (a, b) = g.fitted.unwrap();
    assert!((a - 0.02).abs() < 1e-9 && (b - 2e-4).abs() < 1e-12, "{a} {b}");
    // Pure noise around a constant (no dependence on x): no evidence of a slope, so the
    // configured one stays and the overhead takes what it leaves of the mean; when the configured
    // slope already predicts more than measured, the engine is faster than registered and the
    // samples are all work (through the origin).
    let noise = |prior: f64| {
        let mut n = PrefillFit::default();
        let mut rng = crate::random::SplitMix64::new(11);
        for i in 0..200 {
            n.add((i * 37 % 2000) as f64, 0.003 + 0.002 * rng.next_f64(), prior);
        }
        n.fitted.unwrap()
    };
    let (a, b) = noise(1e-4);
    assert!(a == 0.0 && b > 1e-6 && b < 1e-5, "{a} {b}");
    let (a, b) = noise(1e-7);
    assert!(b == 1e-7 && a > 0.003 && a < 0.005, "{a} {b}");
    // A weak positive slope under heavy noise is not evidence either.
    let mut weak = PrefillFit::default();
    let mut rng = crate::random::SplitMix64::new(5);
    for i in 0..200 {
        let x = (i * 37 % 2000) as f64;
        weak.add(x, 0.01 + 1e-8 * x + 0.02 * rng.next_f64(), 1e-6);
    }
    assert_eq!(weak.fitted.unwrap().1, 1e-6);
    // Garbage samples are ignored, never a NaN in the model.
    g.add(f64::NAN, 1.0, 1e-4);
    g.add(10.0, -1.0, 1e-4);
    assert_eq!(g.samples(), 100);
    // A slope that would need a negative overhead goes through the origin instead.
    let mut h = PrefillFit::default();
    for i in 0..50 {
        let x = 1000.0 + (i % 10) as f64 * 100.0;
        h.add(x, (x - 900.0) / 1000.0, 1e-6);
    }
    let (a, b) = h.fitted.unwrap();
    assert!(a >= 0.0 && b > 0.0, "{a} {b}");
}

#[test]
fn deployed_presets_learn_and_the_simulator_is_told() {
    assert_eq!(RouterConfig::preset(Preset::Simulator).ttft_model, TtftModel::Configured);
    for p in [Preset::Gateway, Preset::GatewayApprox, Preset::HostRouter] {
        assert_eq!(RouterConfig::preset(p).ttft_model, TtftModel::Learned, "{p:?}");
    }
}

#[test]
fn a_learned_model_rejects_only_once_it_has_measured_the_worker() {
    // The prior (20,000 tokens/s) says a 4,000-token prompt takes 0.2 s, over a 0.1 s SLO. The
    // configured model rejects it on that guess; the learned one admits it while it has no
    // measurements, and rejects once the worker's prefills show it really is that slow.
    let toks = prompt(1, 4000);
    let configured = Router::new(router_config!(ttft_slo: 0.1, ttft_model: TtftModel::Configured), None).unwrap();
    configured.add_worker(0, WorkerSpec::default()).unwrap();
    assert!(!route(&configured, &toks, 0.0).admitted);

    let r = Router::new(router_config!(ttft_slo: 0.1, ttft_model: TtftModel::Learned), None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    let mut now = 0.0;
    for id in 0..PrefillFit::MIN_SAMPLES {
        let d = r
            .route(&RouteRequest {
                tokens: Some(&prompt(100 + id as u32, 2000)),
                now: Some(now),
                request_id: Some(id),
                ..Default::default()
            })
            .unwrap();
        assert!(d.admitted, "request {id} rejected on the prior alone");
        // 2,000 tokens served in 0.1 s each time: 20,000 tokens/s measured.
        r.prefill_done(id, Some(now + 0.1)).unwrap();
        now += 0.5;
    }
    assert!(r.load(0).unwrap().prefill_fit.fitted.is_some());
    assert!(!route(&r, &toks, now + 10.0).admitted, "measured: 4,000 tokens take 0.2 s, over the SLO");
}

#[test]
fn a_worker_with_no_samples_predicts_with_the_pools_fit() {
    // Four workers registered at the prior (20,000 tokens/s) on engines that run at 50,000.
    // Worker 0 alone is measured; the others have no samples of their own and predict with the
    // pool's fit, so they look as fast as worker 0, not 2.5x slower (which left them idle).
    let r = Router::new(router_config!(policy: "ttft", ttft_model: TtftModel::Learned), None).unwrap();
    for w in 0..4 {
        r.add_worker(w, WorkerSpec::default()).unwrap();
    }
    let mut now = 0.0;
    for id in 0..2 * PrefillFit::MIN_SAMPLES {
        let n = 1000 + 250 * (id as usize % 8);
        let d = r
            .route(&RouteRequest {
                tokens: Some(&prompt(500 + id as u32, n)),
                now: Some(now),
                request_id: Some(id),
                workers: Some(&[0]),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(d.worker, 0);
        r.prefill_done(id, Some(now + n as f64 / 50_000.0)).unwrap();
        now += 1.0;
    }
    let measured = r.load(0).unwrap();
    assert!((measured.prefill_speed() - 50_000.0).abs() < 1.0, "{}", measured.prefill_speed());
    for w in 1..4 {
        let l = r.load(w).unwrap();
        assert_eq!(l.prefill_fit.samples(), 0);
        assert!((l.prefill_speed() - 50_000.0).abs() < 1.0, "worker {w}: {}", l.prefill_speed());
    }
    // A worker registered twice as fast is predicted twice as fast as the pool (the pool learns
    // how the engines run against what they were registered at), and one joining now starts there.
    r.add_worker(9, WorkerSpec { prefill_tokens_per_s: 40_000.0, ..WorkerSpec::default() }).unwrap();
    assert!((r.load(9).unwrap().prefill_speed() - 100_000.0).abs() < 2.0);
    // And a prompt no worker caches goes to an idle unmeasured worker, not behind the measured one.
    let d =
        r.route(&RouteRequest { tokens: Some(&prompt(9_999, 4000)), now: Some(now), request_id: Some(999), ..Default::default() }).unwrap();
    assert_eq!(d.worker, 9, "the fastest idle worker");
}

#[test]
fn a_worker_whose_prefills_start_late_is_predicted_late() {
    // Two engines at the registered speed, measured; then worker 0's starts every prefill 1 s
    // after it arrives (its KV is full: it waits for room, which the virtual queue does not see).
    let r = Router::new(router_config!(policy: "ttft", ttft_model: TtftModel::Learned), None).unwrap();
    for w in 0..2 {
        r.add_worker(w, WorkerSpec::default()).unwrap();
    }
    let mut now = 0.0;
    let on_time = 4 * PrefillFit::MIN_SAMPLES;
    for id in 0..on_time + 24 {
        let w = id % 2;
        let n = 1000 + 500 * (id as usize % 4);
        r.route(&RouteRequest {
            tokens: Some(&prompt(700 + id as u32, n)),
            now: Some(now),
            request_id: Some(id),
            workers: Some(&[w]),
            ..Default::default()
        })
        .unwrap();
        let late = if w == 0 && id >= on_time { 1.0 } else { 0.0 };
        r.prefill_done(id, Some(now + late + n as f64 / 20_000.0)).unwrap();
        now += 5.0;
        if id + 1 == on_time {
            assert_eq!(r.load(0).unwrap().lateness, 0.0, "on time: nothing missed");
        }
    }
    let (slow, fast) = (r.load(0).unwrap(), r.load(1).unwrap());
    assert!(slow.lateness > 0.3, "{}", slow.lateness);
    assert_eq!(fast.lateness, 0.0);
    let predicted = slow.lateness + slow.prefill_time(1000);
    assert!((0.5..1.2).contains(&predicted), "{predicted}");
    // A prompt for worker 0 is predicted its lateness on top of its fit.
    let p = prompt(9_000, 2048);
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(now), workers: Some(&[0]), ..Default::default() }).unwrap();
    let expected = slow.lateness + slow.prefill_time(2048);
    assert!((d.predicted_ttft - expected).abs() < 1e-9, "{} vs {expected}", d.predicted_ttft);
    // The configured model learns no lateness.
    let c = Router::new(router_config!(policy: "ttft", ttft_model: TtftModel::Configured), None).unwrap();
    c.add_worker(0, WorkerSpec::default()).unwrap();
    c.route(&RouteRequest { tokens: Some(&prompt(1, 1000)), now: Some(0.0), request_id: Some(1), ..Default::default() }).unwrap();
    c.prefill_done(1, Some(2.0)).unwrap();
    assert_eq!(c.load(0).unwrap().lateness, 0.0);
}
