//! Seeded randomness: the `RandomSource` a Router draws its random choices from ("random", "cost"
//! with a temperature), CPython's `random.Random` bit for bit, and a small SplitMix64 generator.

mod cpython;
mod splitmix;

pub use cpython::PyRandom;
pub use splitmix::SplitMix64;

/// Where a Router's random choices come from. The Router is given one (`Router::with_random`);
/// by default it is `PyRandom::new(seed)`, so `Router(policy="random", seed=1)` makes the seed
/// seed's own `random.Random(1).randrange(n)` draws.
pub trait RandomSource: Send {
    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64;
    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64;
}

impl RandomSource for PyRandom {
    fn below(&mut self, n: u64) -> u64 {
        self.randbelow(n)
    }
    fn unit(&mut self) -> f64 {
        self.random()
    }
}

impl RandomSource for SplitMix64 {
    fn below(&mut self, n: u64) -> u64 {
        SplitMix64::below(self, n)
    }
    fn unit(&mut self) -> f64 {
        self.next_f64()
    }
}
