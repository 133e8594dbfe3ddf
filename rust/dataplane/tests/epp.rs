//! The endpoint picker's gRPC health: `liveness` always serving; `readiness` and the ext_proc
//! service serving while a worker is healthy and the picker is not draining.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::router::{Role, WorkerSpec};
use kvroute_core::{Router, RouterConfig};
use kvroute_dataplane::{DataPlane, PdConvention};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

async fn status(client: &mut HealthClient<tonic::transport::Channel>, service: &str) -> ServingStatus {
    let r = client.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
    ServingStatus::try_from(r.status).unwrap()
}

/// Polls `service` until it reports `want` (readiness follows the workers within a poll period).
async fn becomes(client: &mut HealthClient<tonic::transport::Channel>, service: &str, want: ServingStatus) {
    let end = Instant::now() + Duration::from_secs(10);
    while status(client, service).await != want {
        assert!(Instant::now() < end, "{service} did not become {want:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn health_follows_the_workers_and_the_drain() {
    let router = Arc::new(Router::new(RouterConfig::default(), None).unwrap());
    router.add_worker(0, WorkerSpec::default()).unwrap();
    let dp = DataPlane::new(router, common::config(PdConvention::Vllm), None).unwrap();
    dp.add_worker(0, "http://127.0.0.1:9", Role::Both, None).unwrap();
    let (_, epp) = dp.start_picker(common::loopback(), None, common::loopback()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{epp}")).unwrap().connect().await.unwrap();
        let mut c = HealthClient::new(channel);
        assert_eq!(status(&mut c, "liveness").await, ServingStatus::Serving);
        becomes(&mut c, "readiness", ServingStatus::Serving).await;
        becomes(&mut c, "envoy.service.ext_proc.v3.ExternalProcessor", ServingStatus::Serving).await;
        let unknown = c.check(HealthCheckRequest { service: "no.such.Service".into() }).await.unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound);
        // No healthy worker: not ready (a gateway health-checking it fails open or closed as told).
        dp.set_healthy(0, false);
        becomes(&mut c, "readiness", ServingStatus::NotServing).await;
        becomes(&mut c, "envoy.service.ext_proc.v3.ExternalProcessor", ServingStatus::NotServing).await;
        assert_eq!(status(&mut c, "liveness").await, ServingStatus::Serving);
        dp.set_healthy(0, true);
        becomes(&mut c, "readiness", ServingStatus::Serving).await;
        // Draining: not ready while still alive.
        dp.set_draining(true);
        becomes(&mut c, "readiness", ServingStatus::NotServing).await;
        assert_eq!(status(&mut c, "liveness").await, ServingStatus::Serving);
    });
    dp.stop();
}

#[test]
fn pd_workers_are_refused() {
    let router = Arc::new(Router::new(RouterConfig::default(), None).unwrap());
    let dp = DataPlane::new(router, common::config(PdConvention::Vllm), None).unwrap();
    dp.add_worker(0, "http://127.0.0.1:9", Role::Prefill, None).unwrap();
    let err = dp.start_picker(common::loopback(), None, common::loopback()).unwrap_err();
    assert!(err.to_string().contains("unified workers"), "{err}");
}
