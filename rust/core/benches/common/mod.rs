//! The chat-like workload shared by the core benches (mirrors benches/workload.py): a few hundred
//! system prompts, sessions of 128..1100 blocks extending them, each cached on one worker; and the
//! interleaved event stream. Each bench target uses only some of it.
#![allow(dead_code)]

pub struct Session {
    pub worker: u64,
    pub seq: Vec<u64>,
}

/// The router's SplitMix64, plus a bounded draw for the workload.
pub struct Rng(kvroute_core::router::policy::Rng);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(kvroute_core::router::policy::Rng::new(seed))
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
}

/// The interleaved event stream of benches/workload.py (`interleaved_workload`, same shape, its
/// own random draws): 128 open sessions over Zipf(1.1)-drawn system prompts of 4-64 blocks behind
/// one common block 0, turns of 2-16 blocks each stored under its parent, interleaved at random;
/// 5% of turns move to another worker, which prefills what it lacks in 16-block stores.
pub fn interleaved_stream(workers: u64, target_entries: usize, seed: u64) -> (Vec<Session>, Vec<Store>) {
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
    let mut sys_held: std::collections::HashSet<(usize, u64)> = Default::default();
    let mut zero_held: std::collections::HashSet<u64> = Default::default();
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
    while entries < target_entries {
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
        if have < sys_n {
            if sys_held.contains(&(s.prompt, w)) {
                have = have.max(sys_n);
            } else if zero_held.contains(&w) {
                have = have.max(1);
            }
        }
        let j = (have + CHUNK).min(end);
        stores.push(Store { worker: w, session: k, start: have, end: j });
        entries += j - have;
        s.depth.insert(w, j);
        if j >= sys_n {
            sys_held.insert((s.prompt, w));
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

/// Applies a stream's stores in order; returns the blocks stored.
pub fn build_stream(idx: &kvroute_core::KvIndex, sessions: &[Session], stores: &[Store]) -> usize {
    let mut n = 0;
    for st in stores {
        let seq = &sessions[st.session].seq;
        let parent = (st.start > 0).then(|| seq[st.start - 1]);
        idx.store(st.worker, &seq[st.start..st.end], parent, kvroute_core::Tier::Device).unwrap();
        n += st.end - st.start;
    }
    n
}
