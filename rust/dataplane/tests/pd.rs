//! PD mode on the data plane end to end on loopback, without Python: both conventions' request bodies
//! and headers, the decode answer relayed byte for byte, failover on the prefill side (refused, 5xx
//! before the decode's first byte), a client that goes away cancelling both upstream requests, and
//! the Router's load back to zero after each.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kvroute_core::router::{Role, WorkerSpec};
use kvroute_core::{Router, RouterConfig, Tier, DEFAULT_SEED};
use kvroute_dataplane::{approx_prompt, DataPlane, PdConvention, PlaneConfig};
use serde_json::{json, Value};

mod common;
use common::{dechunk, poll, Fake};

/// A fake engine answering from the request's JSON body.
fn fake(reply: impl Fn(&Value) -> Option<String> + Send + Sync + 'static) -> Fake {
    common::fake(move |b| reply(&serde_json::from_slice(b).unwrap()))
}

/// The `i`-th request a fake engine received: its head in lower case and its JSON body.
fn received(f: &Fake, i: usize) -> (String, Value) {
    let (head, body) = f.seen.lock().unwrap()[i].clone();
    (head.to_ascii_lowercase(), serde_json::from_slice(&body).unwrap())
}

fn http(status: &str, content_type: &str, body: &str) -> String {
    format!("HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n{body}", body.len())
}

fn config(pd_convention: PdConvention) -> PlaneConfig {
    common::config(pd_convention)
}

/// A decode engine's answer: its one chunk ends the choice (`finish_reason`), then `[DONE]`.
const DECODED: &str = "data: {\"choices\": [{\"text\": \" one\", \"finish_reason\": \"length\"}]}\n\ndata: [DONE]\n\n";

fn request(addr: SocketAddr, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nConnection: close";
    write!(s, "{head}\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Workers the data plane reported unhealthy, with the reason.
type Marked = Arc<Mutex<Vec<(u64, String)>>>;

/// A Router with these (id, role) workers and a data plane in front of them; unhealthy reports are
/// collected as (worker, reason).
fn plane(conv: PdConvention, workers: &[(u64, Role, SocketAddr, Option<u16>)]) -> (Arc<Router>, DataPlane, Marked) {
    let router = Arc::new(Router::new(RouterConfig::default(), None).unwrap());
    let marked = Marked::default();
    let m2 = marked.clone();
    let hook = Box::new(move |w: u64, reason: &str| m2.lock().unwrap().push((w, reason.to_string())));
    let dp = DataPlane::new(router.clone(), config(conv), Some(hook)).unwrap();
    for &(id, role, addr, port) in workers {
        router.add_worker(id, WorkerSpec { role, ..WorkerSpec::default() }).unwrap();
        dp.add_worker(id, &format!("http://{addr}"), role, port).unwrap();
    }
    (router, dp, marked)
}

/// Makes `worker` the router's first prefill choice for `body` (it "caches" the prompt).
fn pin(router: &Router, worker: u64, body: &str) {
    let p = approx_prompt(&serde_json::from_str(body).unwrap(), false, 64, DEFAULT_SEED, None).unwrap();
    router.index().store(worker, &p.hashes, None, Tier::Device).unwrap();
}

fn completions_2xx(dp: &DataPlane) -> u64 {
    dp.metrics().requests.get(&("/v1/completions".to_string(), "2xx".to_string())).copied().unwrap_or(0)
}

#[test]
fn vllm_prefill_then_decode_with_failover_on_the_prefill_side() {
    let answer =
        json!({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": {"remote_engine_id": "p1", "remote_block_ids": [4, 5]}});
    let prefill = fake(move |_| Some(http("200 OK", "application/json", &answer.to_string())));
    let decode = fake(|_| Some(http("200 OK", "text/event-stream", DECODED)));
    let refused = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // closed again: refuses
    let (router, dp, marked) = plane(
        PdConvention::Vllm,
        &[(0, Role::Prefill, refused, None), (1, Role::Prefill, prefill.addr, None), (2, Role::Decode, decode.addr, None)],
    );
    let addr = dp.start(common::loopback(), None).unwrap();
    let body = format!(
        r#"{{"prompt": "{}", "stream": true, "stream_options": {{"include_usage": true}}, "max_tokens": 7, "temperature": 0.10000000000000001, "seed": 123456789012345678901234567890}}"#,
        "abcd".repeat(300)
    );
    pin(&router, 0, &body);

    let resp = request(addr, &body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains(&format!("X-Kvroute-Worker: http://{}\r\n", decode.addr)), "{resp}");
    assert!(resp.contains("Content-Type: text/event-stream\r\n") && resp.contains("Transfer-Encoding: chunked\r\n"), "{resp}");
    assert_eq!(dechunk(&resp), DECODED, "the decode answer, byte for byte");

    let (phead, pbody) = received(&prefill, 0);
    assert!(phead.starts_with("post /v1/completions") && phead.contains("authorization: bearer k"), "{phead}");
    assert_eq!((&pbody["max_tokens"], &pbody["stream"], pbody.get("stream_options")), (&json!(1), &json!(false), None));
    assert_eq!(
        pbody["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null})
    );
    let (dhead, dbody) = received(&decode, 0);
    assert!(dhead.contains("authorization: bearer k"), "{dhead}");
    let mut expected: Value = serde_json::from_str(&body).unwrap();
    expected["kv_transfer_params"] = json!({"remote_engine_id": "p1", "remote_block_ids": [4, 5]});
    assert_eq!(dbody, expected, "the client's request plus the prefill's kv_transfer_params");

    let marked = marked.lock().unwrap().clone();
    assert_eq!(marked.len(), 1);
    assert!(marked[0].0 == 0 && marked[0].1.contains("connection failed"), "{marked:?}");
    assert_eq!(router.workers(), vec![1, 2], "the refusing prefill worker is out of routing");
    assert_eq!(router.num_in_flight(), 0, "prefill and decode load released");
    let m = dp.metrics();
    assert_eq!((m.retries, completions_2xx(&dp)), (1, 1));
    assert!(dp.workers().iter().all(|w| w.in_flight == 0));
    assert_eq!(dp.in_flight(), 0);
    dp.stop();
}

#[test]
fn sglang_bootstrap_to_both_retries_a_failed_prefill_with_a_new_room() {
    // The decode server meets its prefill in a room, as SGLang's do: it waits (bounded) for the
    // prefill of its room, answers when that one succeeded, and holds the request when it failed
    // (until the data plane cancels it).
    let rooms: Arc<(Mutex<HashMap<u64, bool>>, Condvar)> = Arc::default();
    let meet = |rooms: &Arc<(Mutex<HashMap<u64, bool>>, Condvar)>, b: &Value, ok: bool| {
        rooms.0.lock().unwrap().insert(b["bootstrap_room"].as_u64().unwrap(), ok);
        rooms.1.notify_all();
    };
    let (r1, r2, r3) = (rooms.clone(), rooms.clone(), rooms.clone());
    let good = fake(move |b| {
        meet(&r1, b, true);
        Some(http("200 OK", "application/json", r#"{"id": "prefilled"}"#))
    });
    let bad = fake(move |b| {
        meet(&r2, b, false);
        Some(http("500 Internal Server Error", "application/json", r#"{"error": "boom"}"#))
    });
    let decode = fake(move |b| {
        let room = b["bootstrap_room"].as_u64().unwrap();
        let (map, cv) = &*r3;
        let (map, _) = cv.wait_timeout_while(map.lock().unwrap(), Duration::from_secs(10), |m| !m.contains_key(&room)).unwrap();
        match map.get(&room) {
            Some(true) => Some(http("200 OK", "text/event-stream", DECODED)),
            Some(false) => None,
            None => Some(http("500 Internal Server Error", "text/plain", "no prefill came")),
        }
    });
    let (router, dp, marked) = plane(
        PdConvention::Sglang,
        &[(0, Role::Prefill, bad.addr, Some(9001)), (1, Role::Prefill, good.addr, Some(9002)), (2, Role::Decode, decode.addr, None)],
    );
    let addr = dp.start(common::loopback(), None).unwrap();
    let body = format!(r#"{{"prompt": "{}", "stream": true, "max_tokens": 3}}"#, "wxyz".repeat(300));
    pin(&router, 0, &body);

    let resp = request(addr, &body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains(&format!("X-Kvroute-Worker: http://{}\r\n", decode.addr)), "{resp}");
    assert_eq!(dechunk(&resp), DECODED);

    let client: Value = serde_json::from_str(&body).unwrap();
    let tagged = |b: &Value, port: u16| {
        let room = b["bootstrap_room"].as_u64().unwrap();
        let mut want = client.clone();
        want["bootstrap_host"] = json!("127.0.0.1");
        want["bootstrap_port"] = json!(port);
        want["bootstrap_room"] = json!(room);
        assert_eq!(b, &want);
        assert!(room < 1 << 63);
        room
    };
    let first = tagged(&received(&bad, 0).1, 9001);
    let second = tagged(&received(&good, 0).1, 9002);
    assert_ne!(first, second, "the retry meets in a new room");
    let good_body = received(&good, 0).1;
    let decoded = decode.seen.lock().unwrap().len(); // the guard must not outlive this line: `received` locks too
    assert!((0..decoded).any(|i| received(&decode, i).1 == good_body), "prefill and decode get the same request");
    // A decode request of the failed room (if it got there before the plane gave up on it) is cancelled.
    poll("the failed room's decode request to be cancelled", || {
        decode.closed.load(Ordering::SeqCst) + 1 == decode.seen.lock().unwrap().len()
    });
    let marked = marked.lock().unwrap().clone();
    assert!(marked.len() == 1 && marked[0].0 == 0 && marked[0].1.contains("HTTP 500"), "{marked:?}");
    assert_eq!(router.num_in_flight(), 0);
    assert_eq!((dp.metrics().retries, completions_2xx(&dp)), (1, 1));
    dp.stop();
}

#[test]
fn client_leaving_cancels_both_sglang_requests_and_releases_load() {
    let prefill = fake(|_| None);
    let decode = fake(|_| None);
    let (router, dp, _) =
        plane(PdConvention::Sglang, &[(0, Role::Prefill, prefill.addr, Some(8998)), (1, Role::Decode, decode.addr, None)]);
    let addr = dp.start(common::loopback(), None).unwrap();
    let body = r#"{"prompt": "held on both sides", "stream": true}"#;
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    poll("both upstream requests to arrive", || prefill.seen.lock().unwrap().len() == 1 && decode.seen.lock().unwrap().len() == 1);
    assert_eq!(router.num_in_flight(), 1);
    assert_eq!(dp.workers().iter().map(|w| w.in_flight).collect::<Vec<_>>(), vec![1, 1]);
    drop(s);
    poll("both upstream requests to be cancelled", || {
        prefill.closed.load(Ordering::SeqCst) == 1 && decode.closed.load(Ordering::SeqCst) == 1
    });
    poll("the load to be released", || router.num_in_flight() == 0 && dp.in_flight() == 0);
    assert!(dp.workers().iter().all(|w| w.in_flight == 0));
    assert_eq!(dp.metrics().client_disconnects, 1);
    dp.stop();
}
