//! PD disaggregation on the data plane's hot path: vLLM's two-step handshake and SGLang's bootstrap to
//! both servers at once, with the semantics docs/gateway.md ("PD disaggregation") describes.
//!
//! Request bodies are edited as JSON text, key by key: the client's values reach the engines as the
//! client wrote them (no float or big-integer round trip), keys keep their order, and a key set here
//! replaces the client's in place, as Python's `dict` assignment does.

use std::borrow::Cow;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Response, StatusCode};
use kvroute_core::WorkerId;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use super::{error, open, relay, Admission, Attempted, Call, Dispatch, Failure, Hold, Lease, PlaneBody, Worker};

/// How a prefill and a decode server are paired (`--pd-convention`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PdConvention {
    /// The prefill runs first with `max_tokens=1` and `do_remote_decode`; the decode request carries
    /// the `kv_transfer_params` it returned (NIXL and vLLM's other KV connectors).
    #[default]
    Vllm,
    /// The same request, tagged with the prefill server's bootstrap address and a random room, goes
    /// to both at once.
    Sglang,
}

impl PdConvention {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "vllm" => Some(PdConvention::Vllm),
            "sglang" => Some(PdConvention::Sglang),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PdConvention::Vllm => "vllm",
            PdConvention::Sglang => "sglang",
        }
    }
}

/// What the prefill of vLLM's convention asks for: keep the KV for a remote decode.
const REMOTE_DECODE: &str = r#"{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}"#;

/// A JSON object as ordered (key, raw value text) pairs. A repeated key keeps its first position and
/// its last value (Python's `json.loads` into a dict).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JsonFields<'a> {
    items: Vec<(String, Cow<'a, str>)>,
}

/// Above this many keys, `set` finds a key through a hash index instead of a scan (a body of a
/// million keys must not cost a million squared comparisons).
const SCAN_KEYS: usize = 16;

impl<'a> JsonFields<'a> {
    /// The fields of a JSON object; `Err` says why the text is not one (invalid JSON, or another type).
    pub fn parse(text: &'a [u8]) -> Result<JsonFields<'a>, serde_json::Error> {
        serde_json::from_slice(text)
    }

    /// The raw JSON text of `key`'s value.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.items.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_ref())
    }

    pub fn contains(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// Sets `key` to the raw JSON text `value`: in place when present, else appended.
    pub fn set(&mut self, key: &str, value: impl Into<Cow<'a, str>>) {
        let value = value.into();
        match self.items.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.items.push((key.to_string(), value)),
        }
    }

    pub fn remove(&mut self, key: &str) {
        self.items.retain(|(k, _)| k != key);
    }

    /// The object as JSON text, with the separators of Python's `json.dumps`.
    pub fn to_bytes(&self) -> Bytes {
        let len: usize = self.items.iter().map(|(k, v)| k.len() + v.len() + 6).sum();
        let mut out = Vec::with_capacity(len + 2);
        out.push(b'{');
        for (i, (k, v)) in self.items.iter().enumerate() {
            if i > 0 {
                out.extend_from_slice(b", ");
            }
            // Writing a string into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut out, k);
            out.extend_from_slice(b": ");
            out.extend_from_slice(v.as_bytes());
        }
        out.push(b'}');
        Bytes::from(out)
    }
}

impl<'de> Deserialize<'de> for JsonFields<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = JsonFields<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonFields<'de>, A::Error> {
                let mut items: Vec<(String, Cow<'de, str>)> = Vec::new();
                let mut index: Option<hashbrown::HashMap<String, usize>> = None;
                while let Some((k, v)) = map.next_entry::<String, &'de RawValue>()? {
                    let v = Cow::Borrowed(v.get());
                    if index.is_none() && items.len() >= SCAN_KEYS {
                        index = Some(items.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect());
                    }
                    let at = match &index {
                        Some(ix) => ix.get(&k).copied(),
                        None => items.iter().position(|(key, _)| *key == k),
                    };
                    match at {
                        Some(i) => items[i].1 = v,
                        None => {
                            if let Some(ix) = index.as_mut() {
                                ix.insert(k.clone(), items.len());
                            }
                            items.push((k, v));
                        }
                    }
                }
                Ok(JsonFields { items })
            }
        }
        d.deserialize_map(Fields)
    }
}

/// vLLM's prefill request: at most one output token, not streamed, KV kept for the decode server.
pub fn vllm_prefill_body(body: &JsonFields<'_>) -> Bytes {
    let mut p = body.clone();
    p.set("kv_transfer_params", REMOTE_DECODE);
    p.set("stream", "false");
    p.remove("stream_options");
    p.set("max_tokens", "1");
    if p.contains("max_completion_tokens") {
        p.set("max_completion_tokens", "1");
    }
    p.to_bytes()
}

/// The `kv_transfer_params` a vLLM prefill answered (raw JSON text; `null` when the answer is not an
/// object or has none). `Err` when the answer is not JSON at all.
pub fn returned_kv_transfer_params(answer: &[u8]) -> Result<String, String> {
    let value: &RawValue = serde_json::from_slice(answer).map_err(|e| format!("prefill answered non-JSON: {e}"))?;
    if !value.get().trim_start().starts_with('{') {
        return Ok("null".into());
    }
    let fields = JsonFields::parse(value.get().as_bytes()).map_err(|e| format!("prefill answered non-JSON: {e}"))?;
    Ok(fields.get("kv_transfer_params").unwrap_or("null").to_string())
}

/// vLLM's decode request: the client's request plus what the prefill returned.
pub fn vllm_decode_body(body: &JsonFields<'_>, kv_transfer_params: &str) -> Bytes {
    let mut d = body.clone();
    d.set("kv_transfer_params", kv_transfer_params.to_string());
    d.to_bytes()
}

/// SGLang's request for both servers: the client's, tagged with the prefill server's bootstrap
/// address and the room the two meet in.
pub fn sglang_body(body: &JsonFields<'_>, host: &str, port: Option<u16>, room: u64) -> Bytes {
    let mut t = body.clone();
    t.set("bootstrap_host", serde_json::Value::from(host).to_string());
    t.set("bootstrap_port", port.map_or_else(|| "null".to_string(), |p| p.to_string()));
    t.set("bootstrap_room", room.to_string());
    t.to_bytes()
}

/// A random 63-bit bootstrap room (Python's `random.getrandbits(63)`): a counter through SipHash
/// under keys drawn from the OS once per process.
pub fn bootstrap_room() -> u64 {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    KEYS.get_or_init(RandomState::new).hash_one(n) >> 1
}

/// What a PD response keeps alive besides the decode worker's dispatch: SGLang's prefill request
/// (aborted if still running when the response ends) and its count on the prefill worker.
#[derive(Default)]
pub(super) struct PdHold {
    _prefill: Option<Dispatch>,
    _prefill_request: Option<AbortOnDrop>,
}

/// Aborts a spawned upstream request when dropped (its connection is closed; the engine aborts it).
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One attempt of a disaggregated request on `prefill` and `decode` as the router chose them.
pub(super) async fn serve(call: &Call<'_>, prefill: WorkerId, decode: WorkerId, lease: Lease, adm: Admission) -> Attempted {
    let (Some(pw), Some(dw)) = (call.sh.worker(prefill), call.sh.worker(decode)) else {
        let missing = if call.sh.worker(prefill).is_none() { prefill } else { decode };
        return Err((adm, Failure::unknown(missing)));
    };
    let body = match JsonFields::parse(call.raw) {
        Ok(b) => b,
        // The hot path only takes JSON objects, so this is unreachable; answer with a 400 all the same.
        Err(_) => return Ok(adm.respond(error(400, "request body must be a JSON object", "invalid_request_error", None))),
    };
    match call.sh.cfg.pd_convention {
        PdConvention::Vllm => vllm(call, &body, pw, dw, lease, adm).await,
        PdConvention::Sglang => sglang(call, &body, pw, dw, lease, adm).await,
    }
}

/// vLLM's convention: a max_tokens=1 prefill asking for remote decode, then the decode request
/// carrying the kv_transfer_params the prefill returned.
async fn vllm(call: &Call<'_>, body: &JsonFields<'_>, pw: Arc<Worker>, dw: Arc<Worker>, mut lease: Lease, adm: Admission) -> Attempted {
    let prefill_body = vllm_prefill_body(body);
    let dispatch = Dispatch::new(pw.clone());
    let answer = open(call.sh, &pw, call.endpoint, call.headers, &prefill_body, false).await;
    drop(dispatch);
    let (status, content_type, data, _) = match answer {
        Ok(a) => a,
        Err(reason) => return Err((adm, Failure::of(&pw, reason))),
    };
    if status != StatusCode::OK {
        // A 4xx from the prefill is the client's error: pass it through (the load is cancelled).
        let mut resp = Response::new(PlaneBody::full(data));
        *resp.status_mut() = status;
        resp.headers_mut().insert(CONTENT_TYPE, content_type);
        return Ok(adm.respond(resp));
    }
    let params = match returned_kv_transfer_params(&data) {
        Ok(p) => p,
        Err(reason) => return Err((adm, Failure::of(&pw, reason))),
    };
    lease.prefill_done();
    let decode_body = vllm_decode_body(body, &params);
    let dispatch = Dispatch::new(dw.clone());
    match open(call.sh, &dw, call.endpoint, call.headers, &decode_body, call.stream).await {
        Ok(opened) => {
            let hold = Hold { _lease: Some(lease), _dispatch: Some(dispatch), ..Hold::default() };
            Ok(relay(call.sh, &dw, opened, hold, adm))
        }
        Err(reason) => Err((adm, Failure::of(&dw, reason))),
    }
}

/// SGLang's convention: the tagged request goes to both servers at once; the client gets the decode
/// server's response. A prefill failure seen before the decode's first byte fails the attempt (and
/// cancels the decode request); after it, the prefill's outcome no longer matters.
async fn sglang(call: &Call<'_>, body: &JsonFields<'_>, pw: Arc<Worker>, dw: Arc<Worker>, mut lease: Lease, adm: Admission) -> Attempted {
    let data = sglang_body(body, &pw.host, pw.bootstrap_port, bootstrap_room());
    let prefill_dispatch = Dispatch::new(pw.clone());
    let decode_dispatch = Dispatch::new(dw.clone());
    let (tx, mut prefilled) = oneshot::channel::<Result<(), String>>();
    let task = {
        let (sh, pw, headers, data, endpoint) = (call.sh.clone(), pw.clone(), call.headers.clone(), data.clone(), call.endpoint);
        tokio::spawn(async move {
            let outcome = open(&sh, &pw, endpoint, &headers, &data, false).await.map(|_| ());
            let _ = tx.send(outcome);
        })
    };
    let prefill_request = AbortOnDrop(task.abort_handle());
    let decode = open(call.sh, &dw, call.endpoint, call.headers, &data, call.stream);
    tokio::pin!(decode);
    let opened = tokio::select! {
        // Both done at once: the prefill's failure is the one reported, as in Python.
        biased;
        p = &mut prefilled => {
            match p {
                Ok(Ok(())) => lease.prefill_done(),
                Ok(Err(reason)) => return Err((adm, Failure::of(&pw, reason))),
                Err(_) => return Err((adm, Failure::of(&pw, "the prefill request ended without an answer".into()))),
            }
            decode.await
        }
        d = &mut decode => {
            match prefilled.try_recv() {
                Ok(Err(reason)) => return Err((adm, Failure::of(&pw, reason))),
                Ok(Ok(())) => lease.prefill_done(),
                Err(_) => {} // still running: it finishes (or is aborted) while the answer streams
            }
            d
        }
    };
    match opened {
        Ok(opened) => {
            lease.prefill_done(); // the decode server produced output: its prefill side is done
            let pd = PdHold { _prefill: Some(prefill_dispatch), _prefill_request: Some(prefill_request) };
            let hold = Hold { _lease: Some(lease), _dispatch: Some(decode_dispatch), _pd: Some(pd), ..Hold::default() };
            Ok(relay(call.sh, &dw, opened, hold, adm))
        }
        Err(reason) => Err((adm, Failure::of(&dw, reason))),
    }
}

/// The host a worker URL names, as Python's `urlsplit(url).hostname` gives it (lowercase, an IPv6
/// address without brackets): SGLang's `bootstrap_host`.
pub(super) fn url_host(url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri.host()?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    Some(host.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn fields(v: &str) -> JsonFields<'_> {
        JsonFields::parse(v.as_bytes()).unwrap()
    }

    fn value(b: &Bytes) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn fields_keep_order_text_and_pythons_duplicate_rule() {
        let f = fields(r#" {"b": 1.10, "a": [1, 2], "b": 18446744073709551616123, "é\"": "x"} "#);
        assert_eq!(f.get("b"), Some("18446744073709551616123"), "the last value, as the client wrote it");
        assert_eq!(&f.to_bytes()[..], r#"{"b": 18446744073709551616123, "a": [1, 2], "é\"": "x"}"#.as_bytes());
        assert!(JsonFields::parse(b"[1]").is_err() && JsonFields::parse(b"{").is_err() && JsonFields::parse(b"").is_err());
        // Many keys: the hash index keeps the same rule.
        let many: String = (0..40).map(|i| format!(r#""k{}": {i}"#, i % 30)).collect::<Vec<_>>().join(", ");
        let f = fields(Box::leak(format!("{{{many}}}").into_boxed_str()));
        assert_eq!(f.items.len(), 30);
        assert_eq!((f.get("k0"), f.get("k9"), f.get("k10"), f.items[0].0.as_str()), (Some("30"), Some("39"), Some("10"), "k0"));
    }

    #[test]
    fn vllm_bodies_are_the_python_gateways() {
        let client = r#"{"model": "m", "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 9, "max_completion_tokens": 9, "temperature": 0.7}"#;
        let f = fields(client);
        let p = vllm_prefill_body(&f);
        assert_eq!(
            value(&p),
            json!({"model": "m", "stream": false, "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0.7,
                   "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                                          "remote_block_ids": null, "remote_host": null, "remote_port": null}})
        );
        let keys: Vec<String> = fields(std::str::from_utf8(&p).unwrap()).items.into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["model", "stream", "max_tokens", "max_completion_tokens", "temperature", "kv_transfer_params"]);
        let short = vllm_prefill_body(&fields(r#"{"prompt": "x"}"#));
        assert_eq!(value(&short)["max_tokens"], 1);
        assert!(value(&short).get("max_completion_tokens").is_none(), "only set when the client sent it");

        let ktp =
            returned_kv_transfer_params(br#"{"id": 1, "kv_transfer_params": {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}}"#);
        assert_eq!(ktp.as_deref(), Ok(r#"{"remote_engine_id": "p0", "remote_block_ids": [1, 2]}"#));
        assert_eq!(returned_kv_transfer_params(br#"{"id": 1}"#).as_deref(), Ok("null"));
        assert_eq!(returned_kv_transfer_params(b" [1, 2]").as_deref(), Ok("null"));
        assert!(returned_kv_transfer_params(b"<html>").unwrap_err().starts_with("prefill answered non-JSON"));
        let d = vllm_decode_body(&f, r#"{"remote_engine_id": "p0"}"#);
        let mut expected: Value = serde_json::from_str(client).unwrap();
        expected["kv_transfer_params"] = json!({"remote_engine_id": "p0"});
        assert_eq!(value(&d), expected, "the client's request, unchanged, plus the prefill's params");
    }

    #[test]
    fn sglang_body_tags_the_request() {
        let f = fields(r#"{"bootstrap_room": "client's", "prompt": "x"}"#);
        let t = sglang_body(&f, "p0.local", Some(8998), 42);
        assert_eq!(&t[..], br#"{"bootstrap_room": 42, "prompt": "x", "bootstrap_host": "p0.local", "bootstrap_port": 8998}"#);
        assert_eq!(value(&sglang_body(&f, "::1", None, 7))["bootstrap_port"], Value::Null);
        let rooms: std::collections::HashSet<u64> = (0..1000).map(|_| bootstrap_room()).collect();
        assert_eq!(rooms.len(), 1000);
        assert!(rooms.iter().all(|&r| r < 1 << 63));
        assert!(rooms.iter().any(|&r| r >= 1 << 62), "uses the full 63 bits");
    }

    #[test]
    fn bootstrap_host_is_pythons_hostname() {
        assert_eq!(url_host("http://P0.Example:30000").as_deref(), Some("p0.example"));
        assert_eq!(url_host("http://[::1]:8000/v1").as_deref(), Some("::1"));
        assert_eq!(url_host("http://user:pw@10.0.0.1:1").as_deref(), Some("10.0.0.1"));
        assert_eq!(PdConvention::from_name("sglang").map(PdConvention::name), Some("sglang"));
        assert_eq!(PdConvention::from_name("nixl"), None);
    }
}
