//! Single-sequence decoding on the GPU: the run-ahead token pipeline around a `CudaModel`.
//!
//! The model holds the weights, the buffers and the forward passes; this holds what a stream
//! of `next_token` calls needs besides: the decode steps captured as CUDA graphs and replayed,
//! the two page-locked slots their tokens are copied to, and the steps launched ahead of the
//! host (the "run-ahead"), so that the GPU decodes the next tokens while the host reads one.
use std::collections::VecDeque;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph, CudaStream, DevicePtr, PinnedHostSlice};

use super::Device;
use super::model::{CudaModel, MAX_BATCH, WeightFormat};
use crate::gguf::Gguf;
use crate::models::Progress;
use crate::sampling::SamplingParams;
use crate::{Error, Result};

/// Decode steps per launch of the CUDA graph: a launch boundary (the graph's end, the copy of
/// the tokens to the host, the next graph's start) costs several kernel boundaries.
pub(super) const GRAPH_STEPS: usize = 8;
/// Where in the model's picked tokens (`CudaModel::picked`) the prefill's token goes: after
/// `GRAPH_STEPS` for each of the two `Slot`s.
const PREFILL_OUT: usize = 2 * GRAPH_STEPS;

/// `steps` decode steps captured as a CUDA graph, with the sampling they were captured for,
/// writing their tokens to `slot`'s part of the picked tokens.
struct DecodeGraph {
    sampling: SamplingParams,
    slot: usize,
    steps: usize,
    graph: CudaGraph,
}

// SAFETY: a CUDA graph may be launched from any thread (cudarc binds the context first); the
// pipeline that owns it is used by one thread at a time (`&mut self`), so it is never shared.
unsafe impl Send for DecodeGraph {}

/// Where the tokens of a launch of decode steps are copied to (page-locked, so that the copy
/// does not wait for work launched after it), and the event after the copy. Two, so that one
/// launch runs while the host reads the other's tokens.
struct Slot {
    host: PinnedHostSlice<u32>,
    copied: CudaEvent,
}

impl Slot {
    fn new(dev: &Device, len: usize) -> Result<Slot> {
        Ok(Slot {
            host: dev.pinned(len)?,
            copied: dev.event()?,
        })
    }

    /// Copies `tokens` (on the device) here after the work on `stream` so far, and records
    /// `copied` after the copy (with cudarc's event tracking off, the pinned buffer's own
    /// event is never recorded).
    fn fetch(&mut self, stream: &Arc<CudaStream>, tokens: &impl DevicePtr<u32>) -> Result<()> {
        stream.memcpy_dtoh(tokens, &mut self.host)?;
        self.copied.record(stream)?;
        Ok(())
    }

    /// The first `n` tokens of the last `fetch`, once its copy is done.
    fn tokens(&self, n: usize) -> Result<&[u32]> {
        self.copied.synchronize()?;
        Ok(&self.host.as_slice()?[..n])
    }
}

/// A `CudaModel` decoding one sequence: prefill, then decode steps replayed as CUDA graphs and
/// launched ahead of the host.
pub struct DecodePipeline {
    model: CudaModel,
    /// The decode steps as CUDA graphs, captured on first use.
    graphs: Vec<DecodeGraph>,
    /// The last token handed out: the device sampled it at `tokens[pos]` (and ran on from it
    /// while `queued` or `launched` hold steps).
    device_next: Option<u32>,
    /// The sampling of the steps run ahead: the next call that continues with the last token
    /// and this sampling takes their tokens.
    ahead: Option<SamplingParams>,
    /// Tokens the device picked after the last one handed out, in order, not yet handed out.
    queued: VecDeque<u32>,
    /// Launches of decode steps after those, oldest first: (slot, steps).
    launched: VecDeque<(usize, usize)>,
    slots: [Slot; 2],
    /// The prefill's token, copied as a slot's are.
    first: Slot,
}

impl DecodePipeline {
    /// The pipeline around `model`, with nothing run ahead.
    pub fn new(model: CudaModel) -> Result<DecodePipeline> {
        let dev = model.device();
        Ok(DecodePipeline {
            graphs: Vec::new(),
            ahead: None,
            queued: VecDeque::new(),
            launched: VecDeque::new(),
            slots: [Slot::new(dev, GRAPH_STEPS)?, Slot::new(dev, GRAPH_STEPS)?],
            first: Slot::new(dev, 1)?,
            device_next: None,
            model,
        })
    }

    /// `CudaModel::load`, then the pipeline around it.
    pub fn load(
        dev: Device,
        g: &Gguf,
        max_ctx: usize,
        format: WeightFormat,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<DecodePipeline> {
        DecodePipeline::new(CudaModel::load(dev, g, max_ctx, format, progress)?)
    }

    /// The model: its configuration, device and sizes.
    pub fn model(&self) -> &CudaModel {
        &self.model
    }

    /// The model, for passes outside the pipeline: the steps run ahead are forgotten, as
    /// those passes move the model's state under them.
    pub(crate) fn model_mut(&mut self) -> &mut CudaModel {
        self.drop_ahead();
        &mut self.model
    }

    /// Empties the KV cache, for a new sequence.
    pub fn reset(&mut self) {
        self.model.reset();
        self.drop_ahead();
    }

    /// Forgets the last token and the steps run ahead of it (they may still run, harmlessly:
    /// whatever comes next sets the device's position and draw afresh).
    fn drop_ahead(&mut self) {
        self.device_next = None;
        self.ahead = None;
        self.queued.clear();
        self.launched.clear();
    }

    /// `CudaModel::forward`: runs `tokens` after the cache's end and returns the logits of the
    /// last token, or of every token when `all_logits`.
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        // The device's next token (and the steps run ahead on it) no longer follow the cache.
        self.drop_ahead();
        self.model.forward(tokens, all_logits)
    }

    /// Runs `tokens` and picks the next token on the GPU, so that only its id crosses to the
    /// host. `step` numbers the draws of the sampler. One token after a token the GPU picked
    /// is a decode step: a CUDA graph of up to `GRAPH_STEPS` steps, replayed. Anything else is
    /// a prefill. `more`: at most this many tokens will be asked for after this one (unless
    /// one ends the text); that many decode steps may run ahead, launched before the host
    /// reads this token, in up to two launches (one runs while the host reads the other's).
    pub fn next_token(
        &mut self,
        tokens: &[u32],
        p: &SamplingParams,
        step: u64,
        more: usize,
    ) -> Result<u32> {
        if tokens.is_empty() {
            return Err(Error::Invalid("next_token: no tokens to run".into()));
        }
        let p = &graph_sampling(p);
        if !Device::can_sample(p) {
            let mut logits = self.forward(tokens, false)?;
            let recent = self.model.fed_tokens()?;
            return Ok(crate::sampling::sample(&mut logits, &recent, p, step));
        }
        // Taken, not read: a call that fails part-way leaves the next one a prefill, which sets
        // the device's position and draw afresh.
        let last = self.device_next.take();
        let continues = tokens.len() == 1 && last == Some(tokens[0]);
        let ahead = self.ahead.take();
        if !(continues && ahead.as_ref() == Some(p)) {
            let ran_ahead = ahead.is_some();
            self.drop_ahead();
            if continues && self.model.pos() < self.model.max_ctx() {
                if ran_ahead {
                    // The steps run ahead sampled otherwise: back to this step's position and
                    // draw (they wrote this position's keys and values as this step will).
                    self.model.set_position_and_draw(step)?;
                }
                self.launch_steps(p, more.saturating_add(1))?;
            } else {
                return self.prefill(tokens, p, step, more);
            }
        }
        // A decode step's token: the next of those read, or of the oldest launch.
        if self.queued.is_empty() {
            let (slot, steps) = self
                .launched
                .pop_front()
                .ok_or_else(|| Error::Cuda("next_token: no decode steps launched".into()))?;
            self.queued.extend(self.slots[slot].tokens(steps)?);
        }
        let next = self
            .queued
            .pop_front()
            .ok_or_else(|| Error::Cuda("next_token: a launch of no steps".into()))?;
        self.model.advance();
        self.run_ahead(p, more)?;
        self.device_next = Some(next);
        Ok(next)
    }

    /// `next_token` for tokens that do not continue the device's: runs them (a prefill) and
    /// samples the next on the GPU; launches up to `more` decode steps after it before the
    /// host reads it.
    fn prefill(
        &mut self,
        tokens: &[u32],
        p: &SamplingParams,
        step: u64,
        more: usize,
    ) -> Result<u32> {
        for chunk in tokens.chunks(MAX_BATCH) {
            self.model.forward_chunk(chunk, false)?;
        }
        self.model.sample_last(p, step, PREFILL_OUT)?;
        let out = self.model.picked(PREFILL_OUT, 1);
        self.first.fetch(self.model.device().stream(), &out)?;
        self.run_ahead(p, more)?;
        let next = self.first.tokens(1)?[0];
        self.device_next = Some(next);
        Ok(next)
    }

    /// Launches decode steps until `more` run ahead of the host (or no slot or cache room is
    /// left); if any do, they carry the sampling `p` (`ahead`).
    fn run_ahead(&mut self, p: &SamplingParams, more: usize) -> Result<()> {
        while self.launch_steps(p, more)? {}
        if !self.queued.is_empty() || !self.launched.is_empty() {
            self.ahead = Some(p.clone());
        }
        Ok(())
    }

    /// Launches up to `GRAPH_STEPS` decode steps after those queued and launched, as many as
    /// the cache holds and make at most `wanted` steps ahead of the host in all, through a
    /// CUDA graph (captured on first use for the slot, the number of steps and the sampling),
    /// and the copy of their tokens into a free slot. False when it launched nothing: no
    /// step wanted or room for one, or both slots taken.
    fn launch_steps(&mut self, p: &SamplingParams, wanted: usize) -> Result<bool> {
        let launched: usize = self.launched.iter().map(|&(_, n)| n).sum();
        let ahead = self.queued.len() + launched;
        let Some(slot) = (0..2).find(|s| self.launched.iter().all(|l| l.0 != *s)) else {
            return Ok(false);
        };
        let room = self
            .model
            .max_ctx()
            .saturating_sub(self.model.pos() + ahead);
        let steps = GRAPH_STEPS.min(room).min(wanted.saturating_sub(ahead));
        if steps == 0 {
            return Ok(false);
        }
        // A graph captured for other sampling is stale.
        self.graphs.retain(|g| g.sampling == *p);
        let found = self
            .graphs
            .iter()
            .position(|g| g.slot == slot && g.steps == steps);
        let i = match found {
            Some(i) => i,
            None => {
                let stream = self.model.device().stream().clone();
                stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
                let model = &mut self.model;
                let launched =
                    (0..steps).try_for_each(|i| model.decode_step(p, slot * GRAPH_STEPS + i));
                let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
                launched?;
                let graph = graph.ok_or_else(|| {
                    Error::Cuda("capturing the decode steps gave no graph".into())
                })?;
                self.graphs.push(DecodeGraph {
                    sampling: p.clone(),
                    slot,
                    steps,
                    graph,
                });
                self.graphs.len() - 1
            }
        };
        self.graphs[i].graph.launch()?;
        let tokens = self.model.picked(slot * GRAPH_STEPS, steps);
        self.slots[slot].fetch(self.model.device().stream(), &tokens)?;
        self.launched.push_back((slot, steps));
        Ok(true)
    }
}

/// The sampling that decode graphs are captured and run ahead for: a greedy pick draws
/// nothing, so its seed and truncations are left out and every greedy request (each with its
/// own seed, as a server gives them) replays the same graphs instead of capturing new ones.
fn graph_sampling(p: &SamplingParams) -> SamplingParams {
    if p.temperature != 0.0 {
        return p.clone();
    }
    SamplingParams {
        repeat_penalty: p.repeat_penalty,
        repeat_last_n: p.repeat_last_n,
        ..SamplingParams::greedy()
    }
}
