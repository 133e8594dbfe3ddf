//! The chat-like workload shared by the core benches (mirrors benches/workload.py): a few hundred
//! system prompts, sessions of 128..1100 blocks extending them, each cached on one worker.

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
