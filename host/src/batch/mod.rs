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
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::LoadOptions;
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

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
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            max_running: 256,
            max_queue: 1024,
            step_tokens: 512,
            kv_tokens: None,
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
    /// boundaries); neither the stop string nor anything after it is emitted.
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
    /// `max_tokens` reached, or the context is full.
    Length,
    Cancelled,
}

/// Figures of one finished request.
#[derive(Clone, Debug)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// From `submit` to the first token event.
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
}

/// The handle of a running batch engine: cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct BatchEngine {
    _todo: Arc<()>,
}

impl BatchEngine {
    /// Loads the model at `path` (as `Engine::load` does) and starts the engine thread.
    pub fn start(_path: &Path, _load: &LoadOptions, _opts: &BatchOptions) -> Result<BatchEngine> {
        Err(Error::Invalid("todo".into()))
    }

    /// Queues `req`; its events start with its first token.
    pub fn submit(&self, _req: Request) -> Result<RequestHandle, SubmitError> {
        todo!()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        todo!()
    }

    /// The context length: prompt and generated tokens together fit in it.
    pub fn ctx_len(&self) -> usize {
        todo!()
    }

    /// "cpu" or the GPU's name.
    pub fn device(&self) -> &str {
        todo!()
    }

    pub fn status(&self) -> EngineStatus {
        todo!()
    }

    /// Refuses new requests from now on; running and waiting ones go on to their end.
    pub fn shutdown(&self) {
        todo!()
    }
}
