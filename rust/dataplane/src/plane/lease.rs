//! A routed request's load on the Router and on its worker, each released exactly once.

use super::*;

/// One routed request's load on the Router, released exactly once: `finished` once its first byte
/// (prefill done) was seen, `cancel` otherwise.
pub(super) struct Lease {
    pub(super) router: Arc<Router>,
    pub(super) rid: u64,
    pub(super) prefilled: bool,
}

impl Lease {
    pub(super) fn prefill_done(&mut self) {
        if !self.prefilled {
            self.prefilled = true;
            let _ = self.router.prefill_done(self.rid, None);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // An unknown request here would be a data plane bug; nothing useful to do on the drop path.
        let _ = if self.prefilled { self.router.finished(self.rid, None) } else { self.router.cancel(self.rid, None) };
    }
}

/// Counts one request dispatched to a worker, in flight until dropped.
pub(super) struct Dispatch(pub(super) Arc<Worker>);

impl Dispatch {
    pub(super) fn new(w: Arc<Worker>) -> Dispatch {
        w.in_flight.fetch_add(1, Ordering::SeqCst);
        w.served.fetch_add(1, Ordering::SeqCst);
        Dispatch(w)
    }
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}
