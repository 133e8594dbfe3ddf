//! The index's removal log: which (worker, block) pairs engines said they dropped, in order, for
//! readers that must learn of a removal even when the block was stored and removed between two
//! of their looks at the index (the Router's pending prefixes: a block pending on a worker that
//! the engine has since evicted is not cached there, whatever the pending entry says).
//!
//! Off (nothing recorded, one relaxed load per removal call) until a reader subscribes. Bounded:
//! it keeps the last `CAPACITY` records; a reader that fell further behind is told so and must
//! assume anything may have been removed.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use parking_lot::Mutex;

use super::WorkerId;

/// Records kept for readers that lag (a removal is 24 bytes: 1.5 MiB at most).
const CAPACITY: usize = 1 << 16;

/// One removal as the index applied it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// `worker` no longer holds this block (on some tier; a reader treats it as gone).
    Block(WorkerId, u64),
    /// `worker` dropped its whole cache (`clear`, `AllBlocksCleared`, `remove_worker`).
    Worker(WorkerId),
}

/// What a reader found since its cursor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Since {
    /// Every record since the cursor was delivered.
    Complete,
    /// Records were dropped before the reader saw them: anything may have been removed.
    Lost,
}

#[derive(Default)]
struct Log {
    /// Sequence number of `records[0]`; a record's number is its position in the whole log.
    first: u64,
    records: VecDeque<Removal>,
}

impl Log {
    fn end(&self) -> u64 {
        self.first + self.records.len() as u64
    }
}

#[derive(Default)]
pub(super) struct RemovalLog {
    readers: AtomicUsize,
    log: Mutex<Log>,
}

impl RemovalLog {
    #[inline]
    pub(super) fn on(&self) -> bool {
        self.readers.load(Relaxed) > 0
    }

    pub(super) fn record(&self, items: impl Iterator<Item = Removal>) {
        let mut log = self.log.lock();
        for r in items {
            if log.records.len() == CAPACITY {
                log.records.pop_front();
                log.first += 1;
            }
            log.records.push_back(r);
        }
    }

    pub(super) fn subscribe(&self) -> u64 {
        // Registered under the lock: a removal that comes after the returned cursor is recorded.
        let log = self.log.lock();
        self.readers.fetch_add(1, Relaxed);
        log.end()
    }

    pub(super) fn unsubscribe(&self) {
        let mut log = self.log.lock();
        if self.readers.fetch_sub(1, Relaxed) == 1 {
            log.first = log.end();
            log.records = VecDeque::new();
        }
    }

    pub(super) fn since(&self, cursor: &mut u64, mut f: impl FnMut(Removal)) -> Since {
        let log = self.log.lock();
        let end = log.end();
        let out = if *cursor < log.first {
            *cursor = log.first;
            Since::Lost
        } else {
            Since::Complete
        };
        let skip = (*cursor - log.first) as usize;
        log.records.iter().skip(skip).for_each(|&r| f(r));
        *cursor = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_get_what_came_after_their_cursor_and_learn_of_losses() {
        let log = RemovalLog::default();
        log.record(std::iter::once(Removal::Worker(9))); // nobody subscribed: the caller checks on()
        assert_eq!(std::mem::size_of::<Removal>(), 24);
        let mut c = log.subscribe();
        assert!(log.on());
        log.record([Removal::Block(1, 10), Removal::Worker(2)].into_iter());
        let mut got = Vec::new();
        assert_eq!(log.since(&mut c, |r| got.push(r)), Since::Complete);
        assert_eq!(got, vec![Removal::Block(1, 10), Removal::Worker(2)]);
        got.clear();
        assert_eq!(log.since(&mut c, |r| got.push(r)), Since::Complete);
        assert!(got.is_empty());
        log.record((0..CAPACITY as u64 + 5).map(|h| Removal::Block(1, h)));
        let mut n = 0;
        assert_eq!(log.since(&mut c, |_| n += 1), Since::Lost);
        assert_eq!(n, CAPACITY);
        log.unsubscribe();
        assert!(!log.on());
        assert!(log.log.lock().records.is_empty());
    }
}
