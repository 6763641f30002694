//! `orcd serve`: the model over HTTP. The OpenAI API (`openai`), the worker API of
//! llama-orch's worker-orcd (`worker`) and Prometheus metrics (`metrics`) share one batching
//! engine; `generation` is a request's life on it.
//!
//! The server binds first and answers 503 while the model loads, so that whoever started it
//! can tell "loading" from "down". `/shutdown` and SIGTERM drain: new requests get 503, running
//! ones have `--drain-timeout` to finish, then the process exits.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use orcd::batch::{BatchEngine, BatchOptions};
use orcd::gguf::Gguf;

use crate::common::{ModelArgs, device_error};
use error::ApiError;
use generation::{Registry, Why};
use metrics::Metrics;

mod error;
mod generation;
mod metrics;
mod openai;
mod params;
mod worker;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the log line says which).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// KV cache pool size in tokens, shared by all requests (default: from free GPU memory;
    /// on the CPU the context length times --max-running).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    kv_tokens: Option<u64>,
    /// Requests generating at once at most.
    #[arg(long, default_value_t = BatchOptions::default().max_running)]
    max_running: usize,
    /// Requests waiting to start at most; more get 503 with Retry-After.
    #[arg(long, default_value_t = BatchOptions::default().max_queue)]
    max_queue: usize,
    /// Bearer token required on every route but /health (default: none, no authentication).
    #[arg(long, env = "ORCD_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model's name in the API: requests must name it, /v1/models lists it (default: the
    /// --model name, or the GGUF file's name without .gguf).
    #[arg(long)]
    served_model_name: Option<String>,
    /// A request's tokens never depend on what else runs: a sequence decoding alone stays on
    /// the batched pass instead of the faster single-sequence kernels.
    #[arg(long)]
    batch_invariant: bool,
    /// Seconds a request may take from arrival to its last token; later ones are cancelled.
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// Seconds a drain (/shutdown, SIGTERM) gives running requests before cancelling them.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
}

/// A request body larger than this is refused with 413.
const MAX_BODY: usize = 4 << 20;
/// A refused body is still read (and dropped) up to this size, so that the client, still
/// sending it, gets to read the 413 instead of a reset connection.
const DRAIN_BODY: usize = 64 << 20;

/// What every handler shares.
pub struct Server {
    api_key: Option<String>,
    model_name: String,
    request_timeout: Duration,
    drain_timeout: Duration,
    /// Set once the model has loaded.
    ready: OnceLock<Ready>,
    metrics: Arc<Metrics>,
    registry: Arc<Registry>,
    draining: AtomicBool,
    /// Wakes `serve` once a drain is over.
    drained: tokio::sync::Notify,
    started: Instant,
}

/// The loaded model.
struct Ready {
    engine: BatchEngine,
    /// The GGUF's quantization, as llama.cpp names its file types (`Q4_K_M`).
    quant_kind: &'static str,
}

impl Server {
    /// The engine; 503 while it loads (the gate answers that before any handler runs).
    fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready.get().ok_or_else(loading)
    }

    fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Starts a drain unless one is under way: refuse new requests, give running ones
    /// `drain_timeout`, cancel what is left, then wake `serve` to exit.
    fn drain(self: &Arc<Self>) {
        if self.draining.swap(true, Ordering::Relaxed) {
            return;
        }
        if let Some(ready) = self.ready.get() {
            ready.engine.shutdown();
        }
        let server = self.clone();
        tokio::spawn(async move {
            tracing::info!("draining: {:?} for running requests", server.drain_timeout);
            let idle = server.registry.idle();
            if tokio::time::timeout(server.drain_timeout, idle)
                .await
                .is_err()
            {
                tracing::warn!("drain timeout: cancelling the requests still running");
                server.registry.cancel_all(Why::Shutdown);
                let _ = tokio::time::timeout(Duration::from_secs(5), server.registry.idle()).await;
            }
            server.drained.notify_one();
        });
    }
}

fn loading() -> ApiError {
    ApiError::unavailable("the model is loading", 5)
}

fn shutting_down() -> ApiError {
    ApiError::unavailable("the server is shutting down", 5)
}

pub fn main(a: Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(serve(a));
    // The model may still be loading on a blocking thread (a drain during the load): do not
    // wait for it.
    rt.shutdown_background();
    result
}

async fn serve(a: Args) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
        .await
        .with_context(|| format!("binding {}:{}", a.host, a.port))?;
    let addr: SocketAddr = listener.local_addr()?;
    let server = Arc::new(Server {
        api_key: a.api_key.clone(),
        model_name: a
            .served_model_name
            .clone()
            .unwrap_or_else(|| model_name(&a.model.model)),
        request_timeout: Duration::from_secs(a.request_timeout),
        drain_timeout: Duration::from_secs(a.drain_timeout),
        ready: OnceLock::new(),
        metrics: Arc::default(),
        registry: Arc::default(),
        draining: AtomicBool::new(false),
        drained: tokio::sync::Notify::new(),
        started: Instant::now(),
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let http = tokio::spawn(
        axum::serve(listener, router(server.clone()))
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .into_future(),
    );
    tokio::spawn(on_signals(server.clone()));

    crate::note(&format!(
        "loading {}; http://{addr} answers 503 until it is ready",
        a.model.model
    ));
    let load = tokio::task::spawn_blocking(move || load(&a));
    tokio::select! {
        loaded = load => {
            let ready = loaded.context("the model's loader panicked")??;
            let _ = server.ready.set(ready);
            if server.is_draining() {
                // A drain that began during the load is over: nothing ran.
                return Ok(());
            }
            eprintln!("listening on http://{addr}");
        }
        () = server.drained.notified() => return Ok(()),
    }
    server.drained.notified().await;
    // Let the last responses leave, then close; idle keep-alive connections end at once.
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), http).await;
    Ok(())
}

/// Loads the model and starts the engine (blocking: seconds on the CPU).
fn load(a: &Args) -> Result<Ready> {
    let path = a.model.path()?;
    let quant_kind = quant_kind(&Gguf::open(&path)?);
    let opts = BatchOptions {
        max_running: a.max_running,
        max_queue: a.max_queue,
        kv_tokens: a.kv_tokens.map(|t| t as usize),
        batch_invariant: a.batch_invariant,
        ..BatchOptions::default()
    };
    let engine = BatchEngine::start(&path, &a.model.load_options(), &opts).map_err(device_error)?;
    tracing::info!("loaded {} on {}", path.display(), engine.device());
    Ok(Ready { engine, quant_kind })
}

/// SIGTERM and SIGINT (Ctrl-C) drain like `/shutdown`.
async fn on_signals(server: Arc<Server>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot listen for SIGTERM/SIGINT: only /shutdown drains");
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    server.drain();
}

/// `--model`'s name in the API: a models.lock name as is, a path by its file name.
fn model_name(model: &str) -> String {
    let path = std::path::Path::new(model);
    match path.file_name().and_then(|f| f.to_str()) {
        Some(file) if path.extension().is_some_and(|e| e == "gguf") => {
            file.trim_end_matches(".gguf").to_string()
        }
        _ => model.to_string(),
    }
}

/// llama.cpp's name for the GGUF's `general.file_type` (what the worker spec's `quant_kind`
/// reports).
fn quant_kind(g: &Gguf) -> &'static str {
    match g.get_u64("general.file_type") {
        Ok(0) => "F32",
        Ok(1) => "F16",
        Ok(2) => "Q4_0",
        Ok(3) => "Q4_1",
        Ok(7) => "Q8_0",
        Ok(8) => "Q5_0",
        Ok(9) => "Q5_1",
        Ok(10) => "Q2_K",
        Ok(11) => "Q3_K_S",
        Ok(12) => "Q3_K_M",
        Ok(13) => "Q3_K_L",
        Ok(14) => "Q4_K_S",
        Ok(15) => "Q4_K_M",
        Ok(16) => "Q5_K_S",
        Ok(17) => "Q5_K_M",
        Ok(18) => "Q6_K",
        Ok(32) => "BF16",
        _ => "unknown",
    }
}

fn router(server: Arc<Server>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*id}", get(openai::model))
        .route("/execute", post(worker::execute))
        .route("/cancel", post(worker::cancel))
        .route("/health", get(worker::health))
        .route("/shutdown", post(worker::shutdown))
        .route("/metrics", get(metrics_page))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(from_fn_with_state(server.clone(), gate))
        .with_state(server)
}

/// In front of every route: the API key (all but /health), then 503 while the model loads.
async fn gate(State(s): State<Arc<Server>>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key
        && req.uri().path() != "/health"
    {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same(g.trim().as_bytes(), key.as_bytes())) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key: send `Authorization: Bearer <key>`",
            )
            .code("invalid_api_key")
            .into_response();
        }
    }
    if s.ready.get().is_none() {
        return loading().into_response();
    }
    next.run(req).await
}

/// Compares in time that does not depend on where the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

async fn metrics_page(State(s): State<Arc<Server>>) -> Response {
    let status = s.ready.get().map(|r| r.engine.status());
    let gpu_memory = s.ready.get().and_then(|r| r.engine.device_memory_used());
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(status.as_ref(), gpu_memory),
    )
        .into_response()
}

/// Why a body could not be read.
enum BodyError {
    /// Larger than `MAX_BODY`.
    TooLarge,
    /// The connection failed while sending it.
    Broken(String),
}

impl BodyError {
    fn message(&self) -> String {
        match self {
            BodyError::TooLarge => format!("the request body is larger than {MAX_BODY} bytes"),
            BodyError::Broken(e) => format!("reading the request body: {e}"),
        }
    }

    fn status(&self) -> StatusCode {
        match self {
            BodyError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::Broken(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// The whole body, at most `MAX_BODY` bytes.
async fn read_body(body: Body) -> Result<Bytes, BodyError> {
    let mut stream = body.into_data_stream();
    let mut bytes = Vec::new();
    let mut seen = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Broken(e.to_string()))?;
        seen += chunk.len();
        if seen > DRAIN_BODY {
            break;
        }
        if seen <= MAX_BODY {
            bytes.extend_from_slice(&chunk);
        }
    }
    if seen > MAX_BODY {
        return Err(BodyError::TooLarge);
    }
    Ok(bytes.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_names() {
        assert_eq!(
            model_name("qwen2.5-coder-0.5b-instruct-q4_k_m"),
            "qwen2.5-coder-0.5b-instruct-q4_k_m"
        );
        assert_eq!(
            model_name("/models/Qwen2-7B.Q4_K_M.gguf"),
            "Qwen2-7B.Q4_K_M"
        );
    }

    #[test]
    fn api_keys_compare_whole() {
        assert!(same(b"secret", b"secret"));
        assert!(!same(b"secret", b"secreT"));
        assert!(!same(b"secret", b"secret2"));
        assert!(!same(b"", b"x"));
    }
}
