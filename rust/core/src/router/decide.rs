//! One routing decision, in stages: the workers' overlaps (index and pending prefixes), the decode
//! side, the prefill candidates, the policy's choice under admission, and admitting the request.

use hashbrown::HashMap;

use super::decode_worker::{self, choose_decode, DecodeChoice};
use super::policy::{admission_ttft, pick_min, Ctx};
use super::{
    decay_since, share, stale, InFlight, Path, Reason, Role, RouteRequest, Router, RouterConfig, RouterError, State, TtftModel, WorkerLoad,
};
use super::{Candidate, Decision, WorkerBreakdown};
use crate::index::{Matches, WorkerId};

/// What a decision knows about its request once the workers' overlaps are in.
struct Ask<'r, 'a> {
    now: f64,
    num_tokens: u64,
    /// KV blocks the request takes (prompt and output).
    kv_need: u64,
    /// PD mode (some worker is decode-only).
    pd: bool,
    /// The pinned worker's position.
    pinned: Option<usize>,
    /// Whether `State::allowed` restricts the workers (`RouteRequest::workers`).
    restricted: bool,
    /// Whether `State::indexed_blocks` was read for this request.
    occupancy: bool,
    req: &'r RouteRequest<'a>,
    hashes: &'r [u64],
    matches: &'r Matches,
}

/// The decode side's verdict (PD mode; empty in unified mode).
#[derive(Default)]
struct DecodeSide {
    /// Position of the decode worker.
    at: Option<usize>,
    tpot: Option<f64>,
    /// Why and at which worker the decode side turns the request away (with rejection on).
    reject: Option<(Reason, usize)>,
}

/// Unified mode: prefill candidates left out for the decode side, and the reason to give.
struct Filtered {
    count: usize,
    reason: Reason,
}

/// What `choose` decided.
#[allow(clippy::large_enum_variant)] // one per decision, on the stack: boxing would allocate per rejection
enum Chosen {
    Worker(Choice),
    Rejected(Decision),
}

/// The prefill worker chosen, why, the path, and where its prefix is fetched from.
struct Choice {
    c: Candidate,
    reason: Reason,
    path: Path,
    fetch_from: Option<WorkerId>,
}

impl Router {
    /// `indexed`: the blocks the index holds for `w` (read only where the capacity charge is on).
    fn candidate(&self, w: &WorkerLoad, overlap: u32, now: f64, num_tokens: u64, transfer_time: f64, indexed: u64) -> Candidate {
        let cached = (overlap as u64 * self.cfg.block_size as u64).min(num_tokens);
        let uncached = num_tokens - cached;
        // The learned model's lateness: what the queue has been missing here lately.
        let queue_delay = w.queue_delay(now) + w.lateness;
        let prefill_time = w.prefill_time(uncached);
        let stored = (num_tokens / self.cfg.block_size as u64).saturating_sub(overlap as u64);
        let needs = self.needs;
        let (evicted, fill) = match w.spec.prefix_cache_blocks {
            // A 0-block cache (prefix caching off) holds nothing to evict and no room a copy takes.
            Some(capacity) if capacity > 0 && needs.evictions => {
                // The index counts the cached blocks the engine's KV events reported. An engine's
                // own usage cannot replace it: vLLM's kv_cache_usage_perc counts the blocks running
                // requests hold, and a cached block no request holds counts as free (it sits in the
                // free queue until evicted), so a warm LRU that is full of cached prefixes reports
                // near 0. What the usage adds is blocks held but not (yet) cached, so the occupancy
                // is the larger of the two.
                let used = match w.observed.kv_usage {
                    Some(u) if needs.usage_occupancy => indexed.max((u * capacity as f64).round() as u64),
                    _ => indexed,
                };
                // The engine stores the full blocks it lacks; an LRU at capacity evicts as many.
                let evicted = (used + stored).saturating_sub(capacity).min(stored);
                (evicted, (used as f64 / capacity as f64).min(1.0))
            }
            _ => (0, 0.0),
        };
        let evict_time = if needs.evict_time { w.token_time(evicted * self.cfg.block_size as u64) } else { 0.0 };
        let step_time = w.step_time(self.cfg.decode.step_s);
        Candidate {
            worker: w.id,
            overlap_blocks: overlap,
            uncached_tokens: uncached,
            busy_until: w.busy_until,
            queue_delay,
            prefill_time,
            transfer_time,
            step_time,
            // The seed's ttft(i): max(busy - t, 0) + (len - hit) / SPEED, in that order (its
            // prefill instances decode nothing: step_time is 0 there).
            predicted_ttft: queue_delay + prefill_time + transfer_time + step_time,
            in_flight: w.in_flight(),
            queued: w.prefilling.max(w.observed.waiting.unwrap_or(0)),
            prefill_speed: w.prefill_speed(),
            prefill_tokens: w.prefill_tokens,
            decode_blocks: w.decode_blocks,
            evict_time,
            stored_blocks: if needs.eviction_reuse { stored } else { 0 },
            evicted_blocks: evicted,
            cache_fill: fill,
            score: 0.0,
        }
    }

    pub(super) fn decide(
        &self,
        now: f64,
        num_tokens: u64,
        req: &RouteRequest<'_>,
        hashes: &[u64],
        matches: &Matches,
    ) -> Result<Decision, RouterError> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let ask = self.ask(st, now, num_tokens, req, hashes, matches)?;
        let mut decode = self.decode_side(st, &ask)?;
        let filtered = self.prefill_candidates(st, &ask, decode.at)?;
        let (_, rho_evident) = Self::record_offered(st, &self.cfg, now, num_tokens);
        let reuse = if self.needs.eviction_reuse { Self::record_reuse(st, &self.cfg, now, hashes) } else { 0.0 };
        if st.cands.is_empty() && filtered.count == 0 {
            return Err(RouterError::NoWorkers("no worker can prefill (all are decode-only)".into()));
        }
        if let Some(rejected) = self.decode_rejection(st, &ask, &mut decode, filtered)? {
            return Ok(rejected);
        }
        match self.choose(st, &ask, &decode, rho_evident, reuse) {
            Chosen::Rejected(rejected) => Ok(rejected),
            Chosen::Worker(choice) => Ok(self.admit(st, &ask, decode, choice)),
        }
    }

    /// Checks the request against the router's state and fills each worker's overlap: its index
    /// prefix, continued by the blocks pending there; and the workers' occupancy where needed.
    fn ask<'r, 'a>(
        &self,
        st: &mut State,
        now: f64,
        num_tokens: u64,
        req: &'r RouteRequest<'a>,
        hashes: &'r [u64],
        matches: &'r Matches,
    ) -> Result<Ask<'r, 'a>, RouterError> {
        if st.workers.is_empty() {
            return Err(RouterError::NoWorkers("none registered (call add_worker)".into()));
        }
        if let Some(id) = req.request_id {
            if st.requests.contains_key(&id) {
                return Err(RouterError::DuplicateRequest(id));
            }
        }
        let pinned = match req.pin {
            Some(p) => Some(*st.pos.get(&p).ok_or(RouterError::UnknownWorker(p))?),
            None => None,
        };
        let restricted = req.workers.is_some();
        if let Some(ws) = req.workers {
            st.allowed.clear();
            st.allowed.resize(st.workers.len(), false);
            let mut any = false;
            for w in ws {
                if let Some(&at) = st.pos.get(w) {
                    st.allowed[at] = true;
                    any = true;
                }
            }
            if !any {
                return Err(RouterError::NoWorkers(format!("none of the {} workers this request may use is registered", ws.len())));
            }
            if let Some(p) = pinned.filter(|&p| !st.allowed[p]) {
                return Err(RouterError::InvalidArgument(format!("worker {} is pinned but not among the workers given", st.workers[p].id)));
            }
        }
        st.overlaps.clear();
        st.overlaps.resize(st.workers.len(), 0);
        for (w, &d) in matches.workers.iter().zip(&matches.depths) {
            if let Some(&at) = st.pos.get(w) {
                st.overlaps[at] = d;
            }
        }
        self.drain_removals(st, now);
        if self.cfg.cache_view.pending_prefixes {
            // A worker's overlap: its index prefix, continued by the blocks pending there (an entry
            // holds only what the index lacked when it was routed). Workers without an index
            // prefix share one walk from block 0; each worker with one continues from its end.
            let State { pending, pending_alive, overlaps, pos, .. } = st;
            pending.overlaps(hashes, pending_alive, |w, d| {
                if let Some(&at) = pos.get(&w) {
                    overlaps[at] = overlaps[at].max(d);
                }
            });
            for (w, &d) in matches.workers.iter().zip(&matches.depths) {
                if let Some(&at) = pos.get(w) {
                    overlaps[at] = overlaps[at].max(d + pending.run_from(hashes, d as usize, *w));
                }
            }
        }
        // The index's occupancy per worker, for the capacity charge only (it reads every shard), and
        // only where some worker has a prefix-cache size to charge against.
        let occupancy = self.needs.evictions && st.workers.iter().any(|w| w.spec.prefix_cache_blocks.is_some());
        if occupancy {
            let State { workers, indexed_blocks, occupancy_slots, .. } = st;
            self.index.num_blocks_into(workers.iter().map(|w| w.id), occupancy_slots, indexed_blocks);
        }
        let bs = self.cfg.block_size as u64;
        Ok(Ask {
            now,
            num_tokens,
            kv_need: (num_tokens + st.outputs.expected(req.output_tokens)).div_ceil(bs),
            pd: st.workers.iter().any(|w| w.spec.role == Role::Decode),
            pinned,
            restricted,
            occupancy,
            req,
            hashes,
            matches,
        })
    }

    /// The candidate figures of the worker at `at` (`transfer_time`: the KV transfer its choice implies).
    fn candidate_at(&self, st: &State, ask: &Ask<'_, '_>, at: usize, transfer_time: f64) -> Candidate {
        let indexed = if ask.occupancy { st.indexed_blocks[at] } else { 0 };
        self.candidate(&st.workers[at], st.overlaps[at], ask.now, ask.num_tokens, transfer_time, indexed)
    }

    /// PD mode: the decode side first, so nothing is spent on a request that cannot be decoded.
    fn decode_side(&self, st: &mut State, ask: &Ask<'_, '_>) -> Result<DecodeSide, RouterError> {
        if !ask.pd {
            return Ok(DecodeSide::default());
        }
        let cfg = &self.cfg;
        let State { workers, allowed, rotation, pos, .. } = st;
        let ok = |w: &WorkerLoad| w.spec.role.decodes() && (!ask.restricted || allowed[pos[&w.id]]);
        let choice = choose_decode(workers, ok, ask.kv_need, &cfg.decode, cfg.tie_break, rotation)
            .ok_or_else(|| RouterError::NoWorkers("no decode workers".into()))?;
        Ok(match choice {
            DecodeChoice::Chosen(i, tpot) => DecodeSide { at: Some(i), tpot, reject: None },
            DecodeChoice::TpotMiss(i, tpot) => DecodeSide { at: Some(i), tpot, reject: Some((Reason::RejectedTpot, i)) },
            DecodeChoice::NoRoom(i) => DecodeSide {
                at: Some(i),
                tpot: st.workers[i].tpot_with_one_more(cfg.decode.step_s),
                reject: Some((Reason::RejectedDecode, i)),
            },
        })
    }

    /// Fills `st.cands` with the prefill candidates. Unified mode: the decode-side test applies to
    /// each; with rejection the unfit are left out (counted), without it they are chosen only when
    /// no worker has room.
    fn prefill_candidates(&self, st: &mut State, ask: &Ask<'_, '_>, decode_at: Option<usize>) -> Result<Filtered, RouterError> {
        let cfg = &self.cfg;
        let bs = cfg.block_size as u64;
        st.cands.clear();
        let mut filtered = Filtered { count: 0, reason: Reason::RejectedDecode };
        let mut spill: Vec<Candidate> = Vec::new();
        for at in 0..st.workers.len() {
            if ask.pinned.is_some_and(|p| p != at) || (ask.restricted && !st.allowed[at]) {
                continue;
            }
            let w = &st.workers[at];
            if !w.spec.role.prefills() {
                if ask.pinned.is_some() {
                    return Err(RouterError::InvalidArgument(format!("worker {} is decode-only and cannot prefill", w.id)));
                }
                continue;
            }
            let need_here = unified_kv_need(ask.kv_need, st.overlaps[at]);
            let unfit = !ask.pd && !decode_worker::admissible(w, need_here, &cfg.decode);
            if unfit && cfg.admission.reject {
                filtered.count += 1;
                if w.kv_fits(need_here, cfg.decode.kv_headroom) {
                    filtered.reason = Reason::RejectedTpot;
                }
                continue;
            }
            let transfer = match decode_at {
                Some(d) if d != at => {
                    let d_cached = (st.overlaps[d] as u64 * bs).min(ask.num_tokens);
                    cfg.pd.transfer_time(ask.num_tokens - d_cached)
                }
                _ => 0.0,
            };
            let c = self.candidate_at(st, ask, at, transfer);
            if unfit {
                spill.push(c);
            } else {
                st.cands.push(c);
            }
        }
        if st.cands.is_empty() {
            st.cands.append(&mut spill);
        }
        Ok(filtered)
    }

    /// The rejection the decode side decides alone: in unified mode no worker has KV room (or keeps
    /// the TPOT SLO); in PD mode the chosen decode worker cannot take the request.
    fn decode_rejection(
        &self,
        st: &mut State,
        ask: &Ask<'_, '_>,
        decode: &mut DecodeSide,
        filtered: Filtered,
    ) -> Result<Option<Decision>, RouterError> {
        if !ask.pd && st.cands.is_empty() {
            let at = ask.pinned.unwrap_or_else(|| {
                (0..st.workers.len())
                    .filter(|&i| !ask.restricted || st.allowed[i])
                    .max_by_key(|&i| st.workers[i].kv_free())
                    .expect("non-empty")
            });
            let c = self.candidate_at(st, ask, at, 0.0);
            decode.tpot = st.workers[at].tpot_with_one_more(self.cfg.decode.step_s);
            return Ok(Some(self.rejection(c, None, filtered.reason, decode.tpot, ask.num_tokens, ask.req, &st.cands)));
        }
        if let (true, Some((reason, d))) = (self.cfg.admission.reject, decode.reject) {
            let c = st.cands[0];
            return Ok(Some(self.rejection(c, Some(st.workers[d].id), reason, decode.tpot, ask.num_tokens, ask.req, &st.cands)));
        }
        Ok(None)
    }

    /// The prefill worker: a short prompt's decode worker (conditional disaggregation), else the
    /// policy's choice among the workers within the token-share bound, checked against the TTFT SLO
    /// (or the request is rejected), with hot-prefix relief and the busy-pool fallback.
    fn choose(&self, st: &mut State, ask: &Ask<'_, '_>, decode: &DecodeSide, rho_evident: f64, reuse: f64) -> Chosen {
        let cfg = &self.cfg;
        let (now, num_tokens) = (ask.now, ask.num_tokens);
        let local_ok = ask.pd && ask.pinned.is_none();
        // Bounded token share: the policy chooses among the workers that stay within the bound.
        // A pin skips the bound but is counted (at admission), so the counts are decayed here for it too.
        let within = match cfg.token_share_bound {
            Some(bound) => {
                let mean = share::decay_to(&mut st.workers, &mut st.routed_at, now, cfg.admission.load_window(), num_tokens);
                match ask.pinned {
                    None => share::partition(&mut st.cands, &st.workers, &st.pos, bound, mean, num_tokens),
                    Some(_) => st.cands.len(),
                }
            }
            None => st.cands.len(),
        };

        // Conditional disaggregation, short prompts: prefill where the decode happens.
        if let (Some(d), true) = (decode.at, local_ok && cfg.pd.local_prefill_max_tokens > 0) {
            let uncached = num_tokens - (st.overlaps[d] as u64 * cfg.block_size as u64).min(num_tokens);
            if uncached <= cfg.pd.local_prefill_max_tokens {
                let c = self.candidate_at(st, ask, d, 0.0);
                if !cfg.admission.reject || keeps_slo(cfg.admission.ttft_slo, c.predicted_ttft) {
                    return Chosen::Worker(Choice { c, reason: Reason::ShortPrompt, path: Path::Local, fetch_from: None });
                }
            }
        }

        let State { cands, rotation, rr, rng, .. } = st;
        let mut ctx = Ctx {
            tie_break: cfg.tie_break,
            rotation,
            rr,
            rng: rng.as_mut(),
            num_tokens,
            block_size: cfg.block_size,
            ttft_slo: cfg.admission.ttft_slo,
            admission_work_factor: cfg.admission.factor_at(self.admission_work_factor, rho_evident),
            reuse,
        };
        let (mut i, mut reason) = match ask.pinned {
            Some(_) => (0, Reason::Pinned),
            None => self.policy.choose(&mut ctx, &mut cands[..within]),
        };
        // Early rejection: the policy's choice misses the SLO -> the fastest worker, if any keeps it.
        if let (true, Some(slo)) = (cfg.admission.reject, cfg.admission.ttft_slo) {
            let f = ctx.admission_work_factor;
            let adm = |c: &Candidate| admission_ttft(c, f);
            if adm(&cands[i]) > slo {
                let best = pick_min(&mut ctx, cands, |_| true, |c| (adm(c), c.predicted_ttft)).expect("non-empty");
                // A learned TTFT model rejects only on a worker whose speed it has measured: the
                // prior is a guess, and a guess must not turn requests away.
                let trusted = cfg.ttft_model != TtftModel::Learned || st.workers[st.pos[&cands[best].worker]].prefill_fit.fitted.is_some();
                if adm(&cands[best]) > slo && trusted {
                    let c = cands[best];
                    let dw = decode.at.map(|d| st.workers[d].id);
                    return Chosen::Rejected(self.rejection(c, dw, Reason::RejectedTtft, decode.tpot, num_tokens, ask.req, &st.cands));
                }
                i = best;
                reason = Reason::SloFallback;
            }
        }
        let c = cands[i];
        let path = if ask.pd { Path::Disaggregated } else { Path::Unified };
        let fetch_from = self.hot_prefix_holder(cands, &c, num_tokens, &st.workers, &st.pos);
        // Conditional disaggregation, busy prefill pool: the decode worker is sooner.
        let busy = cfg.pd.prefill_busy_queue_s.is_some_and(|q| c.queue_delay > q);
        if let (Some(d), true) = (decode.at, local_ok && busy) {
            let local = self.candidate_at(st, ask, d, 0.0);
            if local.predicted_ttft < c.predicted_ttft {
                return Chosen::Worker(Choice { c: local, reason: Reason::PrefillPoolBusy, path: Path::Local, fetch_from: None });
            }
        }
        Chosen::Worker(Choice { c, reason, path, fetch_from })
    }

    /// Admits the request: advances the virtual-time queue, records its pending prefix and (if
    /// tracked) its in-flight counts.
    fn admit(&self, st: &mut State, ask: &Ask<'_, '_>, decode: DecodeSide, choice: Choice) -> Decision {
        let cfg = &self.cfg;
        let bs = cfg.block_size as u64;
        let Choice { c, reason, path, fetch_from } = choice;
        let (now, num_tokens, req, hashes, matches) = (ask.now, ask.num_tokens, ask.req, ask.hashes, ask.matches);
        let mut predicted_tpot = decode.tpot;
        if !ask.pd {
            predicted_tpot = st.workers[st.pos[&c.worker]].tpot_with_one_more(cfg.decode.step_s);
        }
        let p_at = st.pos[&c.worker];
        let d_at = decode.at.unwrap_or(p_at);
        let shift_at = st.shifts[p_at];
        if cfg.token_share_bound.is_some() {
            st.workers[p_at].routed_tokens += num_tokens as f64;
        }
        let pw = &mut st.workers[p_at];
        let done_at = pw.enqueue_prefill(now, c.prefill_time);
        let busy_until = pw.busy_until;
        // Tracked: pending until prefill_done / finished says when (TTL if never); untracked: until
        // the predicted prefill end, the only end the router will know.
        let pending = if cfg.cache_view.pending_prefixes {
            let full = ((num_tokens / bs) as usize).min(hashes.len());
            let indexed = matches.workers.iter().position(|&w| w == c.worker).map_or(0, |i| matches.depths[i] as usize).min(full);
            let until = match req.request_id {
                Some(_) => now + cfg.cache_view.pending_ttl_s,
                None => done_at.max(now) + cfg.cache_view.pending_grace_s,
            };
            st.pending.add(c.worker, &hashes[indexed..full], until)
        } else {
            None
        };
        if let Some(id) = req.request_id {
            // A fetched prefix (hot-prefix relief) is not the worker's own: nothing to check.
            let checkpoints = if cfg.cache_view.stale_overlaps && fetch_from.is_none() {
                st.checkpoints.add(id, c.worker, hashes, c.overlap_blocks)
            } else {
                stale::Held::default()
            };
            let pw = &mut st.workers[p_at];
            pw.prefilling += 1;
            pw.prefill_tokens += c.uncached_tokens;
            pw.active += 1;
            let dw = &mut st.workers[d_at];
            if d_at != p_at {
                dw.active += 1;
            }
            dw.decoding += 1;
            // PD: the whole KV moves to the decode worker.
            let kv_blocks = if d_at == p_at { unified_kv_need(ask.kv_need, c.overlap_blocks) } else { ask.kv_need };
            dw.decode_blocks += kv_blocks;
            st.requests.insert(
                id,
                InFlight {
                    prefill_worker: c.worker,
                    decode_worker: st.workers[d_at].id,
                    uncached_tokens: c.uncached_tokens,
                    work: c.prefill_time,
                    done_at,
                    shift_at,
                    modelled: st.workers[p_at].prefill_model().is_some(),
                    kv_blocks,
                    prefill_pending: true,
                    routed_at: now,
                    first_token_at: f64::NEG_INFINITY,
                    batch_at_first: 0,
                    pending,
                    overlap_blocks: c.overlap_blocks,
                    checkpoints,
                },
            );
        }
        Decision {
            worker: c.worker,
            decode_worker: decode.at.map(|d| st.workers[d].id),
            overlap_blocks: c.overlap_blocks,
            num_tokens,
            uncached_tokens: c.uncached_tokens,
            queue_delay: c.queue_delay,
            predicted_ttft: c.predicted_ttft,
            predicted_tpot,
            busy_until,
            admitted: true,
            reason,
            path,
            fetch_from,
            request_id: req.request_id,
            explain: req.explain.then(|| st.cands.iter().map(WorkerBreakdown::from).collect()),
        }
    }

    /// Folds this arrival into the offered-load estimate and returns the load as a fraction of the
    /// prefill pool's capacity. The request is counted at its cheapest candidate (the least it can
    /// cost the cluster), admitted or not: rejected requests are offered load too.
    fn record_offered(st: &mut State, cfg: &RouterConfig, now: f64, num_tokens: u64) -> (f64, f64) {
        let tokens = st.cands.iter().map(|c| c.uncached_tokens).min().unwrap_or(num_tokens);
        let tau = cfg.admission.load_window();
        let decay = decay_since(&mut st.offered_at, now, tau);
        st.offered_rate = st.offered_rate * decay + tokens as f64 / tau;
        st.offered_sq = st.offered_sq * decay + (tokens as f64).powi(2) / tau;
        let capacity: f64 = st.workers.iter().filter(|w| w.spec.role.prefills()).map(|w| w.prefill_speed()).sum();
        if capacity > 0.0 {
            // Arrivals are (close to) a compound Poisson stream: the exponentially weighted rate
            // has variance lambda * E[tokens^2] / (2 tau), and offered_sq estimates lambda * E[tokens^2].
            let std_err = (st.offered_sq / (2.0 * tau)).sqrt();
            (st.offered_rate / capacity, (st.offered_rate - cfg.admission.shed_load_sigmas * std_err).max(0.0) / capacity)
        } else {
            (0.0, 0.0)
        }
    }

    /// "capacity": this arrival asks again for the evicted blocks past every worker's cached
    /// prefix (see `evicted`); returns how likely an evicted block is to be asked for again.
    fn record_reuse(st: &mut State, cfg: &RouterConfig, now: f64, hashes: &[u64]) -> f64 {
        let best = st.cands.iter().map(|c| c.overlap_blocks as usize).max().unwrap_or(0);
        st.evicted.asked(hashes, best, now, cfg.admission.load_window());
        st.evicted.p()
    }

    #[allow(clippy::too_many_arguments)]
    fn rejection(
        &self,
        c: Candidate,
        decode_worker: Option<WorkerId>,
        reason: Reason,
        predicted_tpot: Option<f64>,
        num_tokens: u64,
        req: &RouteRequest<'_>,
        cands: &[Candidate],
    ) -> Decision {
        Decision {
            worker: c.worker,
            decode_worker,
            overlap_blocks: c.overlap_blocks,
            num_tokens,
            uncached_tokens: c.uncached_tokens,
            queue_delay: c.queue_delay,
            predicted_ttft: c.predicted_ttft,
            predicted_tpot,
            busy_until: c.busy_until,
            admitted: false,
            reason,
            path: if decode_worker.is_some() { Path::Disaggregated } else { Path::Unified },
            fetch_from: None,
            request_id: req.request_id,
            explain: req.explain.then(|| cands.iter().map(WorkerBreakdown::from).collect()),
        }
    }

    /// Hot-prefix relief (Mooncake's cache load balancing): the worker holding the longest prefix,
    /// when `chosen` holds less and pulling the difference is cheaper than recomputing it.
    fn hot_prefix_holder(
        &self,
        cands: &[Candidate],
        chosen: &Candidate,
        num_tokens: u64,
        workers: &[WorkerLoad],
        pos: &HashMap<WorkerId, usize>,
    ) -> Option<WorkerId> {
        if self.cfg.pd.kv_bytes_per_token <= 0.0 {
            return None;
        }
        let holder = cands
            .iter()
            .filter(|c| c.overlap_blocks > chosen.overlap_blocks)
            .max_by_key(|c| (c.overlap_blocks, std::cmp::Reverse(c.worker)))?;
        let bs = self.cfg.block_size as u64;
        let extra = (holder.overlap_blocks as u64 * bs).min(num_tokens) - (chosen.overlap_blocks as u64 * bs).min(num_tokens);
        let recompute = workers[pos[&chosen.worker]].token_time(extra);
        (self.cfg.pd.transfer_time(extra) < recompute).then_some(holder.worker)
    }
}

/// The KV blocks a request needing `kv_need` takes on a unified worker that caches its first
/// `overlap` blocks: the cached prefix is shared with the request (prefix caching), so only the rest
/// of the prompt and the output take new blocks there.
fn unified_kv_need(kv_need: u64, overlap: u32) -> u64 {
    kv_need - (overlap as u64).min(kv_need)
}

/// No SLO, or `v` keeps it.
fn keeps_slo(slo: Option<f64>, v: f64) -> bool {
    slo.map_or(true, |s| v <= s)
}
