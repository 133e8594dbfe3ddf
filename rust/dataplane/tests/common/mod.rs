//! What the end-to-end tests share: fake engines on loopback threads, the body of a chunked
//! response, a bounded poll, and the data plane's test configuration.
#![allow(dead_code)] // each test crate uses its own subset

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_dataplane::{PdConvention, PlaneConfig};

/// Each request's head and body, as a fake engine received them.
pub type Seen = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A fake engine on a thread: `reply(body)` is the raw HTTP answer to each request, or `None` to hold
/// the request until the peer closes the connection (counted in `closed`).
pub struct Fake {
    pub addr: SocketAddr,
    pub seen: Seen,
    pub closed: Arc<AtomicUsize>,
}

pub fn fake(reply: impl Fn(&[u8]) -> Option<String> + Send + Sync + 'static) -> Fake {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (seen, closed) = (Seen::default(), Arc::new(AtomicUsize::new(0)));
    let (seen2, closed2, reply) = (seen.clone(), closed.clone(), Arc::new(reply));
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(conn) = conn else { return };
            let (seen, closed, reply) = (seen2.clone(), closed2.clone(), reply.clone());
            std::thread::spawn(move || {
                conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut w = conn.try_clone().unwrap();
                let mut r = BufReader::new(conn);
                loop {
                    let (mut head, mut len) = (String::new(), 0usize);
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap();
                        }
                        if line == "\r\n" {
                            break;
                        }
                        head.push_str(&line);
                    }
                    let mut body = vec![0; len];
                    r.read_exact(&mut body).unwrap();
                    seen.lock().unwrap().push((head, body.clone()));
                    match reply(&body) {
                        Some(answer) => {
                            if w.write_all(answer.as_bytes()).is_err() {
                                return;
                            }
                        }
                        None => {
                            // Held: the request ends when the data plane drops its connection.
                            while r.read(&mut [0u8; 64]).unwrap_or(0) > 0 {}
                            closed.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                }
            });
        }
    });
    Fake { addr, seen, closed }
}

/// The body of a chunked response.
pub fn dechunk(resp: &str) -> String {
    let mut rest = &resp[resp.find("\r\n\r\n").unwrap() + 4..];
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(size, 16).unwrap();
        if n == 0 {
            return out;
        }
        out.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
}

/// Polls `pred` (bounded) for effects that have no event to wait on, such as a peer's close.
pub fn poll(what: &str, pred: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !pred() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The loopback address with an ephemeral port, to listen on.
pub fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Small limits and short timeouts, approximate prompts.
pub fn config(pd_convention: PdConvention) -> PlaneConfig {
    PlaneConfig {
        pd_convention,
        max_body_bytes: 1 << 20,
        max_client_concurrency: 8,
        max_in_flight: 64,
        client_key_header: None,
        max_retries: 2,
        connect_timeout: Duration::from_secs(2),
        read_timeout: Duration::from_secs(5),
        client_timeout: Duration::from_secs(5),
        approx_ttl: Some(Duration::from_secs(60)),
        threads: 1,
        tokenizer: None,
        models: Vec::new(),
        health_timeout: Duration::from_secs(2),
        ca_file: None,
    }
}
