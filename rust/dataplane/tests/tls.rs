//! `https://` workers: an engine behind a self-signed certificate (made here with rcgen) is served
//! once its certificate is trusted (`ca_file`), and refused with a clear 502 otherwise.

use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvroute_core::router::{Role, WorkerSpec};
use kvroute_core::{Router, RouterConfig};
use kvroute_dataplane::{DataPlane, PdConvention};
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

mod common;

const ANSWER: &str = r#"{"id":"cmpl-tls","choices":[{"text":"over tls"}]}"#;

/// A TLS engine on its own runtime thread: answers every POST with `ANSWER`, echoing nothing.
/// Returns its address and the PEM of its self-signed certificate (for 127.0.0.1).
fn tls_engine() -> (SocketAddr, String) {
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let pem = certified.cert.pem();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.key_pair.serialize_der()));
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![certified.cert.der().clone()], key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let Ok((tcp, _)) = listener.accept().await else { return };
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A client that does not trust the certificate fails the handshake: nothing to serve.
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    let svc = service_fn(|req: hyper::Request<hyper::body::Incoming>| async move {
                        let _ = req.into_body().collect().await;
                        let mut resp = hyper::Response::new(Full::new(Bytes::from_static(ANSWER.as_bytes())));
                        resp.headers_mut().insert("content-type", "application/json".parse().unwrap());
                        Ok::<_, Infallible>(resp)
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(tls), svc).await;
                });
            }
        });
    });
    (addr, pem)
}

fn post(addr: SocketAddr, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn https_workers_are_served_when_their_certificate_is_trusted() {
    let (engine, pem) = tls_engine();
    let ca = std::env::temp_dir().join(format!("kvroute-tls-test-{}.pem", std::process::id()));
    std::fs::write(&ca, pem).unwrap();
    let body = r#"{"prompt": "hello over tls", "max_tokens": 2}"#;
    for trusted in [true, false] {
        let router = Arc::new(Router::new(RouterConfig::default(), None).unwrap());
        router.add_worker(0, WorkerSpec::default()).unwrap();
        let mut cfg = common::config(PdConvention::Vllm);
        cfg.max_retries = 0;
        cfg.ca_file = trusted.then(|| ca.clone());
        let dp = DataPlane::new(router.clone(), cfg, None).unwrap();
        dp.add_worker(0, &format!("https://{engine}"), Role::Both, None).unwrap();
        let addr = dp.start(common::loopback(), None).unwrap();
        let resp = post(addr, body);
        if trusted {
            assert!(resp.starts_with("HTTP/1.1 200") && resp.ends_with(ANSWER), "{resp}");
            assert!(resp.contains(&format!("X-Kvroute-Worker: https://{engine}\r\n")), "{resp}");
        } else {
            assert!(
                resp.starts_with("HTTP/1.1 502") && resp.contains("certificate"),
                "an untrusted certificate is a clear failure: {resp}"
            );
        }
        assert_eq!(router.num_in_flight(), 0);
        dp.stop();
    }
    std::fs::remove_file(&ca).unwrap();
    let mut cfg = common::config(PdConvention::Vllm);
    cfg.ca_file = Some("/nonexistent/ca.pem".into());
    let err = DataPlane::new(Arc::new(Router::new(RouterConfig::default(), None).unwrap()), cfg, None).err().unwrap();
    assert!(err.to_string().contains("cannot read /nonexistent/ca.pem"), "{err}");
}
