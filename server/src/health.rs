//! What the gRPC health service (`grpc.health.v1.Health`) says, under three kinds of name:
//! the server as a whole (`""` and `cleave.SplitInference`: readiness) and each model by its
//! bundle id, and [`LIVENESS`]. Everything is SERVING once the server serves (its models are
//! loaded and warmed before it listens). A device whose scheduler thread died makes the
//! server and that device's models NOT_SERVING until it is restarted (the other models stay
//! SERVING); a drain makes every name NOT_SERVING but [`LIVENESS`], which stays SERVING while
//! the process runs: an orchestrator must not kill a server that drains or restarts a device.

use std::collections::BTreeSet;

use cleave_common::pb::split_inference_server::SplitInferenceServer;
use tokio::sync::mpsc::UnboundedReceiver;
use tonic::server::NamedService;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::error::ServerError;
use crate::scheduler::watch::DeviceEvent;
use crate::service::Service;

/// The health service name for liveness (Kubernetes' `livenessProbe`), apart from readiness.
pub const LIVENESS: &str = "cleave.liveness";

/// The server's health, as the health service reports it.
pub(crate) struct Health {
    reporter: HealthReporter,
    /// Every model's bundle id.
    models: Vec<String>,
}

impl Health {
    /// Every name SERVING.
    pub(crate) async fn serving(reporter: HealthReporter, models: Vec<String>) -> Self {
        let health = Self { reporter, models };
        health.reporter.set_service_status(LIVENESS, ServingStatus::Serving).await;
        health.set_all(ServingStatus::Serving).await;
        health
    }

    /// Every name NOT_SERVING (a drain).
    pub(crate) async fn not_serving(&self) {
        self.set_all(ServingStatus::NotServing).await;
    }

    /// Follows the devices' failures and restarts until a device is down for good; then
    /// says why the server must exit.
    pub(crate) async fn follow(&self, events: &mut UnboundedReceiver<DeviceEvent>) -> ServerError {
        let mut failed: BTreeSet<String> = BTreeSet::new();
        while let Some(event) = events.recv().await {
            match event {
                DeviceEvent::Failed { device, models, cause: _ } => {
                    failed.insert(device);
                    self.set_server(ServingStatus::NotServing).await;
                    self.set_models(&models, ServingStatus::NotServing).await;
                }
                DeviceEvent::Restarted { device, models } => {
                    failed.remove(&device);
                    self.set_models(&models, ServingStatus::Serving).await;
                    if failed.is_empty() {
                        self.set_server(ServingStatus::Serving).await;
                    }
                }
                DeviceEvent::Down { device, cause } => return ServerError::DeviceFailed { device, cause },
            }
        }
        // Every scheduler is gone (the server is stopping): nothing more to follow.
        std::future::pending().await
    }

    async fn set_all(&self, status: ServingStatus) {
        self.set_server(status).await;
        self.set_models(&self.models, status).await;
    }

    async fn set_server(&self, status: ServingStatus) {
        self.reporter.set_service_status("", status).await;
        self.reporter.set_service_status(<SplitInferenceServer<Service> as NamedService>::NAME, status).await;
    }

    async fn set_models(&self, models: &[String], status: ServingStatus) {
        for model in models {
            self.reporter.set_service_status(model, status).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::mpsc;
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic_health::pb::health_check_response::ServingStatus as Status;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    use super::*;
    use crate::error::DeviceFailure;

    /// Asks the health service until `service` reports `want` (statuses change in the order
    /// the events come, each once the one before it is set).
    async fn until(client: &mut HealthClient<tonic::transport::Channel>, service: &str, want: Status) {
        let check = async {
            loop {
                let reply = client.check(HealthCheckRequest { service: service.to_string() }).await.unwrap().into_inner();
                if reply.status == want as i32 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), check).await.unwrap_or_else(|_| panic!("{service:?} never reported {want:?}"));
    }

    /// A health service on 127.0.0.1 and a client of it.
    async fn health_service() -> (tonic_health::server::HealthReporter, HealthClient<tonic::transport::Channel>) {
        let (reporter, service) = tonic_health::server::health_reporter();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(TcpListenerStream::new(listener)));
        (reporter, HealthClient::new(tonic::transport::Channel::from_shared(url).unwrap().connect().await.unwrap()))
    }

    #[tokio::test]
    async fn a_failed_device_takes_the_server_and_its_own_models_out_of_service_until_restarted_and_down_ends_serving() {
        let (reporter, mut client) = health_service().await;
        let server_name = <SplitInferenceServer<Service> as NamedService>::NAME;

        let health = Health::serving(reporter, vec!["a".into(), "b".into(), "c".into()]).await;
        for name in ["", server_name, "a", "b", "c"] {
            until(&mut client, name, Status::Serving).await;
        }
        let (events, mut rx) = mpsc::unbounded_channel();
        let follower = tokio::spawn(async move { health.follow(&mut rx).await.to_string() });
        let on = |device: &str, models: &[&str]| (device.to_string(), models.iter().map(|m| m.to_string()).collect::<Vec<_>>());
        let (gpu0, gpu0_models) = on("cuda:0", &["a", "b"]);
        let (gpu1, gpu1_models) = on("cuda:1", &["c"]);

        // Two devices fail: the server and their models are out of service.
        events.send(DeviceEvent::Failed { device: gpu0.clone(), models: gpu0_models.clone(), cause: DeviceFailure::Panicked("x".into()) }).unwrap();
        events.send(DeviceEvent::Failed { device: gpu1.clone(), models: gpu1_models.clone(), cause: DeviceFailure::Panicked("y".into()) }).unwrap();
        for name in ["", server_name, "a", "b", "c"] {
            until(&mut client, name, Status::NotServing).await;
        }
        let alive = client.check(HealthCheckRequest { service: LIVENESS.into() }).await.unwrap().into_inner().status;
        assert_eq!(alive, Status::Serving as i32, "a failed device is no reason to kill the process");
        // One comes back: its models serve, the server does not while the other is down.
        events.send(DeviceEvent::Restarted { device: gpu0.clone(), models: gpu0_models }).unwrap();
        until(&mut client, "b", Status::Serving).await;
        until(&mut client, "a", Status::Serving).await;
        for name in ["", server_name, "c"] {
            assert_eq!(client.check(HealthCheckRequest { service: name.into() }).await.unwrap().into_inner().status, Status::NotServing as i32);
        }
        events.send(DeviceEvent::Restarted { device: gpu1.clone(), models: gpu1_models }).unwrap();
        for name in ["c", "", server_name] {
            until(&mut client, name, Status::Serving).await;
        }
        // Down for good: the follower ends with why the server exits.
        let exit = DeviceFailure::NotRestarted(Box::new(DeviceFailure::Panicked("y".into())));
        events.send(DeviceEvent::Down { device: gpu1, cause: exit }).unwrap();
        let why = tokio::time::timeout(Duration::from_secs(10), follower).await.unwrap().unwrap();
        assert_eq!(
            why,
            "device cuda:1 failed: its scheduler panicked: y (`on_device_failure: exit`); the server exits for its supervisor to start it afresh"
        );
    }

    #[tokio::test]
    async fn a_drain_takes_every_name_out_of_service_but_liveness() {
        let (reporter, mut client) = health_service().await;
        let health = Health::serving(reporter, vec!["a".into()]).await;
        for name in ["", "a", LIVENESS] {
            until(&mut client, name, Status::Serving).await;
        }
        health.not_serving().await;
        for name in ["", <SplitInferenceServer<Service> as NamedService>::NAME, "a"] {
            until(&mut client, name, Status::NotServing).await;
        }
        let alive = client.check(HealthCheckRequest { service: LIVENESS.into() }).await.unwrap().into_inner().status;
        assert_eq!(alive, Status::Serving as i32);
    }
}
