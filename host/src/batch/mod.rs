//! Continuous batching: many requests served at once by one engine thread.
//!
//! API CONTRACT (draft: the batching helper implements it; the server codes against it).
//!
//! Requests go in from any thread (`BatchEngine::submit`); each gets its own stream of events
//! and its own cancel handle. One engine thread runs the steps: finished and cancelled
//! sequences leave, waiting ones join, prompts are prefilled in chunks under a per-step token
//! budget alongside the decode rows, one forward pass runs all rows (`Backend::step`), and each
//! row is sampled with its own parameters. The KV cache is paged: fixed-size blocks from one
//! pool, a block table per sequence, blocks back to the pool the moment a sequence ends.
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::cpu::model::CpuModel;
use crate::cuda::batch::CudaBatch;
use crate::cuda::model::CudaModel;
use crate::cuda::{Device, MemoryGauge};
use crate::engine::{DEFAULT_CTX, DeviceChoice, LoadOptions, open_with_tokenizer};
use crate::gguf::Gguf;
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

pub mod backend;
pub mod cpu;
pub mod kv;
mod scheduler;
mod stop;

use backend::Backend;
use scheduler::{Pending, Scheduler};

/// How the engine thread schedules and how big its KV pool is.
#[derive(Clone, Debug)]
pub struct BatchOptions {
    /// Sequences in one step at most (decode rows and prefill chunks together).
    pub max_running: usize,
    /// Requests waiting to start at most; `submit` refuses more with `SubmitError::QueueFull`.
    pub max_queue: usize,
    /// Tokens of prompts prefilled in one step at most (decode rows are always taken).
    pub step_tokens: usize,
    /// KV pool size in tokens; `None`: sized from free GPU memory (CPU: `ctx` × `max_running`).
    pub kv_tokens: Option<usize>,
    /// A request's tokens never depend on what else runs: on the GPU, a sequence decoding
    /// alone stays on the batched pass instead of the faster single-sequence kernels, whose
    /// sums run in another order.
    pub batch_invariant: bool,
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            max_running: 256,
            max_queue: 1024,
            step_tokens: 512,
            kv_tokens: None,
            batch_invariant: false,
        }
    }
}

/// Sampling of one request: the library's parameters plus OpenAI's additive penalties.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// Temperature, top-k (0 = off), top-p, min-p, repetition penalty (1 = off; over every
    /// token of prompt and output, as vLLM does), seed.
    pub params: SamplingParams,
    /// OpenAI's `frequency_penalty`: subtracts `count(token in output) * f` from its logit.
    pub frequency_penalty: f32,
    /// OpenAI's `presence_penalty`: subtracts `p` from the logit of every token in the output.
    pub presence_penalty: f32,
}

/// One request.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: Sampling,
    /// Generated tokens at most (stop tokens not counted).
    pub max_tokens: usize,
    /// Token ids that end the request (besides the model's end-of-sequence ids, unless
    /// `ignore_eos`); not part of the output.
    pub stop_ids: Vec<u32>,
    /// Strings that end the request when the decoded output contains one (matched across token
    /// boundaries); neither the stop string nor anything after it is emitted. The token that
    /// completes one is still sent, with the text before the stop string.
    pub stop_strings: Vec<String>,
    pub ignore_eos: bool,
    /// `Some(n)`: each token event carries the chosen token's log-probability and the `n`
    /// (at most 20) most likely tokens' (log-softmax of the raw logits).
    pub logprobs: Option<usize>,
}

/// A token and its log-probability.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token, or a stop string.
    Stop,
    /// `max_tokens` reached, or the context (or the whole KV pool, if smaller) is full.
    Length,
    Cancelled,
}

/// Figures of one finished request.
#[derive(Clone, Debug)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// From `submit` to the first token event (to `Done` when there is none).
    pub ttft: Duration,
    /// From `submit` to `Done`.
    pub total: Duration,
}

/// What a request's stream carries: tokens, then exactly one `Done` or `Error`.
#[derive(Clone, Debug)]
pub enum SeqEvent {
    Token {
        id: u32,
        /// Text released by this token: may be empty (a UTF-8 character split over tokens, or
        /// text held back while it may begin a stop string), may carry held-back text.
        text: String,
        /// The token's own bytes as text (lossy), for logprob entries.
        piece: String,
        /// With `Request::logprobs`: the chosen token's and the top alternatives'.
        logprob: Option<(TokenLogprob, Vec<TokenLogprob>)>,
    },
    Done {
        reason: FinishReason,
        usage: Usage,
        /// Held-back text still to emit (text that turned out not to start a stop string).
        text: String,
    },
    Error(String),
}

/// Stops a request before its next step; its KV blocks go back to the pool.
#[derive(Clone, Debug, Default)]
pub struct CancelHandle(Arc<AtomicBool>);

impl CancelHandle {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A submitted request: its events (usable from sync code with `blocking_recv`, from async
/// code with `recv().await`) and its cancel handle. Dropping the receiver cancels it too.
/// The stream ends without `Done` or `Error` only if the engine thread died (a panic).
pub struct RequestHandle {
    pub events: UnboundedReceiver<SeqEvent>,
    pub cancel: CancelHandle,
}

/// Why `submit` refused a request.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// Bad parameters, an empty prompt, a prompt longer than the context ("... has N tokens but
    /// the context holds M"), or a request that could never fit the KV pool.
    #[error("{0}")]
    Invalid(String),
    /// `max_queue` requests are waiting already.
    #[error("the queue is full ({0} requests waiting)")]
    QueueFull(usize),
    /// `shutdown` was called.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// What the engine is doing now.
#[derive(Clone, Debug, Default)]
pub struct EngineStatus {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub kv_block_tokens: usize,
    /// Forward steps run so far.
    pub steps: u64,
    /// Sequences sent back to the queue so far because the KV pool ran out.
    pub preemptions: u64,
}

/// The most top log-probabilities a request may ask for (OpenAI's limit).
pub const MAX_LOGPROBS: usize = 20;

/// What `submit` and the engine thread share.
struct Shared {
    state: Mutex<State>,
    /// Wakes the idle engine thread: a request came, or shutdown.
    wake: Condvar,
}

struct State {
    /// Submitted, not yet taken by the engine thread.
    inbox: Vec<Pending>,
    shutdown: bool,
    /// As of the engine thread's last look (`waiting` without the inbox).
    status: EngineStatus,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn shutdown(&self) {
        self.lock().shutdown = true;
        self.wake.notify_one();
    }
}

/// The handle of a running batch engine: cheap to clone, usable from any thread. When the last
/// clone is dropped the engine shuts down: it finishes what it has, then its thread ends.
#[derive(Clone)]
pub struct BatchEngine {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    tokenizer: Arc<Tokenizer>,
    ctx: usize,
    device: String,
    block_tokens: usize,
    kv_blocks: usize,
    max_queue: usize,
    memory: Option<MemoryGauge>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shared.shutdown();
    }
}

impl BatchEngine {
    /// Loads the model at `path` (as `Engine::load` does) and starts the engine thread.
    pub fn start(path: &Path, load: &LoadOptions, opts: &BatchOptions) -> Result<BatchEngine> {
        let ctx = load.ctx.unwrap_or(DEFAULT_CTX);
        let (tokenizer, backend) = open_with_tokenizer(path, |g| load_backend(g, load, ctx, opts))?;
        BatchEngine::with_backend(backend, tokenizer, opts)
    }

    /// Starts the engine thread on `backend`, a model already loaded with its `tokenizer`.
    pub fn with_backend(
        backend: Box<dyn Backend>,
        tokenizer: Tokenizer,
        opts: &BatchOptions,
    ) -> Result<BatchEngine> {
        if opts.max_running == 0 || opts.step_tokens == 0 {
            return Err(Error::Invalid(format!(
                "max_running and step_tokens must be at least 1, got {} and {}",
                opts.max_running, opts.step_tokens
            )));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                inbox: Vec::new(),
                shutdown: false,
                status: EngineStatus::default(),
            }),
            wake: Condvar::new(),
        });
        let tokenizer = Arc::new(tokenizer);
        let inner = Inner {
            shared: shared.clone(),
            tokenizer: tokenizer.clone(),
            ctx: backend.ctx_len(),
            device: backend.device(),
            block_tokens: backend.kv_block_tokens(),
            kv_blocks: backend.kv_blocks(),
            max_queue: opts.max_queue,
            memory: backend.memory_gauge(),
        };
        let (max_running, step_tokens) = (opts.max_running, opts.step_tokens);
        std::thread::Builder::new()
            .name("orcd-batch".into())
            .spawn(move || engine_thread(&shared, backend, &tokenizer, max_running, step_tokens))
            .map_err(|e| Error::Invalid(format!("starting the engine thread: {e}")))?;
        Ok(BatchEngine {
            inner: Arc::new(inner),
        })
    }

    /// Queues `req`; its events start with its first token.
    pub fn submit(&self, req: Request) -> Result<RequestHandle, SubmitError> {
        self.check(&req).map_err(SubmitError::Invalid)?;
        let (tx, events) = unbounded_channel();
        let cancel = CancelHandle::default();
        let mut st = self.inner.shared.lock();
        if st.shutdown {
            return Err(SubmitError::ShuttingDown);
        }
        let waiting = st.inbox.len() + st.status.waiting;
        if waiting >= self.inner.max_queue {
            return Err(SubmitError::QueueFull(waiting));
        }
        st.inbox.push(Pending {
            req,
            events: tx,
            cancel: cancel.clone(),
            submitted: Instant::now(),
        });
        self.inner.shared.wake.notify_one();
        Ok(RequestHandle { events, cancel })
    }

    /// Why `req` can never be served, if it cannot.
    fn check(&self, req: &Request) -> Result<(), String> {
        let inner = &self.inner;
        let n = req.prompt.len();
        if n == 0 {
            return Err("the prompt is empty".into());
        }
        if n > inner.ctx {
            return Err(format!(
                "the prompt has {n} tokens but the context holds {}",
                inner.ctx
            ));
        }
        let need = (n + 1).div_ceil(inner.block_tokens);
        if need > inner.kv_blocks {
            return Err(format!(
                "the prompt has {n} tokens: with one generated token it needs {need} KV blocks \
                 of {} but the pool holds {}",
                inner.block_tokens, inner.kv_blocks
            ));
        }
        let vocab = inner.tokenizer.vocab_size();
        if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            ));
        }
        if req.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        req.sampling.params.validate().map_err(|e| e.to_string())?;
        for (name, v) in [
            ("frequency_penalty", req.sampling.frequency_penalty),
            ("presence_penalty", req.sampling.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if let Some(n) = req.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return Err(format!("logprobs must be at most {MAX_LOGPROBS}, got {n}"));
        }
        if req.stop_strings.iter().any(String::is_empty) {
            return Err("a stop string is empty".into());
        }
        Ok(())
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.tokenizer
    }

    /// The context length: prompt and generated tokens together fit in it.
    pub fn ctx_len(&self) -> usize {
        self.inner.ctx
    }

    /// "cpu" or the GPU's name.
    pub fn device(&self) -> &str {
        &self.inner.device
    }

    /// Bytes of GPU memory in use now, as the driver counts them (total less free, so other
    /// processes' too); `None` on the CPU, or if the driver cannot tell.
    pub fn device_memory_used(&self) -> Option<u64> {
        self.inner.memory.as_ref()?.used().ok()
    }

    pub fn status(&self) -> EngineStatus {
        let st = self.inner.shared.lock();
        EngineStatus {
            waiting: st.status.waiting + st.inbox.len(),
            ..st.status.clone()
        }
    }

    /// Refuses new requests from now on; running and waiting ones go on to their end.
    pub fn shutdown(&self) {
        self.inner.shared.shutdown();
    }
}

/// The backend for `load.device`: the one place the batch engine's device is chosen.
fn load_backend(
    g: &Gguf,
    load: &LoadOptions,
    ctx: usize,
    opts: &BatchOptions,
) -> Result<Box<dyn Backend>> {
    let gpu = match load.device {
        DeviceChoice::Cpu => None,
        DeviceChoice::Cuda => Some(Device::open(0)?),
        DeviceChoice::Auto => Device::open(0).ok(),
    };
    if let Some(dev) = gpu {
        let model = CudaModel::load(dev, g, ctx, load.weights, &mut |_| {})?;
        let default_tokens = model.max_ctx() * opts.max_running;
        return Ok(Box::new(CudaBatch::new(
            model,
            opts.kv_tokens,
            default_tokens,
            opts.batch_invariant,
        )?));
    }
    let model = Arc::new(CpuModel::load(g, ctx)?);
    let kv_tokens = opts.kv_tokens.unwrap_or(model.max_ctx() * opts.max_running);
    Ok(Box::new(cpu::CpuBackend::new(model, kv_tokens)))
}

/// Closes the engine when its thread ends, even by a panic: `submit` refuses from then on and
/// the queued requests' streams end.
struct Exit<'a>(&'a Shared);

impl Drop for Exit<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.shutdown = true;
        st.inbox.clear();
    }
}

/// The engine thread: takes in requests, runs steps while there is work, sleeps while there is
/// none, and ends once shut down with nothing left.
fn engine_thread(
    shared: &Shared,
    mut backend: Box<dyn Backend>,
    tokenizer: &Tokenizer,
    max_running: usize,
    step_tokens: usize,
) {
    let _exit = Exit(shared);
    let mut sched = Scheduler::new(tokenizer, &*backend, max_running, step_tokens);
    loop {
        {
            let mut st = shared.lock();
            loop {
                for p in st.inbox.drain(..) {
                    sched.enqueue(p);
                }
                st.status = sched.status();
                if !sched.is_idle() {
                    break;
                }
                if st.shutdown {
                    return;
                }
                st = shared.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
        }
        let last = sched.step(&mut *backend, &mut |status| shared.lock().status = status);
        shared.lock().status = sched.status();
        // After the status, so that whoever sees a `Done` sees the blocks back in the pool.
        for (events, event) in last {
            let _ = events.send(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server shares the engine between tasks and moves handles into them.
    #[test]
    fn handles_cross_threads() {
        fn shared<T: Send + Sync + Clone>() {}
        fn sent<T: Send>() {}
        shared::<BatchEngine>();
        shared::<CancelHandle>();
        sent::<RequestHandle>();
        sent::<cpu::CpuBackend>();
    }
}
