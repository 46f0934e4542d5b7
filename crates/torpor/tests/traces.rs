//! Traces over OTLP, end to end: a real OTLP/gRPC trace receiver (opentelemetry-proto's
//! `TraceService` served by tonic, the protocol a collector speaks) runs in the test, the real
//! daemon exports to it with `--otlp-endpoint`, and a workload of one tenant (create, park,
//! wake through a call) is checked in the spans received: the call's request span and the
//! wake's transition span are one trace with the right parent links, the client's W3C
//! `traceparent` is continued, the attributes name tenant, sandbox and route template, and no
//! token or env value appears anywhere in what was exported. Without the flag nothing is sent.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, ExecResult};
use torpor_api::Client;
use torpor_core::Tier;

/// What the receiver got: every export request, and how many connections it accepted.
#[derive(Clone, Default)]
struct Received {
    requests: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
    connections: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.requests.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// An OTLP/gRPC trace receiver on `listener`, counting the connections it accepts.
fn receiver(listener: std::net::TcpListener) -> (SocketAddr, Received) {
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    let received = Received::default();
    let counted = received.connections.clone();
    let incoming = futures::stream::unfold(listener, move |l| {
        let counted = counted.clone();
        async move {
            let accepted = l.accept().await.map(|(s, _)| {
                counted.fetch_add(1, Ordering::SeqCst);
                s
            });
            Some((accepted, l))
        }
    });
    let service = TraceServiceServer::new(received.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming),
    );
    (addr, received)
}

fn loopback_receiver() -> (SocketAddr, Received) {
    receiver(std::net::TcpListener::bind("127.0.0.1:0").unwrap())
}

/// One exported span with the resource it came from.
struct Got {
    span: Span,
    service: String,
}

fn spans(r: &Received) -> Vec<Got> {
    let mut out = Vec::new();
    for req in r.requests.lock().unwrap().iter() {
        for rs in &req.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|res| str_attr(&res.attributes, "service.name"))
                .unwrap_or_default();
            for ss in &rs.scope_spans {
                for span in &ss.spans {
                    out.push(Got {
                        span: span.clone(),
                        service: service.clone(),
                    });
                }
            }
        }
    }
    out
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a AnyValue> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn str_attr(attrs: &[KeyValue], key: &str) -> Option<String> {
    match attr(attrs, key)? {
        AnyValue::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

fn attrs_of(span: &Span) -> BTreeMap<String, String> {
    span.attributes
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(AnyValue::StringValue(s)) => s.clone(),
                Some(AnyValue::IntValue(i)) => i.to_string(),
                Some(other) => format!("{other:?}"),
                None => String::new(),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The request span of the call to `route` (by `http.route`) whose method is `method`.
fn request_spans<'a>(all: &'a [Got], method: &str, route: &str) -> Vec<&'a Got> {
    all.iter()
        .filter(|g| {
            let a = attrs_of(&g.span);
            a.get("route").map(String::as_str) == Some(route)
                && a.get("method").map(String::as_str) == Some(method)
        })
        .collect()
}

fn transition<'a>(all: &'a [Got], sandbox: &str, to: &str, cause: &str) -> Vec<&'a Got> {
    all.iter()
        .filter(|g| {
            let a = attrs_of(&g.span);
            g.span.name == "transition"
                && a.get("sandbox").map(String::as_str) == Some(sandbox)
                && a.get("to").map(String::as_str) == Some(to)
                && a.get("cause").map(String::as_str) == Some(cause)
        })
        .collect()
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const SANDBOX_SECRET: &str = "sandbox-env-secret-5d1c0b7e";
const EXEC_SECRET: &str = "exec-env-secret-9a4f2c61";

#[tokio::test(flavor = "multi_thread")]
async fn a_wake_is_one_trace_from_the_call_to_the_restore_exported_over_otlp_without_secrets() {
    let (addr, received) = loopback_receiver();
    let endpoint = format!("http://{addr}");
    let mut d = Daemon::start_with_env(
        &["--otlp-endpoint", &endpoint],
        // The flag wins over the variable, and the service is torpor by default.
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9"),
            ("OTEL_SERVICE_NAME", ""),
        ],
    )
    .await;
    let admin = d.client();
    let tenant = admin
        .create_tenant(&CreateTenantBody {
            name: "traced".into(),
            quotas: None,
        })
        .await
        .unwrap();
    let c = Client::new(&d.url(), &tenant.token);
    let id = c
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            env: BTreeMap::from([("API_SECRET".to_string(), SANDBOX_SECRET.to_string())]),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(c.sandbox(&id).await.unwrap().state, "parked");

    // The call that wakes it, inside the client's own trace.
    let body = serde_json::json!({
        "cmd": ["sh", "-c", "echo woke"],
        "env": {"EXEC_SECRET": EXEC_SECRET},
        "timeout_ms": 60000,
    });
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/sandboxes/{id}/exec", d.url()))
        .bearer_auth(&tenant.token)
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let r: ExecResult = resp.json().await.unwrap();
    assert_eq!(r.stdout.trim(), "woke");
    assert_eq!(c.sandbox(&id).await.unwrap().state, "running");

    // Stopping flushes the batch: everything is at the receiver once the daemon has exited.
    d.stop();
    let all = spans(&received);
    assert!(!all.is_empty(), "nothing exported:\n{}", d.log());
    assert!(all.iter().all(|g| g.service == "torpor"));

    // The call: one server span named after its route template, in the client's trace.
    let calls = request_spans(&all, "POST", "/v1/sandboxes/{id}/exec");
    assert_eq!(calls.len(), 1, "exec request spans");
    let call = &calls[0].span;
    assert_eq!(call.name, "POST /v1/sandboxes/{id}/exec");
    assert_eq!(call.kind, SpanKind::Server as i32);
    assert_eq!(hex(&call.trace_id), CLIENT_TRACE);
    assert_eq!(hex(&call.parent_span_id), CLIENT_SPAN);
    let a = attrs_of(call);
    assert_eq!(a.get("tenant").map(String::as_str), Some("traced"), "{a:?}");
    assert_eq!(
        a.get("http.route").map(String::as_str),
        Some("/v1/sandboxes/{id}/exec")
    );
    assert_eq!(
        a.get("http.request.method").map(String::as_str),
        Some("POST")
    );
    assert_eq!(
        a.get("http.response.status_code").map(String::as_str),
        Some("200")
    );
    assert!(a.get("request_id").is_some_and(|v| !v.is_empty()));
    assert!(!a.contains_key("traceparent"), "{a:?}");
    // Its closing line is an event of the span.
    assert!(
        call.events.iter().any(|e| e.name == "request answered"),
        "{:?}",
        call.events
    );

    // The wake: a transition span, child of the call, same trace.
    let wakes = transition(&all, &id, "running", "call");
    assert_eq!(wakes.len(), 1, "wake transitions");
    let wake = &wakes[0].span;
    assert_eq!(wake.trace_id, call.trace_id);
    assert_eq!(wake.parent_span_id, call.span_id);
    assert_eq!(
        attrs_of(wake).get("from").map(String::as_str),
        Some("parked")
    );
    // The restore and the agent's answer are within the call.
    assert!(wake.start_time_unix_nano >= call.start_time_unix_nano);
    assert!(wake.end_time_unix_nano <= call.end_time_unix_nano);

    // The park: its own request's child, another trace (no traceparent: a root request span).
    let parks = request_spans(&all, "POST", "/v1/sandboxes/{id}/suspend");
    assert_eq!(parks.len(), 1, "suspend request spans");
    let park_call = &parks[0].span;
    assert!(park_call.parent_span_id.is_empty());
    assert_ne!(park_call.trace_id, call.trace_id);
    let parked = transition(&all, &id, "parked", "api");
    assert_eq!(parked.len(), 1, "park transitions");
    assert_eq!(parked[0].span.trace_id, park_call.trace_id);
    assert_eq!(parked[0].span.parent_span_id, park_call.span_id);

    // The create: the tenant's request with its transition inside.
    let creates = request_spans(&all, "POST", "/v1/sandboxes");
    assert_eq!(creates.len(), 1);
    assert_eq!(
        attrs_of(&creates[0].span).get("tenant").map(String::as_str),
        Some("traced")
    );
    assert!(all.iter().any(|g| g.span.name == "transition"
        && g.span.parent_span_id == creates[0].span.span_id
        && attrs_of(&g.span).get("cause").map(String::as_str) == Some("create")));

    // No secret anywhere in what was exported: not in an attribute, an event or a name.
    let everything = format!("{:?}", received.requests.lock().unwrap());
    assert!(everything.contains(&id) && everything.contains("traced"));
    for secret in [
        tenant.token.as_str(),
        d.token().as_str(),
        SANDBOX_SECRET,
        EXEC_SECRET,
    ] {
        assert!(
            !everything.contains(secret),
            "a secret was exported: {secret}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn nothing_is_exported_unless_an_endpoint_is_configured() {
    // A receiver where the SDK would send if an exporter were built with no endpoint of
    // torpor's (the traces variable), and one on OTLP's default port when it is free.
    let (named, by_variable) = loopback_receiver();
    let default_port = std::net::TcpListener::bind("127.0.0.1:4317")
        .ok()
        .map(receiver);
    let traces_endpoint = format!("http://{named}");
    let mut d = Daemon::start_with_env(
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &traces_endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "10"),
        ],
    )
    .await;
    let c = d.client();
    let id = create(&c, "host").await;
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    let r = c.exec(&id, &sh("echo woke")).await.unwrap();
    assert_eq!(r.stdout.trim(), "woke");
    d.stop();
    assert!(!d.log().contains("exporting traces"), "{}", d.log());
    assert_eq!(by_variable.connections.load(Ordering::SeqCst), 0);
    assert!(by_variable.requests.lock().unwrap().is_empty());
    if let Some((_, r)) = default_port {
        assert_eq!(r.connections.load(Ordering::SeqCst), 0);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_standard_variables_switch_export_on_and_name_the_service() {
    let (addr, received) = loopback_receiver();
    let endpoint = format!("http://{addr}");
    let mut d = Daemon::start_with_env(
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_SERVICE_NAME", "torpor-edge-7"),
        ],
    )
    .await;
    d.client().sandboxes(None).await.unwrap();
    d.stop();
    let all = spans(&received);
    let listed = request_spans(&all, "GET", "/v1/sandboxes");
    assert_eq!(listed.len(), 1, "{}", d.log());
    assert_eq!(listed[0].service, "torpor-edge-7");
    assert!(received.connections.load(Ordering::SeqCst) >= 1);
}

#[test]
fn a_malformed_endpoint_is_refused_at_start_with_its_flag_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(BIN)
        .args([
            "up",
            "--listen",
            "127.0.0.1:0",
            "--otlp-endpoint",
            "https://x:4317",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--otlp-endpoint"), "{err}");
    assert!(err.contains("http://HOST:PORT"), "{err}");
}
