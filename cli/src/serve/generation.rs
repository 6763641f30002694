//! One request's life on the engine, shared by the OpenAI and the worker API: submitted,
//! its events read under the per-request timeout, counted in the metrics, listed where
//! `/cancel` and a drain can reach it, and cancelled when whoever waits for it goes away
//! (a dropped `Generation` is a client that disconnected).
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use orcd::batch::{
    BatchEngine, CancelHandle, FinishReason, Request, SeqEvent, SubmitError, TokenLogprob, Usage,
};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;

use super::metrics::{Metrics, Outcome};

/// A seed for a request that names none: different for every request.
pub fn fresh_seed() -> u64 {
    // std seeds every RandomState from the OS's randomness and steps it for each new one.
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// Who cancelled a request, so that its end can say why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// `/cancel`.
    Client,
    /// A drain that ran out of time.
    Shutdown,
    Timeout,
}

/// The requests under way, for `/cancel` (by job id) and the drain (all of them).
pub struct Registry {
    live: Mutex<Live>,
    /// How many requests are under way; the drain waits for 0.
    count: watch::Sender<usize>,
}

#[derive(Default)]
struct Live {
    next_id: u64,
    requests: HashMap<u64, Entry>,
    jobs: HashMap<String, u64>,
}

struct Entry {
    cancel: CancelHandle,
    why: Arc<OnceLock<Why>>,
    job: Option<String>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            live: Mutex::default(),
            count: watch::Sender::new(0),
        }
    }
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Cancels the worker job `job_id`; false if none such is under way.
    pub fn cancel_job(&self, job_id: &str) -> bool {
        let live = self.lock();
        let Some(entry) = live.jobs.get(job_id).and_then(|id| live.requests.get(id)) else {
            return false;
        };
        let _ = entry.why.set(Why::Client);
        entry.cancel.cancel();
        true
    }

    /// Cancels every request under way.
    pub fn cancel_all(&self, why: Why) {
        for entry in self.lock().requests.values() {
            let _ = entry.why.set(why);
            entry.cancel.cancel();
        }
    }

    /// Returns once no request is under way.
    pub async fn idle(&self) {
        let mut rx = self.count.subscribe();
        let _ = rx.wait_for(|&n| n == 0).await;
    }

    fn remove(&self, id: u64) {
        let mut live = self.lock();
        if let Some(job) = live.requests.remove(&id).and_then(|e| e.job) {
            live.jobs.remove(&job);
        }
        self.count.send_replace(live.requests.len());
    }
}

/// Why a request could not start.
pub enum Refused {
    /// Bad parameters, or a request the engine can never serve.
    Invalid(String),
    /// The queue is full or the engine shuts down: try again later (or elsewhere).
    Busy(String),
    /// A worker job of this id is under way already.
    DuplicateJob,
}

/// What a request yields: tokens, then its end.
pub enum Step {
    Token {
        /// Text to emit (may be empty; the engine keeps characters and stop strings whole).
        text: String,
        logprob: Option<(TokenLogprob, Vec<TokenLogprob>)>,
    },
    Done {
        /// OpenAI's `finish_reason`: "stop" or "length".
        finish: &'static str,
        usage: Usage,
        /// The last text to emit.
        text: String,
    },
}

/// Why a request ended without finishing.
pub enum Failure {
    Timeout(Duration),
    /// `/cancel`.
    Cancelled,
    /// A drain that ran out of time cancelled it.
    ShuttingDown,
    Engine(String),
}

impl Failure {
    pub fn message(&self) -> String {
        match self {
            Failure::Timeout(t) => format!("the request took longer than the {t:?} timeout"),
            Failure::Cancelled => "the request was cancelled".into(),
            Failure::ShuttingDown => "the server shut down before the request finished".into(),
            Failure::Engine(msg) => msg.clone(),
        }
    }
}

/// A request under way.
pub struct Generation {
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    id: u64,
    events: UnboundedReceiver<SeqEvent>,
    cancel: CancelHandle,
    why: Arc<OnceLock<Why>>,
    timeout: Duration,
    arrived: Instant,
    last_token: Option<Instant>,
    /// Its end has been counted; dropping it now is no disconnect.
    ended: bool,
}

impl Generation {
    /// Submits `req` (a worker job if `job` names one). `arrived`: when the HTTP request came
    /// in, from which the timeout and the latencies count.
    pub fn start(
        engine: &BatchEngine,
        registry: &Arc<Registry>,
        metrics: &Arc<Metrics>,
        req: Request,
        job: Option<String>,
        timeout: Duration,
        arrived: Instant,
    ) -> Result<Generation, Refused> {
        let prompt_tokens = req.prompt.len();
        // The job id is taken before the engine sees the request, so two requests of one id
        // cannot both start; it stays taken until the request ends.
        let mut live = registry.lock();
        if job.as_ref().is_some_and(|j| live.jobs.contains_key(j)) {
            return Err(Refused::DuplicateJob);
        }
        let handle = engine.submit(req).map_err(|e| match e {
            SubmitError::Invalid(msg) => Refused::Invalid(msg),
            e @ (SubmitError::QueueFull(_) | SubmitError::ShuttingDown) => {
                metrics.outcome(Outcome::Rejected);
                Refused::Busy(e.to_string())
            }
        })?;
        metrics.prompt_tokens(prompt_tokens);
        let id = live.next_id;
        live.next_id += 1;
        let why = Arc::new(OnceLock::new());
        if let Some(job) = &job {
            live.jobs.insert(job.clone(), id);
        }
        live.requests.insert(
            id,
            Entry {
                cancel: handle.cancel.clone(),
                why: why.clone(),
                job,
            },
        );
        registry.count.send_replace(live.requests.len());
        drop(live);
        Ok(Generation {
            registry: registry.clone(),
            metrics: metrics.clone(),
            id,
            events: handle.events,
            cancel: handle.cancel,
            why,
            timeout,
            arrived,
            last_token: None,
            ended: false,
        })
    }

    /// The next token or the end; after `Done` or an error, call no more.
    pub async fn next(&mut self) -> Result<Step, Failure> {
        let deadline = tokio::time::Instant::from_std(self.arrived + self.timeout);
        let event = match tokio::time::timeout_at(deadline, self.events.recv()).await {
            Ok(Some(event)) => event,
            Ok(None) => {
                self.end(Outcome::Error);
                return Err(Failure::Engine("the engine dropped the request".into()));
            }
            Err(_) => {
                let _ = self.why.set(Why::Timeout);
                self.cancel.cancel();
                self.end(Outcome::Timeout);
                return Err(Failure::Timeout(self.timeout));
            }
        };
        match event {
            SeqEvent::Token { text, logprob, .. } => {
                let now = Instant::now();
                match self.last_token {
                    None => self.metrics.ttft.observe(now - self.arrived),
                    Some(last) => self.metrics.itl.observe(now - last),
                }
                self.last_token = Some(now);
                self.metrics.generated_token();
                Ok(Step::Token { text, logprob })
            }
            SeqEvent::Done {
                reason,
                usage,
                text,
            } => {
                let (finish, outcome) = match reason {
                    FinishReason::Stop => ("stop", Outcome::Stop),
                    FinishReason::Length => ("length", Outcome::Length),
                    FinishReason::Cancelled => {
                        self.end(Outcome::Cancelled);
                        return Err(match self.why.get() {
                            Some(Why::Timeout) => Failure::Timeout(self.timeout),
                            Some(Why::Shutdown) => Failure::ShuttingDown,
                            Some(Why::Client) | None => Failure::Cancelled,
                        });
                    }
                };
                self.metrics.e2e.observe(self.arrived.elapsed());
                self.end(outcome);
                Ok(Step::Done {
                    finish,
                    usage,
                    text,
                })
            }
            SeqEvent::Error(msg) => {
                self.end(Outcome::Error);
                Err(Failure::Engine(msg))
            }
        }
    }

    fn end(&mut self, outcome: Outcome) {
        if !self.ended {
            self.ended = true;
            self.metrics.outcome(outcome);
        }
    }
}

impl Drop for Generation {
    /// Whoever waited for this request went away (a client that disconnected): it stops
    /// before its next step and its KV blocks go back to the pool.
    fn drop(&mut self) {
        if !self.ended {
            self.cancel.cancel();
            self.end(Outcome::Cancelled);
        }
        self.registry.remove(self.id);
    }
}
