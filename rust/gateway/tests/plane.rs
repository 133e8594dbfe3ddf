//! The data plane end to end on loopback, without Python: a refusing worker is retried on the next
//! one, the answer is relayed byte for byte, the load is released, forwarding reaches the backend.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::router::{Role, WorkerSpec};
use kvroute_core::{Router, RouterConfig};
use kvroute_gateway::{DataPlane, PdConvention, PlaneConfig};

mod common;
use common::dechunk;

/// A fake engine answering `reply` to every request (keep-alive), recording each request.
fn fake_server(reply: &'static str) -> (SocketAddr, common::Seen) {
    let f = common::fake(move |_| Some(reply.to_string()));
    (f.addr, f.seen)
}

fn request(addr: SocketAddr, head: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "{head}\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn config(backend: SocketAddr) -> PlaneConfig {
    common::config(backend, PdConvention::Vllm)
}

const SSE: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 23\r\n\r\ndata: one\n\ndata: [DONE]";

#[test]
fn refused_worker_is_retried_marked_and_load_released() {
    let (good, seen) = fake_server(SSE);
    let (backend, forwarded) = fake_server("HTTP/1.1 204 No Content\r\nX-From: python\r\n\r\n");
    let refused = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // closed again: refuses
    let router = Arc::new(Router::new(RouterConfig::default(), None).unwrap());
    router.add_worker(0, WorkerSpec::default()).unwrap();
    router.add_worker(1, WorkerSpec::default()).unwrap();
    let marked = Arc::new(AtomicUsize::new(0));
    let m2 = marked.clone();
    let hook = Box::new(move |w: u64, reason: &str| {
        assert!(reason.contains("connection failed"), "{reason}");
        m2.fetch_add(1 + w as usize * 10, Ordering::SeqCst);
    });
    let dp = DataPlane::new(router.clone(), config(backend), Some(hook)).unwrap();
    dp.add_worker(0, &format!("http://{refused}"), Role::Both, None).unwrap();
    dp.add_worker(1, &format!("http://{good}/"), Role::Both, None).unwrap();
    let addr = dp.start().unwrap();
    // The prompt is "cached" on the refusing worker, so it is the first choice.
    let body = format!(r#"{{"prompt": "{}", "stream": true, "max_tokens": 2}}"#, "abcd".repeat(300));
    let hashes = kvroute_gateway::approx_prompt(&serde_json::from_str(&body).unwrap(), false, 64, kvroute_core::DEFAULT_SEED).unwrap();
    router.index().store(0, &hashes.hashes, None, kvroute_core::Tier::Device).unwrap();

    let resp = request(addr, "POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer k", &body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains(&format!("X-Kvroute-Worker: http://{good}\r\n")), "{resp}");
    assert!(resp.contains("Transfer-Encoding: chunked\r\n"), "streamed as it comes: {resp}");
    assert_eq!(dechunk(&resp), "data: one\n\ndata: [DONE]");
    let (head, sent) = seen.lock().unwrap()[0].clone();
    assert_eq!(sent, body.as_bytes(), "the request body is passed on unchanged");
    assert!(head.to_ascii_lowercase().contains("authorization: bearer k"), "{head}");
    assert_eq!(marked.load(Ordering::SeqCst), 1, "worker 0 reported once");
    assert_eq!(router.workers(), vec![1], "the refusing worker is out of routing");
    assert_eq!(router.num_in_flight(), 0);
    let m = dp.metrics();
    assert_eq!((m.retries, m.requests[&("/v1/completions".to_string(), "2xx".to_string())]), (1, 1));
    assert_eq!(dp.in_flight(), 0);
    assert!(!dp.approx().unwrap().is_empty());

    // Not the hot path: forwarded byte for byte to the backend, with the client's identity.
    let resp = request(addr, "GET /health HTTP/1.1", "");
    assert!(resp.starts_with("HTTP/1.1 204") && resp.contains("X-From: python"), "{resp}");
    let bad = request(addr, "POST /v1/completions HTTP/1.1", "{not json");
    assert!(bad.starts_with("HTTP/1.1 204"), "invalid bodies are the Python gateway's to answer: {bad}");
    let heads: Vec<String> = forwarded.lock().unwrap().iter().map(|(h, _)| h.to_ascii_lowercase()).collect();
    assert!(heads[0].starts_with("get /health") && heads[0].contains("x-kvroute-client: ip:127.0.0.1"), "{heads:?}");
    assert_eq!(forwarded.lock().unwrap()[1].1, b"{not json");

    // A declared length over the limit is answered before any of the body is read.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", 2 << 20).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 413") && resp.contains("request body larger than 1048576 bytes"), "{resp}");
    dp.stop();
    assert!(!dp.is_running());
    dp.stop();
}
