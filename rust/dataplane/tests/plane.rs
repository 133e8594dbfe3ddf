//! The data plane end to end on loopback, without Python: a refusing worker is retried on the next
//! one, the answer is relayed byte for byte, the load is released, invalid bodies get 400, the
//! plane's own endpoints answer, admin requests reach the admin API, https workers are served.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::router::{Role, WorkerSpec};
use kvroute_core::{Router, RouterConfig};
use kvroute_dataplane::{DataPlane, PdConvention, PlaneConfig};

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

fn config() -> PlaneConfig {
    common::config(PdConvention::Vllm)
}

/// An engine's whole stream: one chunk that ends its choice (`finish_reason`), then `[DONE]`.
const SSE: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 73\r\n\r\ndata: {\"choices\":[{\"text\":\"one\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]";
const SSE_BODY: &str = "data: {\"choices\":[{\"text\":\"one\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]";

#[test]
fn refused_worker_is_retried_marked_and_load_released() {
    let (good, seen) = fake_server(SSE);
    let (admin, forwarded) = fake_server("HTTP/1.1 204 No Content\r\nX-From: python\r\n\r\n");
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
    let dp = DataPlane::new(router.clone(), config(), Some(hook)).unwrap();
    dp.add_worker(0, &format!("http://{refused}"), Role::Both, None).unwrap();
    dp.add_worker(1, &format!("http://{good}/"), Role::Both, None).unwrap();
    let addr = dp.start(common::loopback(), Some(admin)).unwrap();
    // The prompt is "cached" on the refusing worker, so it is the first choice.
    let body = format!(r#"{{"prompt": "{}", "stream": true, "max_tokens": 2}}"#, "abcd".repeat(300));
    let hashes =
        kvroute_dataplane::approx_prompt(&serde_json::from_str(&body).unwrap(), false, 64, kvroute_core::DEFAULT_SEED, None).unwrap();
    router.index().store(0, &hashes.hashes, None, kvroute_core::Tier::Device).unwrap();

    let resp = request(addr, "POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer k", &body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains(&format!("X-Kvroute-Worker: http://{good}\r\n")), "{resp}");
    assert!(resp.contains("Transfer-Encoding: chunked\r\n"), "streamed as it comes: {resp}");
    assert_eq!(dechunk(&resp), SSE_BODY);
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

    // Invalid bodies: the plane's own 400s, nothing sent upstream.
    for (body, needle) in [("{not json", "not valid JSON"), ("[1]", "JSON object"), (r#"{"prompt": ""}"#, "empty prompt")] {
        let bad = request(addr, "POST /v1/completions HTTP/1.1", body);
        assert!(bad.starts_with("HTTP/1.1 400") && bad.contains(needle), "{bad}");
    }
    assert_eq!(seen.lock().unwrap().len(), 1);
    // The plane's own endpoints.
    let health = request(addr, "GET /health HTTP/1.1", "");
    assert!(health.starts_with("HTTP/1.1 200") && health.contains(r#""status":"ok""#), "{health}");
    let metrics = request(addr, "GET /metrics HTTP/1.1", "");
    assert!(metrics.contains("kvroute_retries_total 1\n") && metrics.contains(r#"status="4xx"} 3"#), "{metrics}");
    assert!(request(addr, "GET /nowhere HTTP/1.1", "").starts_with("HTTP/1.1 404"));
    // Admin requests: passed to the admin API byte for byte, headers included.
    let resp = request(addr, "DELETE /admin/workers/1 HTTP/1.1\r\nAuthorization: Bearer t", "");
    assert!(resp.starts_with("HTTP/1.1 204") && resp.contains("X-From: python"), "{resp}");
    let heads: Vec<String> = forwarded.lock().unwrap().iter().map(|(h, _)| h.to_ascii_lowercase()).collect();
    assert!(heads[0].starts_with("delete /admin/workers/1") && heads[0].contains("authorization: bearer t"), "{heads:?}");

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

/// Reads from `s` until `marker` arrived (bounded by the socket's read timeout), then returns.
fn read_until(s: &mut TcpStream, marker: &str) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(marker) {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "connection closed before {marker:?}: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn a_stream_read_to_done_is_a_2xx_even_when_the_client_closes_before_its_end() {
    // The engine sends its last SSE event but not (yet) the end of its chunked body: the `openai`
    // client reads `data: [DONE]` and closes, as it does with real engines (issue #11: 5 of 20
    // finished streams were counted as disconnected).
    let fake = common::fake(|body| {
        let events = if String::from_utf8_lossy(body).contains("unfinished") {
            "data: one\n\n"
        } else {
            "data: {\"finish_reason\":\"stop\"}\n\ndata: [DONE]\n\n"
        };
        Some(format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{events}\r\n",
            events.len()
        ))
    });
    let router = Arc::new(Router::new(RouterConfig::default(), None).unwrap());
    router.add_worker(0, WorkerSpec::default()).unwrap();
    let dp = DataPlane::new(router.clone(), config(), None).unwrap();
    dp.add_worker(0, &format!("http://{}", fake.addr), Role::Both, None).unwrap();
    let addr = dp.start(common::loopback(), None).unwrap();
    let count = |class: &str| dp.metrics().requests.get(&("/v1/chat/completions".to_string(), class.to_string())).copied().unwrap_or(0);
    for (prompt, marker) in [("finished", "[DONE]"), ("unfinished", "data: one")] {
        let body = format!(r#"{{"messages": [{{"role": "user", "content": "{prompt}"}}], "stream": true}}"#);
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        let got = read_until(&mut s, marker);
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
        drop(s); // the client is done reading
        common::poll("the request's release", || dp.in_flight() == 0);
    }
    assert_eq!(count("2xx"), 1, "the stream read to its [DONE] is complete");
    assert_eq!(count("disconnected"), 1, "the one left before its last event is a disconnect");
    assert_eq!(router.num_in_flight(), 0);
    dp.stop();
}

#[test]
fn requests_on_a_worker_marked_unhealthy_end_at_once() {
    // A SIGTERMed vLLM aborts its engine but holds its open streams silent until it exits: once the
    // worker is marked unhealthy (a failed request, a failed probe), its streams end now, with the
    // in-band error, and a request still waiting for its answer is retried on another worker.
    let silent = common::fake(|body| {
        if String::from_utf8_lossy(body).contains("waiting") {
            return None; // never answers
        }
        let ev = "data: one\n\n";
        Some(format!("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{ev}\r\n", ev.len()))
    });
    let (good, _) = fake_server(SSE);
    let router = Arc::new(Router::new(RouterConfig::default(), None).unwrap());
    router.add_worker(0, WorkerSpec::default()).unwrap();
    router.add_worker(1, WorkerSpec::default()).unwrap();
    let dp = Arc::new(DataPlane::new(router.clone(), config(), None).unwrap());
    dp.add_worker(0, &format!("http://{}", silent.addr), Role::Both, None).unwrap();
    dp.add_worker(1, &format!("http://{good}"), Role::Both, None).unwrap();
    let addr = dp.start(common::loopback(), None).unwrap();
    let pin = |body: &str| {
        let hashes =
            kvroute_dataplane::approx_prompt(&serde_json::from_str(body).unwrap(), false, 64, kvroute_core::DEFAULT_SEED, None).unwrap();
        router.index().store(0, &hashes.hashes, None, kvroute_core::Tier::Device).unwrap();
    };
    let send = |body: &str| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        s
    };

    // 1. Mid-stream: the first event arrived, then silence (the read timeout is 5 s).
    let body = format!(r#"{{"prompt": "{}", "stream": true}}"#, "streaming ".repeat(100));
    pin(&body);
    let mut s = send(&body);
    read_until(&mut s, "data: one");
    let t0 = Instant::now();
    dp.set_healthy(0, false);
    let rest = read_until(&mut s, "upstream worker failed mid-stream");
    assert!(t0.elapsed() < Duration::from_secs(2), "the stream ended {:?} after the worker went down", t0.elapsed());
    assert!(rest.contains("the worker was marked unhealthy"), "{rest}");

    // 2. Before the first byte: retried on the other worker.
    dp.set_healthy(0, true);
    let _ = router.add_worker(0, WorkerSpec::default()); // the owner's probe adds it back; still there here
    let body = format!(r#"{{"prompt": "{}", "stream": true}}"#, "waiting ".repeat(100));
    pin(&body);
    let mut s = send(&body);
    common::poll("the request to reach the silent worker", || silent.seen.lock().unwrap().len() == 2);
    let t0 = Instant::now();
    router.remove_worker(0).unwrap(); // as the owner does when it marks a worker unhealthy
    dp.set_healthy(0, false);
    let got = read_until(&mut s, "[DONE]");
    assert!(t0.elapsed() < Duration::from_secs(2), "answered {:?} after the worker went down", t0.elapsed());
    assert!(got.contains(&format!("X-Kvroute-Worker: http://{good}\r\n")), "{got}");
    drop(s);
    common::poll("the requests' release", || dp.in_flight() == 0);
    assert_eq!(router.num_in_flight(), 0);
    dp.stop();
}

#[test]
fn an_event_stream_cut_short_is_an_error_never_a_quiet_end() {
    // An OpenAI stream ends each choice with a `finish_reason`, then sends `data: [DONE]`. A SIGTERMed
    // vLLM may end its open streams with `[DONE]` but no `finish_reason` (the e2e fault test saw one),
    // or close one cleanly before `[DONE]`: the client must learn that its answer is incomplete. A
    // stream that ends before its first byte reached the client is retried on another worker.
    let chunked = |chunks: &[&str]| {
        let mut out = String::from("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n");
        for c in chunks {
            out.push_str(&format!("{:x}\r\n{c}\r\n", c.len()));
        }
        out + "0\r\n\r\n"
    };
    let split = chunked(&["data: one\n\ndata: {\"finish_rea", "son\": \"length\"}\n\ndata: [DO", "NE]", "\n\n"]);
    let cut = chunked(&["data: one\n\n"]);
    let unfinished = chunked(&["data: one\n\n", "data: {\"text\": \"\\\"finish_reason\\\":\\\"stop\\\"\"}\n\n", "data: [DONE]\n\n"]);
    let empty = chunked(&[]);
    let refusal = r#"data: {"error": {"message": "bad", "code": 400}}"#.to_string() + "\n\n";
    let refused =
        format!("HTTP/1.1 400 Bad Request\r\nContent-Type: text/event-stream\r\nContent-Length: {}\r\n\r\n{refusal}", refusal.len());
    let flaky = common::fake(move |body| {
        let b = String::from_utf8_lossy(body);
        Some(match () {
            _ if b.contains("refused") => refused.clone(),
            _ if b.contains("split") => split.clone(),
            _ if b.contains("unfinished") => unfinished.clone(),
            _ if b.contains("cut") => cut.clone(),
            _ => empty.clone(),
        })
    });
    let (good, good_seen) = fake_server(SSE);
    let router = Arc::new(Router::new(RouterConfig::default(), None).unwrap());
    router.add_worker(0, WorkerSpec::default()).unwrap();
    router.add_worker(1, WorkerSpec::default()).unwrap();
    let reasons = Arc::new(std::sync::Mutex::new(Vec::new()));
    let r2 = reasons.clone();
    let hook = Box::new(move |w: u64, reason: &str| r2.lock().unwrap().push((w, reason.to_string())));
    let dp = DataPlane::new(router.clone(), config(), Some(hook)).unwrap();
    dp.add_worker(0, &format!("http://{}", flaky.addr), Role::Both, None).unwrap();
    dp.add_worker(1, &format!("http://{good}"), Role::Both, None).unwrap();
    let addr = dp.start(common::loopback(), None).unwrap();
    let send = |what: &str| {
        let body = format!(r#"{{"prompt": "{}", "stream": true}}"#, format!("{what} ").repeat(200));
        let hashes =
            kvroute_dataplane::approx_prompt(&serde_json::from_str(&body).unwrap(), false, 64, kvroute_core::DEFAULT_SEED, None).unwrap();
        router.index().store(0, &hashes.hashes, None, kvroute_core::Tier::Device).unwrap();
        request(addr, "POST /v1/completions HTTP/1.1", &body)
    };
    let back = || {
        dp.set_healthy(0, true);
        router.add_worker(0, WorkerSpec::default()).unwrap(); // as the owner's probe does
    };
    let cut_short = |got: &str, why: &str| {
        assert!(got.starts_with("data: one\n\n") && got.ends_with("\"code\":502}}\n\n"), "the error ends the stream: {got}");
        assert!(got.contains(&format!("upstream worker failed mid-stream: {why}")), "{got}");
        assert!(!got.contains("\ndata: [DONE]"), "no [DONE] event: {got}");
    };

    // An error answer is the engine's own, whatever its content type: relayed as written, no blame.
    let resp = send("refused");
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(
        resp.ends_with("data: {\"error\": {\"message\": \"bad\", \"code\": 400}}\n\n") || dechunk(&resp).ends_with("400}}\n\n"),
        "{resp}"
    );
    assert!(!resp.contains("upstream worker failed"), "{resp}");

    // Both markers split across frames are still found: relayed as they came, no error.
    let resp = send("split");
    assert!(resp.contains(&format!("X-Kvroute-Worker: http://{}\r\n", flaky.addr)), "{resp}");
    assert_eq!(dechunk(&resp), "data: one\n\ndata: {\"finish_reason\": \"length\"}\n\ndata: [DONE]\n\n");
    assert!(reasons.lock().unwrap().is_empty(), "a complete stream blames no worker");

    // A 200 event stream with no byte at all: nothing reached the client, so the next worker answers.
    let resp = send("empty");
    assert!(resp.contains(&format!("X-Kvroute-Worker: http://{good}\r\n")), "{resp}");
    assert_eq!(dechunk(&resp), SSE_BODY);
    assert_eq!(good_seen.lock().unwrap().len(), 1);
    assert_eq!(reasons.lock().unwrap()[0], (0, "the event stream ended before its first byte".to_string()));

    // Ended cleanly after its first event, before `[DONE]`: the in-band error, the worker marked.
    back();
    cut_short(&dechunk(&send("cut")), "the stream ended before its final `data: [DONE]`");
    assert!(reasons.lock().unwrap()[1].1.starts_with("stream broke: the stream ended before"), "{:?}", reasons.lock().unwrap());
    assert_eq!(router.workers(), vec![1], "the worker that cut its stream is out of routing until probed back");

    // `[DONE]` with no `finish_reason` before it (text that merely quotes one does not count): the
    // error takes the `[DONE]`'s place.
    back();
    let got = dechunk(&send("unfinished"));
    cut_short(&got, "the stream reached `data: [DONE]` without a finish_reason");
    assert!(got.contains(r#"data: {"text": "\"finish_reason\":\"stop\""}"#), "{got}");
    assert_eq!(reasons.lock().unwrap().len(), 3);
    common::poll("the requests' release", || dp.in_flight() == 0);
    assert_eq!(router.num_in_flight(), 0);
    dp.stop();
}
