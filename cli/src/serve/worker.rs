//! The worker API of llama-orch's worker-orcd (`bin/.specs/01_M0_worker_orcd.md`, §7): a job
//! runs with `POST /execute` and streams server-sent events `started`, `token {t, i}`,
//! `metrics`, then exactly one `end` or `error {code, message, retriable}`; `POST /cancel`
//! stops a job; `GET /health` describes the worker; `POST /shutdown` drains.
//!
//! Errors before a job starts are HTTP statuses with the spec's body `{code, message,
//! retriable}` and codes (`INVALID_REQUEST`); a full queue, a drain and a model still loading
//! add `QUEUE_FULL`, `SHUTTING_DOWN` and `LOADING` (503, retriable), which the spec has no codes
//! for. (While the model loads, the gate in front of all routes answers first, in OpenAI's
//! error body.)
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use orcd::batch::{Request, Sampling};
use orcd::sampling::SamplingParams;
use serde_json::json;

use super::generation::{Failure, Generation, Refused, Step, fresh_seed};
use super::params::{FieldError, Fields};
use super::{BodyError, Server, read_body};

/// The spec's limits (M0-W-1300).
const MAX_PROMPT_CHARS: usize = 32768;
const MAX_TOKENS: i128 = 2048;
const MAX_STOP_TOKENS: usize = 32;

/// An error answered before a job starts.
pub struct WorkerError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl WorkerError {
    fn invalid(message: impl Into<String>) -> WorkerError {
        WorkerError {
            status: StatusCode::BAD_REQUEST,
            code: "INVALID_REQUEST",
            message: message.into(),
        }
    }

    fn busy(code: &'static str, message: impl Into<String>) -> WorkerError {
        WorkerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code,
            message: message.into(),
        }
    }
}

impl From<FieldError> for WorkerError {
    fn from(e: FieldError) -> WorkerError {
        WorkerError::invalid(e.message)
    }
}

impl From<BodyError> for WorkerError {
    fn from(e: BodyError) -> WorkerError {
        WorkerError {
            status: e.status(),
            code: "INVALID_REQUEST",
            message: e.message(),
        }
    }
}

impl IntoResponse for WorkerError {
    fn into_response(self) -> Response {
        let retriable = self.status == StatusCode::SERVICE_UNAVAILABLE;
        let body = json!({"code": self.code, "message": self.message, "retriable": retriable});
        let mut response = (self.status, axum::Json(body)).into_response();
        if retriable {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(1));
        }
        response
    }
}

/// `POST /execute`: starts a job and streams its events.
pub async fn execute(State(s): State<Arc<Server>>, body: Body) -> Result<Response, WorkerError> {
    let arrived = Instant::now();
    let f = Fields::parse(&read_body(body).await?)?;
    let job_id = match f.string("job_id")? {
        Some(j) if !j.is_empty() => j.to_string(),
        _ => {
            return Err(WorkerError::invalid(
                "`job_id` is required and must not be empty",
            ));
        }
    };
    let prompt = match f.string("prompt")? {
        Some(p) if !p.is_empty() && p.chars().count() <= MAX_PROMPT_CHARS => p,
        Some(p) if !p.is_empty() => {
            return Err(WorkerError::invalid(format!(
                "`prompt` has {} characters; at most {MAX_PROMPT_CHARS} are allowed",
                p.chars().count()
            )));
        }
        _ => {
            return Err(WorkerError::invalid(
                "`prompt` is required and must not be empty",
            ));
        }
    };
    if s.is_draining() {
        return Err(WorkerError::busy(
            "SHUTTING_DOWN",
            "the worker is shutting down",
        ));
    }
    let engine = &s
        .ready()
        .map_err(|e| WorkerError::busy("LOADING", e.message))?
        .engine;
    let tok = engine.tokenizer();
    let vocab = tok.vocab_size() as i128;
    let stop = f.stop("stop", 4)?;
    for s in &stop {
        let n = tok
            .encode(s)
            .map_err(|e| WorkerError::invalid(e.to_string()))?
            .len();
        if n > MAX_STOP_TOKENS {
            return Err(WorkerError::invalid(format!(
                "`stop` string {s:?} has {n} tokens; at most {MAX_STOP_TOKENS} are allowed"
            )));
        }
    }
    // Reported in `started`: the spec wants a seed the worker picked in the response.
    let seed = f
        .integer("seed", 0, u64::MAX as i128)?
        .map_or_else(fresh_seed, |n| n as u64);
    let sampling = Sampling {
        params: SamplingParams {
            temperature: f.number("temperature", 1.0, 0.0, 2.0)?,
            // top_p 0 keeps the single most likely token, as the smallest positive value does.
            top_p: f.number("top_p", 1.0, 0.0, 1.0)?.max(f32::MIN_POSITIVE),
            top_k: f.integer("top_k", 0, vocab)?.unwrap_or(0) as usize,
            min_p: f.number("min_p", 0.0, 0.0, 1.0)?,
            // The spec's range is 0.0-2.0; 0 would divide by zero, so it starts above.
            repeat_penalty: f.number("repetition_penalty", 1.0, f32::MIN_POSITIVE, 2.0)?,
            seed,
            ..SamplingParams::default()
        },
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
    };
    let max_tokens = f
        .integer("max_tokens", 1, MAX_TOKENS)?
        .unwrap_or(MAX_TOKENS) as usize;
    let ids = tok
        .encode(prompt)
        .map_err(|e| WorkerError::invalid(e.to_string()))?;
    let ctx = engine.ctx_len();
    if ids.len() > ctx {
        return Err(WorkerError::invalid(format!(
            "the prompt has {} tokens but the context holds {ctx}",
            ids.len()
        )));
    }
    let req = Request {
        prompt: ids,
        sampling,
        max_tokens,
        stop_ids: Vec::new(),
        stop_strings: stop,
        ignore_eos: false,
        logprobs: None,
    };
    let g = Generation::start(
        engine,
        &s.registry,
        &s.metrics,
        req,
        Some(job_id.clone()),
        s.request_timeout,
        arrived,
    )
    .map_err(|e| match e {
        Refused::Invalid(msg) => WorkerError::invalid(msg),
        Refused::Busy(msg) => WorkerError::busy("QUEUE_FULL", msg),
        Refused::DuplicateJob => WorkerError {
            status: StatusCode::CONFLICT,
            code: "INVALID_REQUEST",
            message: format!("job {job_id} is running already"),
        },
    })?;
    let started = json!({
        "job_id": job_id,
        "model": s.model_name,
        "started_at": humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
        "seed": seed,
    });
    Ok(events(g, started, arrived).into_response())
}

/// A job's events: `started`, a `token` for each piece of text, then `metrics` and `end`, or
/// `error`.
fn events(
    g: Generation,
    started: serde_json::Value,
    arrived: Instant,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let event =
        |name: &str, data: serde_json::Value| Event::default().event(name).data(data.to_string());
    let first = event("started", started);
    // (generation, index of the next token event)
    let rest = stream::unfold(Some((g, 0usize)), move |state| async move {
        let (mut g, i) = state?;
        match g.next().await {
            Ok(Step::Token { text, .. }) if text.is_empty() => Some((vec![], Some((g, i)))),
            Ok(Step::Token { text, .. }) => Some((
                vec![event("token", json!({"t": text, "i": i}))],
                Some((g, i + 1)),
            )),
            Ok(Step::Done {
                finish,
                usage,
                text,
            }) => {
                let mut out = Vec::new();
                if !text.is_empty() {
                    out.push(event("token", json!({"t": text, "i": i})));
                }
                let decode = usage.total.saturating_sub(usage.ttft);
                let tokens_per_sec = if decode.is_zero() {
                    0.0
                } else {
                    usage.completion_tokens.saturating_sub(1) as f64 / decode.as_secs_f64()
                };
                out.push(event(
                    "metrics",
                    json!({
                        "prompt_tokens": usage.prompt_tokens,
                        "tokens_out": usage.completion_tokens,
                        "time_to_first_token_ms": usage.ttft.as_millis() as u64,
                        "decode_time_ms": decode.as_millis() as u64,
                        "total_time_ms": arrived.elapsed().as_millis() as u64,
                        "tokens_per_sec": tokens_per_sec,
                    }),
                ));
                out.push(event(
                    "end",
                    json!({
                        "tokens_out": usage.completion_tokens,
                        "decode_time_ms": decode.as_millis() as u64,
                        "stop_reason": finish,
                    }),
                ));
                Some((out, None))
            }
            Err(f) => {
                let (code, retriable) = match &f {
                    Failure::Timeout(_) => ("INFERENCE_TIMEOUT", false),
                    Failure::Cancelled | Failure::ShuttingDown => ("CANCELLED", false),
                    Failure::Engine(m) if m.contains("out of memory") => ("VRAM_OOM", false),
                    Failure::Engine(m) if m.contains("CUDA") => ("CUDA_ERROR", false),
                    Failure::Engine(_) => ("INTERNAL", false),
                };
                let error = json!({"code": code, "message": f.message(), "retriable": retriable});
                Some((vec![event("error", error)], None))
            }
        }
    });
    let events = stream::iter([first])
        .chain(rest.flat_map(stream::iter))
        .map(Ok);
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// `POST /cancel {job_id}`: 202 whether or not the job still runs (idempotent).
pub async fn cancel(State(s): State<Arc<Server>>, body: Body) -> Result<Response, WorkerError> {
    let f = Fields::parse(&read_body(body).await?)?;
    let job_id = match f.string("job_id")? {
        Some(j) if !j.is_empty() => j,
        _ => {
            return Err(WorkerError::invalid(
                "`job_id` is required and must not be empty",
            ));
        }
    };
    let cancelled = s.registry.cancel_job(job_id);
    tracing::info!(
        "cancel {job_id}: {}",
        if cancelled {
            "cancelled"
        } else {
            "not running"
        }
    );
    Ok((StatusCode::ACCEPTED, axum::Json(json!({"job_id": job_id}))).into_response())
}

/// `GET /health`: the spec's fields (M0-W-1320), and the engine's load.
pub async fn health(State(s): State<Arc<Server>>) -> Result<Response, WorkerError> {
    let ready = s
        .ready()
        .map_err(|e| WorkerError::busy("LOADING", e.message))?;
    let engine = &ready.engine;
    let status = engine.status();
    let on_gpu = engine.device() != "cpu";
    Ok(axum::Json(json!({
        "status": "healthy",
        "model": s.model_name,
        // Weights in GPU memory; on the CPU there is none.
        "resident": on_gpu,
        "quant_kind": ready.quant_kind,
        // The GPU's memory in use as its driver counts it (total less free), as the spec's
        // `get_process_vram_usage` does; null if the driver cannot tell. The CPU uses none.
        "vram_bytes_used": if on_gpu { engine.device_memory_used() } else { Some(0) },
        "tokenizer_kind": "gguf-bpe",
        "vocab_size": engine.tokenizer().vocab_size(),
        "context_length": engine.ctx_len(),
        "uptime_seconds": s.started.elapsed().as_secs(),
        "device": engine.device(),
        "draining": s.is_draining(),
        "requests_running": status.running,
        "requests_waiting": status.waiting,
        "kv_blocks_used": status.kv_blocks_used,
        "kv_blocks_total": status.kv_blocks_total,
    }))
    .into_response())
}

/// `POST /shutdown`: 202, then a drain (new requests get 503; running ones finish within
/// `--drain-timeout`, else they end with `CANCELLED`) and exit with status 0.
pub async fn shutdown(State(s): State<Arc<Server>>) -> Response {
    s.drain();
    (
        StatusCode::ACCEPTED,
        axum::Json(json!({"status": "draining"})),
    )
        .into_response()
}
