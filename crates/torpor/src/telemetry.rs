//! The daemon's tracing subscriber: log lines on stderr (filtered by `TORPOR_LOG`), and, only
//! when an endpoint is configured, the same spans exported as OpenTelemetry traces over
//! OTLP/gRPC.
//!
//! What is exported: spans and events of torpor's own crates at `info` and above, that is the
//! API's `request` span (one per HTTP request) and the engine's `transition` spans (create,
//! wake, freeze, park, suspend, delete, crash) with the log events inside them. A wake runs
//! inside the request that needed it, so the request, the wake's transition (with the restore)
//! and the agent's answer are one trace. Fields are the ones the log lines carry (ids, route
//! templates, tiers, causes), never a token or an env value. The `request` span is named
//! `METHOD ROUTE` (OpenTelemetry's HTTP convention) with kind server, `http.request.method`,
//! `http.route` and `http.response.status_code`; when the client sent a W3C `traceparent`,
//! the request span continues the client's trace (a malformed one is ignored).
//!
//! Spans go through a batch processor (its own thread, `OTEL_BSP_*` tune it) to the endpoint;
//! [`Telemetry::shutdown`] flushes what is queued when the daemon stops. An unreachable
//! collector costs dropped spans and a logged error, never a request.
//!
//! Owns: the subscriber set-up of `torpor up`. Must not touch: what the spans carry (the API's
//! `request_id.rs`, the engine's `#[tracing::instrument]`s decide that).

use std::borrow::Cow;
use std::collections::HashMap;
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_opentelemetry::OtelData;
use tracing_subscriber::filter::{filter_fn, EnvFilter};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use crate::common::CliError;

/// The standard variable naming the collector; `--otlp-endpoint` wins over it.
pub const ENV_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The standard variable naming the service in every exported span's resource.
pub const ENV_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
pub const DEFAULT_SERVICE_NAME: &str = "torpor";
/// The log filter's variable (`info` without it).
pub const ENV_LOG: &str = "TORPOR_LOG";
/// The API's span for one HTTP request (torpor_api::request_id).
const REQUEST_SPAN: &str = "request";
const REQUEST_TARGET: &str = "torpor_api::request_id";
/// The request span's field that carries the client's W3C `traceparent`, read here and not
/// exported as an attribute (the parent link says it).
const TRACEPARENT_FIELD: &str = "traceparent";
/// How long the shutdown waits for the last spans to reach the collector.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// `torpor up`'s trace flags.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TelemetryArgs {
    /// Export request and transition spans as OpenTelemetry traces over OTLP/gRPC to this
    /// collector, e.g. http://127.0.0.1:4317 (off without it; the service is named by
    /// OTEL_SERVICE_NAME, default torpor).
    #[arg(long, env = ENV_OTLP_ENDPOINT, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("--otlp-endpoint {endpoint:?}: expected http://HOST:PORT (OTLP over gRPC without TLS; put a local collector in front of a TLS one)")]
    InvalidEndpoint { endpoint: String },
    #[error("cannot set up the OTLP exporter for {endpoint}: {source}")]
    Exporter {
        endpoint: String,
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

impl From<TelemetryError> for CliError {
    fn from(e: TelemetryError) -> CliError {
        CliError(e.to_string())
    }
}

/// The installed subscriber's exporter, if any; [`Telemetry::shutdown`] flushes it.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// The endpoint to export to: `None` (off) when unset or empty.
pub fn endpoint(args: &TelemetryArgs) -> Result<Option<String>, TelemetryError> {
    let Some(raw) = args.otlp_endpoint.as_deref().map(str::trim) else {
        return Ok(None);
    };
    if raw.is_empty() {
        return Ok(None);
    }
    let invalid = || TelemetryError::InvalidEndpoint {
        endpoint: raw.to_string(),
    };
    let rest = raw.strip_prefix("http://").ok_or_else(invalid)?;
    let authority = rest.split('/').next().unwrap_or_default();
    let uri: Result<axum::http::Uri, _> = raw.parse();
    if authority.is_empty() || uri.is_err() {
        return Err(invalid());
    }
    Ok(Some(raw.to_string()))
}

/// The service name of exported spans: `OTEL_SERVICE_NAME`, else `torpor`.
pub fn service_name(from_env: Option<String>) -> String {
    from_env
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_string())
}

/// What the exporter receives: torpor's own spans and events at `info` and above (not the
/// HTTP and gRPC libraries', which include the exporter's own connection).
fn exported(meta: &Metadata<'_>) -> bool {
    meta.target().starts_with("torpor") && *meta.level() <= Level::INFO
}

impl Telemetry {
    /// Installs the process's subscriber: the log lines, plus the exporter when configured.
    /// Must run inside the Tokio runtime (the gRPC channel lives on it).
    pub fn init(args: &TelemetryArgs) -> Result<Telemetry, TelemetryError> {
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            // Colours only on a terminal: a log file or a collector gets plain `key=value`.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(
                EnvFilter::try_from_env(ENV_LOG).unwrap_or_else(|_| EnvFilter::new("info")),
            );
        let Some(endpoint) = endpoint(args)? else {
            let _ = tracing_subscriber::registry().with(logs).try_init();
            return Ok(Telemetry { provider: None });
        };
        let exporter = SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .build()
            .map_err(|source| TelemetryError::Exporter {
                endpoint: endpoint.clone(),
                source,
            })?;
        let resource = Resource::builder()
            .with_service_name(service_name(std::env::var(ENV_SERVICE_NAME).ok()))
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        let traces = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("torpor"))
            .with_location(false)
            .with_threads(false)
            .with_filter(filter_fn(exported));
        let _ = tracing_subscriber::registry()
            .with(logs)
            .with(traces)
            .with(HttpRequestSpans)
            .try_init();
        tracing::info!(endpoint = %endpoint, "exporting traces over OTLP/gRPC");
        Ok(Telemetry {
            provider: Some(provider),
        })
    }

    /// Sends what the batch holds and stops the exporter (at most [`FLUSH_LIMIT`]).
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else {
            return;
        };
        // The batch thread waits on the gRPC channel, which runs on this runtime: block a
        // blocking-pool thread, not a worker.
        let flushed = tokio::task::spawn_blocking(move || provider.shutdown());
        match tokio::time::timeout(FLUSH_LIMIT, flushed).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "traces not all exported at shutdown"),
            Ok(Err(_)) | Err(_) => {
                tracing::warn!(limit = ?FLUSH_LIMIT, "traces not all exported at shutdown")
            }
        }
    }
}

/// Makes the API's `request` span an HTTP server span as OpenTelemetry names them, and
/// continues the client's trace when it sent a `traceparent`. Sits above the OpenTelemetry
/// layer, so the span's OpenTelemetry data exists when it runs.
struct HttpRequestSpans;

fn is_request_span(meta: &Metadata<'_>) -> bool {
    meta.name() == REQUEST_SPAN && meta.target() == REQUEST_TARGET
}

#[derive(Default)]
struct RequestFields {
    method: Option<String>,
    route: Option<String>,
    traceparent: Option<String>,
}

impl Visit for RequestFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "method" => self.method = Some(value.to_string()),
            "route" => self.route = Some(value.to_string()),
            TRACEPARENT_FIELD => self.traceparent = Some(value.to_string()),
            _ => {}
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        // `%value` fields arrive here, formatted with Display.
        if matches!(field.name(), "method" | "route" | TRACEPARENT_FIELD) {
            self.record_str(field, &format!("{value:?}"));
        }
    }
}

/// The parent a W3C `traceparent` names, if it is well formed.
pub fn remote_parent(traceparent: &str) -> Option<opentelemetry::Context> {
    // The shape W3C fixes (version, trace id, parent id, flags), which the propagator does not
    // check field by field.
    let parts: Vec<&str> = traceparent.split('-').collect();
    let shape = [2, 32, 16, 2];
    if parts.len() != shape.len()
        || parts.iter().zip(shape).any(|(p, n)| {
            p.len() != n
                || !p
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    {
        return None;
    }
    let carrier = HashMap::from([(TRACEPARENT_FIELD.to_string(), traceparent.to_string())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

impl<S> Layer<S> for HttpRequestSpans
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if !is_request_span(attrs.metadata()) {
            return;
        }
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        let Some(data) = ext.get_mut::<OtelData>() else {
            return; // not exported
        };
        let mut f = RequestFields::default();
        attrs.record(&mut f);
        let method = f.method.unwrap_or_default();
        let route = f.route.filter(|r| r.starts_with('/'));
        data.builder.name = Cow::Owned(match &route {
            Some(r) => format!("{method} {r}"),
            None => method.clone(),
        });
        data.builder.span_kind = Some(SpanKind::Server);
        let attributes = data.builder.attributes.get_or_insert_with(Vec::new);
        attributes.retain(|kv| kv.key.as_str() != TRACEPARENT_FIELD);
        attributes.push(KeyValue::new("http.request.method", method));
        if let Some(r) = route {
            attributes.push(KeyValue::new("http.route", r));
        }
        if let Some(cx) = f.traceparent.as_deref().and_then(remote_parent) {
            data.parent_cx = cx;
            data.builder.trace_id = None;
            data.builder.sampling_result = None;
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        // The request's closing line carries its status.
        if event.metadata().target() != REQUEST_TARGET {
            return;
        }
        let mut status = StatusField(None);
        event.record(&mut status);
        let Some(code) = status.0 else { return };
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        if !is_request_span(span.metadata()) {
            return;
        }
        let mut ext = span.extensions_mut();
        let Some(data) = ext.get_mut::<OtelData>() else {
            return;
        };
        data.builder
            .attributes
            .get_or_insert_with(Vec::new)
            .push(KeyValue::new("http.response.status_code", code as i64));
        if code >= 500 {
            data.builder.status = Status::error("");
        }
    }
}

struct StatusField(Option<u64>);

impl Visit for StatusField {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "status" {
            self.0 = Some(value);
        }
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        if field.name() == "status" {
            self.0 = u64::try_from(value).ok();
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(e: &str) -> TelemetryArgs {
        TelemetryArgs {
            otlp_endpoint: Some(e.into()),
        }
    }

    #[test]
    fn an_endpoint_is_plain_http_with_a_host_and_unset_or_empty_means_off() {
        assert_eq!(endpoint(&TelemetryArgs::default()).unwrap(), None);
        assert_eq!(endpoint(&args("")).unwrap(), None);
        assert_eq!(endpoint(&args("  ")).unwrap(), None);
        assert_eq!(
            endpoint(&args("http://127.0.0.1:4317")).unwrap().as_deref(),
            Some("http://127.0.0.1:4317")
        );
        assert_eq!(
            endpoint(&args("http://collector.local:4317/"))
                .unwrap()
                .as_deref(),
            Some("http://collector.local:4317/")
        );
        for bad in [
            "127.0.0.1:4317",
            "https://collector:4317",
            "grpc://x:1",
            "http://",
            "http:// x:1",
        ] {
            assert!(
                matches!(
                    endpoint(&args(bad)),
                    Err(TelemetryError::InvalidEndpoint { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_service_is_torpor_unless_otel_service_name_says_otherwise() {
        assert_eq!(service_name(None), "torpor");
        assert_eq!(service_name(Some(" ".into())), "torpor");
        assert_eq!(service_name(Some("edge-1".into())), "edge-1");
    }

    #[test]
    fn a_well_formed_traceparent_names_the_parent_and_a_malformed_one_nothing() {
        let cx = remote_parent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let sc = cx.span().span_context().clone();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_remote());
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01-",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(remote_parent(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn only_torpors_own_spans_at_info_and_above_are_exported() {
        use tracing::callsite::Identifier;
        use tracing::metadata::Kind;
        struct Cs;
        impl tracing::Callsite for Cs {
            fn set_interest(&self, _: tracing::subscriber::Interest) {}
            fn metadata(&self) -> &Metadata<'_> {
                unimplemented!()
            }
        }
        static CS: Cs = Cs;
        let meta = |target: &'static str, level: Level| {
            Metadata::new(
                "x",
                target,
                level,
                None,
                None,
                None,
                tracing::field::FieldSet::new(&[], Identifier(&CS)),
                Kind::SPAN,
            )
        };
        assert!(exported(&meta("torpor_api::request_id", Level::INFO)));
        assert!(exported(&meta("torpor_control::engine", Level::WARN)));
        assert!(!exported(&meta("torpor_control::engine", Level::DEBUG)));
        assert!(!exported(&meta("h2::proto", Level::INFO)));
        assert!(!exported(&meta("tonic::transport", Level::ERROR)));
    }
}
