//! The engine thread's bookkeeping: which sequences run, what each one feeds a step (a
//! prefill chunk or its last token), and what becomes of the tokens the backend gives back.
//!
//! Every step: finished and cancelled sequences leave (their blocks back to the pool), the
//! running ones get rows oldest first (decode rows always, prefill chunks within the step's
//! token budget), then waiting ones are admitted while the budget, `max_running` and the free
//! blocks allow. Blocks are allocated as sequences grow; when the pool runs dry the most
//! recently admitted sequence is preempted: its blocks go back and it waits at the front of
//! the queue with its tokens, to be prefilled again (prompt and output) and go on where it was.
use std::collections::VecDeque;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::backend::{Backend, Row, RowOutput, SampleSpec};
use super::kv::BlockPool;
use super::stop::StopText;
use super::{CancelHandle, EngineStatus, FinishReason, Request, SeqEvent, Usage};
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// A request as `submit` queues it for the engine thread.
pub struct Pending {
    pub req: Request,
    pub events: UnboundedSender<SeqEvent>,
    pub cancel: CancelHandle,
    pub submitted: Instant,
}

/// How a sequence ends.
enum End {
    Finished(FinishReason),
    Failed(String),
}

/// One request in the engine.
struct Seq<'t> {
    req: Request,
    /// Prompt and output; the output's last token is not in the KV cache yet.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Positions in the KV cache: `tokens[..computed]` (0 again after a preemption).
    computed: usize,
    /// The block table: covers at least `computed` positions.
    blocks: Vec<u32>,
    events: UnboundedSender<SeqEvent>,
    cancel: CancelHandle,
    submitted: Instant,
    first_token: Option<Instant>,
    decoder: StreamDecoder<'t>,
    stop: StopText,
    /// A stop string ended it: the text after it is dropped.
    stop_string: bool,
    end: Option<End>,
}

impl<'t> Seq<'t> {
    fn new(mut p: Pending, tok: &'t Tokenizer) -> Seq<'t> {
        let tokens = std::mem::take(&mut p.req.prompt);
        Seq {
            prompt_len: tokens.len(),
            tokens,
            computed: 0,
            blocks: Vec::new(),
            events: p.events,
            cancel: p.cancel,
            submitted: p.submitted,
            first_token: None,
            decoder: tok.stream(),
            stop: StopText::new(std::mem::take(&mut p.req.stop_strings)),
            stop_string: false,
            end: None,
            req: p.req,
        }
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn cancelled(&self) -> bool {
        self.cancel.is_cancelled() || self.events.is_closed()
    }

    /// Tokens it feeds next: its last token alone when it decodes (whatever the budget), else
    /// a prefill chunk taken from the step's prefill `budget` (0 when that is spent).
    fn feed(&self, budget: &mut usize) -> usize {
        match self.tokens.len() - self.computed {
            1 => 1,
            left => {
                let n = left.min(*budget);
                *budget -= n;
                n
            }
        }
    }

    /// Takes the token sampled after its last: ends it on a stop token, else emits it (with the
    /// text it releases) and ends it on a stop string, `max_tokens` or when the next step would
    /// need more than `limit` positions.
    fn accept(&mut self, out: RowOutput, tok: &Tokenizer, limit: usize) -> Option<End> {
        let id = out.token;
        let eos = !self.req.ignore_eos && tok.eos_ids().contains(&id);
        if eos || self.req.stop_ids.contains(&id) {
            return Some(End::Finished(FinishReason::Stop));
        }
        self.tokens.push(id);
        let decoded = tok
            .decode(&[id])
            .and_then(|piece| Ok((piece, self.decoder.push(id)?)));
        let (piece, text) = match decoded {
            Ok((piece, text)) => (piece, text.unwrap_or_default()),
            Err(e) => return Some(End::Failed(e.to_string())),
        };
        let (text, stopped) = self.stop.push(&text);
        self.first_token.get_or_insert_with(Instant::now);
        let event = SeqEvent::Token {
            id,
            text,
            piece,
            logprob: out.logprob,
        };
        if self.events.send(event).is_err() {
            return Some(End::Finished(FinishReason::Cancelled));
        }
        if stopped {
            self.stop_string = true;
            return Some(End::Finished(FinishReason::Stop));
        }
        let full = self.generated() >= self.req.max_tokens || self.tokens.len() > limit;
        full.then_some(End::Finished(FinishReason::Length))
    }

    /// Leaves the engine: its blocks go back to `pool`; returns its last event.
    fn leave(mut self, pool: &mut BlockPool) -> LastEvent {
        pool.release(&mut self.blocks);
        let events = self.events.clone();
        let event = match self.end.take().expect("an ended sequence") {
            End::Failed(msg) => SeqEvent::Error(msg),
            End::Finished(reason) => self.done(reason),
        };
        (events, event)
    }

    fn done(self, reason: FinishReason) -> SeqEvent {
        let now = Instant::now();
        let (prompt_tokens, completion_tokens) = (self.prompt_len, self.generated());
        let text = if self.stop_string {
            String::new()
        } else {
            let rest = self.decoder.finish().unwrap_or_default();
            self.stop.finish(&rest)
        };
        SeqEvent::Done {
            reason,
            usage: Usage {
                prompt_tokens,
                completion_tokens,
                ttft: self.first_token.unwrap_or(now) - self.submitted,
                total: now - self.submitted,
            },
            text,
        }
    }
}

/// The last event of a sequence that left, to send once the engine's status shows it gone.
pub type LastEvent = (UnboundedSender<SeqEvent>, SeqEvent);

pub struct Scheduler<'t> {
    tok: &'t Tokenizer,
    pool: BlockPool,
    block_tokens: usize,
    /// Positions a sequence may have at most: the context, or the whole pool if that is less.
    /// No sequence outgrowing the pool, one alone can always grow and a preempted one always
    /// gets back in once the others are done.
    limit: usize,
    max_running: usize,
    step_tokens: usize,
    /// Admitted, oldest first.
    running: Vec<Seq<'t>>,
    /// Queued, in the order they are admitted: preempted sequences go to the front.
    waiting: VecDeque<Seq<'t>>,
    steps: u64,
    preemptions: u64,
}

impl<'t> Scheduler<'t> {
    pub fn new(
        tok: &'t Tokenizer,
        backend: &dyn Backend,
        max_running: usize,
        step_tokens: usize,
    ) -> Scheduler<'t> {
        Scheduler {
            tok,
            pool: BlockPool::new(backend.kv_blocks()),
            block_tokens: backend.kv_block_tokens(),
            limit: backend
                .ctx_len()
                .min(backend.kv_blocks() * backend.kv_block_tokens()),
            max_running,
            step_tokens,
            running: Vec::new(),
            waiting: VecDeque::new(),
            steps: 0,
            preemptions: 0,
        }
    }

    pub fn enqueue(&mut self, p: Pending) {
        self.waiting.push_back(Seq::new(p, self.tok));
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn status(&self) -> EngineStatus {
        EngineStatus {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_blocks_used: self.pool.used(),
            kv_blocks_total: self.pool.total(),
            kv_block_tokens: self.block_tokens,
            steps: self.steps,
            preemptions: self.preemptions,
        }
    }

    /// Runs one step and returns the last events of the sequences that left.
    /// `publish` hears the status once the step's blocks are allocated, before any of its
    /// token events is sent: whoever sees a token sees its blocks in use.
    pub fn step(
        &mut self,
        backend: &mut dyn Backend,
        publish: &mut dyn FnMut(EngineStatus),
    ) -> Vec<LastEvent> {
        for s in self.running.iter_mut().chain(&mut self.waiting) {
            if s.cancelled() {
                s.end = Some(End::Finished(FinishReason::Cancelled));
            }
        }
        let mut last = self.reap();
        let plan = self.plan();
        publish(self.status());
        if !plan.is_empty() {
            self.run(backend, &plan);
        }
        last.extend(self.reap());
        last
    }

    /// The rows of this step, as `(index in running, tokens fed)`.
    fn plan(&mut self) -> Vec<(usize, usize)> {
        let mut budget = self.step_tokens;
        let mut plan = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let n = self.running[i].feed(&mut budget);
            if n > 0 && self.grow(i, n) {
                plan.push((i, n));
            }
            i += 1;
        }
        while self.running.len() < self.max_running && budget > 0 {
            // In only if its whole prefill fits the free blocks: a sequence admitted only to be
            // preempted a step later would waste its chunks.
            let fits = |s: &Seq| s.tokens.len().div_ceil(self.block_tokens) <= self.pool.free();
            if !self.waiting.front().is_some_and(fits) {
                break;
            }
            let s = self.waiting.pop_front().expect("a waiting sequence");
            let n = s.feed(&mut budget);
            self.running.push(s);
            let i = self.running.len() - 1;
            if self.grow(i, n) {
                plan.push((i, n));
            }
        }
        plan
    }

    /// Gives running sequence `i` the blocks for `n` more positions, preempting the most recently
    /// admitted sequences as needed; false when that was `i` itself.
    fn grow(&mut self, i: usize, n: usize) -> bool {
        let s = &self.running[i];
        let need = (s.computed + n)
            .div_ceil(self.block_tokens)
            .saturating_sub(s.blocks.len());
        while self.pool.free() < need {
            let last = self.running.len() - 1;
            self.preempt_last();
            if last == i {
                return false;
            }
        }
        assert!(self.pool.alloc(&mut self.running[i].blocks, need));
        true
    }

    /// Sends the most recently admitted sequence back to the front of the queue, without its
    /// blocks.
    fn preempt_last(&mut self) {
        let mut s = self.running.pop().expect("a running sequence");
        self.pool.release(&mut s.blocks);
        s.computed = 0;
        self.waiting.push_front(s);
        self.preemptions += 1;
    }

    /// Runs the planned rows and takes in what they give.
    fn run(&mut self, backend: &mut dyn Backend, plan: &[(usize, usize)]) {
        let rows: Vec<Row> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &self.running[i];
                let end = s.computed + n;
                Row {
                    tokens: &s.tokens[s.computed..end],
                    start: s.computed,
                    blocks: &s.blocks,
                    sample: (end == s.tokens.len()).then(|| SampleSpec {
                        sampling: &s.req.sampling,
                        draw: s.generated() as u64,
                        history: &s.tokens,
                        prompt_len: s.prompt_len,
                        logprobs: s.req.logprobs,
                        more: s.req.max_tokens.saturating_sub(s.generated() + 1),
                    }),
                }
            })
            .collect();
        let sampled: Vec<bool> = rows.iter().map(|r| r.sample.is_some()).collect();
        let result = backend.step(&rows);
        drop(rows);
        self.steps += 1;
        let mut outputs = match result {
            Ok(outputs) => outputs.into_iter(),
            Err(e) => {
                for &(i, _) in plan {
                    self.running[i].end = Some(End::Failed(e.to_string()));
                }
                return;
            }
        };
        for (&(i, n), sampled) in plan.iter().zip(sampled) {
            let s = &mut self.running[i];
            s.computed += n;
            if sampled {
                let Some(out) = outputs.next() else {
                    s.end = Some(End::Failed("the backend gave too few tokens".into()));
                    continue;
                };
                s.end = s.accept(out, self.tok, self.limit);
            }
        }
    }

    /// Takes the sequences that ended out of the engine; their blocks go back to the pool.
    fn reap(&mut self) -> Vec<LastEvent> {
        let (ended, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s| s.end.is_some());
        let (ended_waiting, waiting): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut self.waiting)
                .into_iter()
                .partition(|s| s.end.is_some());
        (self.running, self.waiting) = (running, waiting);
        let pool = &mut self.pool;
        ended
            .into_iter()
            .chain(ended_waiting)
            .map(|s| s.leave(pool))
            .collect()
    }
}
