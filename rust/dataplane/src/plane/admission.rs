//! Admission: one client's slot under the per-client and total in-flight limits, held until
//! its response ends.

use super::*;

/// One client's slot (per-client and total in-flight limits), held until the response ends.
pub(super) struct Admission {
    pub(super) sh: Arc<Shared>,
    pub(super) client: String,
    pub(super) endpoint: &'static str,
    /// Status class of the response, counted once its body was fully written.
    pub(super) class: &'static str,
    pub(super) completed: bool,
}

impl Admission {
    pub(super) fn take(sh: &Arc<Shared>, client: String, endpoint: &'static str) -> Result<Admission, Reject> {
        let mut clients = sh.clients.lock();
        let active = clients.get(&client).copied().unwrap_or(0);
        if active >= sh.cfg.max_client_concurrency {
            drop(clients);
            sh.metrics.rejection("client_concurrency");
            let msg = format!("too many concurrent requests from this client (limit {})", sh.cfg.max_client_concurrency);
            return Err(Reject { status: 429, message: msg, kind: "rate_limit_exceeded", retry_after: Some(1) });
        }
        if sh.in_flight.load(Ordering::SeqCst) >= sh.cfg.max_in_flight {
            drop(clients);
            sh.metrics.rejection("gateway_full");
            let msg = format!("gateway at its in-flight limit ({})", sh.cfg.max_in_flight);
            return Err(Reject { status: 429, message: msg, kind: "rate_limit_exceeded", retry_after: Some(1) });
        }
        *clients.entry(client.clone()).or_insert(0) += 1;
        sh.in_flight.fetch_add(1, Ordering::SeqCst);
        drop(clients);
        Ok(Admission { sh: sh.clone(), client, endpoint, class: "5xx", completed: false })
    }

    /// A response produced here: the slot is held until its body is written.
    pub(super) fn respond(self, mut resp: Response<PlaneBody>) -> Response<PlaneBody> {
        let class = status_class(resp.status());
        resp.body_mut().hold = Some(Hold { adm: Some(self.with_outcome(class)), ..Hold::default() });
        resp
    }

    pub(super) fn with_outcome(mut self, class: &'static str) -> Admission {
        self.class = class;
        self
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        {
            let mut clients = self.sh.clients.lock();
            if let Some(n) = clients.get_mut(&self.client) {
                *n -= 1;
                if *n == 0 {
                    clients.remove(&self.client);
                }
            }
        }
        self.sh.in_flight.fetch_sub(1, Ordering::SeqCst);
        if self.completed {
            self.sh.metrics.request(self.endpoint, self.class);
        } else {
            self.sh.metrics.disconnect(self.endpoint);
        }
    }
}
