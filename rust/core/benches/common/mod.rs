//! The chat-like workload shared by the core benches (mirrors benches/workload.py): a few hundred
//! system prompts, sessions of 128..1100 blocks extending them, each cached on one worker; and the
//! interleaved event stream. Each bench target uses only some of it.
#![allow(dead_code)]

pub struct Session {
    pub worker: u64,
    pub seq: Vec<u64>,
}

/// The router's SplitMix64, plus a bounded draw for the workload.
pub struct Rng(kvroute_core::random::SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(kvroute_core::random::SplitMix64::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

pub fn chat_workload(workers: u64, target_entries: usize, seed: u64) -> Vec<Session> {
    let mut rng = Rng::new(seed);
    let systems: Vec<Vec<u64>> = (0..300).map(|_| (0..32).map(|_| rng.next_u64()).collect()).collect();
    let mut out = Vec::new();
    let mut entries = 0;
    while entries < target_entries {
        let p = rng.below(300) as usize;
        let worker = rng.below(workers);
        let extra = 96 + rng.below(972) as usize;
        let mut local = systems[p].clone();
        local.extend((0..extra).map(|_| rng.next_u64()));
        let seq = kvroute_core::hash::chain_local_hashes(&local, kvroute_core::DEFAULT_SEED, None);
        entries += seq.len();
        out.push(Session { worker, seq });
    }
    out
}

pub fn build(idx: &kvroute_core::KvIndex, sessions: &[Session], batch: usize) -> usize {
    let mut n = 0;
    for s in sessions {
        for (k, chunk) in s.seq.chunks(batch).enumerate() {
            let parent = (k > 0).then(|| s.seq[k * batch - 1]);
            idx.store(s.worker, chunk, parent, kvroute_core::Tier::Device).unwrap();
            n += chunk.len();
        }
    }
    n
}

/// One store of an event stream: `worker` stores `sessions[session].seq[start..end]` under block
/// `start - 1`.
pub struct Store {
    pub worker: u64,
    pub session: usize,
    pub start: usize,
    pub end: usize,
    /// Blocks `worker` evicted just before this store (`churn_stream`), deepest of a chain first.
    pub evicted: Vec<u64>,
}

/// The interleaved event stream of benches/workload.py (`interleaved_workload`, same shape, its
/// own random draws): 128 open sessions over Zipf(1.1)-drawn system prompts of 4-64 blocks behind
/// one common block 0, turns of 2-16 blocks each stored under its parent, interleaved at random;
/// 5% of turns move to another worker, which prefills what it lacks in 16-block stores.
pub fn interleaved_stream(workers: u64, target_entries: usize, seed: u64) -> (Vec<Session>, Vec<Store>) {
    stream(workers, target_entries, seed, None)
}

/// `interleaved_stream` with caches that overflow (benches/workload.py `churn_workload`): each
/// worker holds at most `target_entries / workers` blocks, an LRU over its sessions' blocks, their
/// system prompts and block 0 (a turn uses them in that order, so prefixes are the more recently
/// used); a store that would overflow it first evicts the least recently used blocks, deepest
/// first (`Store::evicted`); the stream stores three times `target_entries` blocks.
pub fn churn_stream(workers: u64, target_entries: usize, seed: u64) -> (Vec<Session>, Vec<Store>) {
    stream(workers, target_entries, seed, Some(target_entries.div_ceil(workers as usize)))
}

/// What a worker's LRU holds, as units: a session's blocks past its prompt, a prompt's blocks past
/// block 0, block 0.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Unit {
    Session(usize),
    Prompt(usize),
    Zero,
}

/// Units by recency: `touch` makes one the most recent, `oldest` is the least.
#[derive(Default)]
struct Lru {
    by_tick: std::collections::BTreeMap<u64, Unit>,
    tick_of: std::collections::HashMap<Unit, u64>,
    clock: u64,
}

impl Lru {
    fn contains(&self, u: Unit) -> bool {
        self.tick_of.contains_key(&u)
    }
    fn touch(&mut self, u: Unit) {
        self.clock += 1;
        if let Some(t) = self.tick_of.insert(u, self.clock) {
            self.by_tick.remove(&t);
        }
        self.by_tick.insert(self.clock, u);
    }
    fn oldest(&self) -> Option<Unit> {
        self.by_tick.values().next().copied()
    }
    fn remove(&mut self, u: Unit) {
        if let Some(t) = self.tick_of.remove(&u) {
            self.by_tick.remove(&t);
        }
    }
}

fn stream(workers: u64, target_entries: usize, seed: u64, capacity: Option<usize>) -> (Vec<Session>, Vec<Store>) {
    const PROMPTS: usize = 256;
    const CHUNK: usize = 16;
    let mut rng = Rng::new(seed);
    let common = rng.next_u64();
    let systems: Vec<Vec<u64>> = (0..PROMPTS)
        .map(|_| {
            let n = 4 + rng.below(61) as usize;
            std::iter::once(common).chain((0..n).map(|_| rng.next_u64())).collect()
        })
        .collect();
    let mut cdf: Vec<f64> = (1..=PROMPTS).map(|k| 1.0 / (k as f64).powf(1.1)).collect();
    let total: f64 = cdf.iter().sum();
    let mut acc = 0.0;
    for c in cdf.iter_mut() {
        acc += *c / total;
        *c = acc;
    }
    struct Open {
        prompt: usize,
        len: usize,
        stored: usize,
        last: u64,
        depth: std::collections::HashMap<u64, usize>,
        pending: Option<(u64, usize)>,
    }
    let mut sessions: Vec<Session> = Vec::new();
    let mut state: Vec<Open> = Vec::new();
    // Each system prompt's sequence hashes (block 0 is the same in all), for evicting its blocks.
    let sys_seq: Vec<Vec<u64>> = if capacity.is_some() {
        systems.iter().map(|p| kvroute_core::hash::chain_local_hashes(p, kvroute_core::DEFAULT_SEED, None)).collect()
    } else {
        Vec::new()
    };
    // (prompt, worker) -> blocks of the prompt the worker holds (only whole prompts without a
    // capacity, as before), and the workers holding block 0.
    let mut sys_held: std::collections::HashMap<(usize, u64), usize> = Default::default();
    let mut zero_held: std::collections::HashSet<u64> = Default::default();
    // With a capacity: each worker's units by recency, and the blocks it holds.
    let mut lru: Vec<Lru> = (0..workers).map(|_| Lru::default()).collect();
    let mut used = vec![0usize; workers as usize];
    let stored_total = if capacity.is_some() { 3 * target_entries } else { target_entries };
    let open = |rng: &mut Rng, sessions: &mut Vec<Session>, state: &mut Vec<Open>| {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let prompt = cdf.partition_point(|&c| c < u).min(PROMPTS - 1);
        let len = (16 + rng.below(1185) as usize).max(systems[prompt].len() + 2);
        let mut local = systems[prompt].clone();
        local.extend((local.len()..len).map(|_| rng.next_u64()));
        let worker = rng.below(workers);
        sessions.push(Session { worker, seq: kvroute_core::hash::chain_local_hashes(&local, kvroute_core::DEFAULT_SEED, None) });
        state.push(Open { prompt, len, stored: 0, last: worker, depth: Default::default(), pending: None });
        sessions.len() - 1
    };
    let mut live: Vec<usize> = (0..128).map(|_| open(&mut rng, &mut sessions, &mut state)).collect();
    let mut stores = Vec::new();
    let mut entries = 0;
    while entries < stored_total {
        let slot = rng.below(live.len() as u64) as usize;
        let k = live[slot];
        let s = &mut state[k];
        let sys_n = systems[s.prompt].len();
        let (w, end) = match s.pending.take() {
            Some(p) => p,
            None => {
                let mut w = s.last;
                if s.stored > 0 && workers > 1 && rng.below(100) < 5 {
                    w = (w + 1 + rng.below(workers - 1)) % workers;
                }
                (w, (s.stored.max(sys_n) + 2 + rng.below(15) as usize).min(s.len))
            }
        };
        let mut have = s.depth.get(&w).copied().unwrap_or(0);
        if capacity.is_some() && have <= sys_n {
            // What the LRU says is held: a session's depth is kept only past its prompt.
            have = sys_held.get(&(s.prompt, w)).copied().unwrap_or(0).max(zero_held.contains(&w) as usize);
        } else if have < sys_n {
            if sys_held.contains_key(&(s.prompt, w)) {
                have = have.max(sys_n);
            } else if zero_held.contains(&w) {
                have = have.max(1);
            }
        }
        let j = (have + CHUNK).min(end);
        let prompt = s.prompt;
        let mut evicted = Vec::new();
        if let Some(cap) = capacity {
            let wi = w as usize;
            let mine = [Unit::Session(k), Unit::Prompt(prompt), Unit::Zero];
            for u in mine {
                if lru[wi].contains(u) {
                    lru[wi].touch(u);
                }
            }
            // Evict the least recently used blocks, deepest first, not the storing session's own.
            let mut need = (used[wi] + (j - have)).saturating_sub(cap);
            while need > 0 {
                let Some(u) = lru[wi].oldest() else { break };
                if mine.contains(&u) {
                    break;
                }
                let (n, left) = match u {
                    Unit::Session(o) => {
                        let osn = systems[state[o].prompt].len();
                        let top = state[o].depth[&w];
                        let n = need.min(top - osn);
                        evicted.extend(sessions[o].seq[top - n..top].iter().rev());
                        if top - n > osn {
                            state[o].depth.insert(w, top - n);
                        } else {
                            state[o].depth.remove(&w);
                        }
                        (n, top - n > osn)
                    }
                    Unit::Prompt(p) => {
                        let top = sys_held[&(p, w)];
                        let n = need.min(top - 1);
                        evicted.extend(sys_seq[p][top - n..top].iter().rev());
                        if top - n > 1 {
                            sys_held.insert((p, w), top - n);
                        } else {
                            sys_held.remove(&(p, w));
                        }
                        (n, top - n > 1)
                    }
                    Unit::Zero => {
                        evicted.push(sys_seq[0][0]);
                        zero_held.remove(&w);
                        (1, false)
                    }
                };
                if !left {
                    lru[wi].remove(u);
                }
                need -= n;
                used[wi] -= n;
            }
            used[wi] += j - have;
            for (u, held) in mine.into_iter().zip([j > sys_n, j.min(sys_n) > 1, true]) {
                if held {
                    lru[wi].touch(u);
                }
            }
        }
        let s = &mut state[k];
        stores.push(Store { worker: w, session: k, start: have, end: j, evicted });
        entries += j - have;
        s.depth.insert(w, j);
        if j >= sys_n {
            sys_held.insert((s.prompt, w), sys_n);
        } else if capacity.is_some() && j > sys_held.get(&(s.prompt, w)).copied().unwrap_or(0) {
            sys_held.insert((s.prompt, w), j);
        }
        zero_held.insert(w);
        if j < end {
            s.pending = Some((w, end));
            continue;
        }
        s.stored = end;
        s.last = w;
        if end >= s.len {
            live[slot] = open(&mut rng, &mut sessions, &mut state);
        }
    }
    let mut top = vec![0; sessions.len()];
    for st in &stores {
        top[st.session] = top[st.session].max(st.end);
    }
    for (k, s) in sessions.iter_mut().enumerate() {
        s.seq.truncate(top[k]);
        s.worker = state[k].last;
    }
    (sessions, stores)
}

/// Applies a stream's removals and stores in order; returns the blocks stored plus removed.
pub fn build_stream(idx: &kvroute_core::KvIndex, sessions: &[Session], stores: &[Store]) -> usize {
    let mut n = 0;
    for st in stores {
        if !st.evicted.is_empty() {
            idx.remove(st.worker, &st.evicted, kvroute_core::ANY_TIER);
            n += st.evicted.len();
        }
        let seq = &sessions[st.session].seq;
        let parent = (st.start > 0).then(|| seq[st.start - 1]);
        idx.store(st.worker, &seq[st.start..st.end], parent, kvroute_core::Tier::Device).unwrap();
        n += st.end - st.start;
    }
    n
}

/// A paced writer's wait: after `done` blocks since `t0`, until `rate` blocks/s says they were due,
/// spinning (`spin`: no wake-up latency in the readers' tail) or sleeping.
pub fn pace(t0: std::time::Instant, done: u64, rate: f64, spin: bool) {
    let due = std::time::Duration::from_secs_f64(done as f64 / rate);
    let el = t0.elapsed();
    if due > el && spin {
        while t0.elapsed() < due {
            std::hint::spin_loop();
        }
    } else if due > el {
        std::thread::sleep(due - el);
    }
}

/// Waits (at most 2 s) until a paced writer has stored its first blocks, so a measurement beside it
/// starts with it (a writer that never starts shows as a 0 blocks/s rate, not as a hang).
pub fn wait_started(stored: &std::sync::atomic::AtomicU64) {
    let wait = std::time::Instant::now();
    while stored.load(std::sync::atomic::Ordering::Relaxed) == 0 && wait.elapsed() < std::time::Duration::from_secs(2) {
        std::hint::spin_loop();
    }
}

/// Latencies (us, sorted) of `f` over `qs`: at least `rounds` rounds, and rounds until `min_time`
/// has passed, so that a short call's figure covers as much of a writer's time as a long one's.
pub fn latencies<Q>(qs: &[Q], rounds: usize, min_time: std::time::Duration, mut f: impl FnMut(&Q)) -> Vec<f64> {
    let mut lat = Vec::with_capacity(rounds * qs.len());
    let t0 = std::time::Instant::now();
    let mut r = 0;
    while r < rounds || t0.elapsed() < min_time {
        r += 1;
        for q in qs {
            let t = std::time::Instant::now();
            f(q);
            lat.push(t.elapsed().as_nanos() as f64 / 1000.0);
        }
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    lat
}
