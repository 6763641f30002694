//! The batching engine's GPU backend: each step's rows (decode tokens and prefill chunks of
//! many sequences) in one batched forward pass over a paged KV cache, then each sampling row's
//! next token, every row with its own parameters, in one launch of the batched sampler.
//!
//! A step of decode rows alone replays a CUDA graph, one per bucket of row counts (powers of
//! two): every per-row input (tokens, positions, cache slots, block tables, sampling
//! parameters) is in device buffers the graph reads, and the rows past the step's are padding
//! that writes to a block of its own.
//!
//! A sequence that runs alone (one row a step, sampled) goes to the single-sequence pipeline
//! (`DecodePipeline`: the prefill GEMM, decode kernels for one token, steps run ahead of the
//! host) unless the backend is batch-invariant: its keys and values are copied from its paged
//! blocks into the pipeline's contiguous cache when it starts alone, and those it added back
//! into its blocks when other rows join it.
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};

use super::Device;
use super::MemoryGauge;
use super::decode_pipeline::DecodePipeline;
use super::model::{CudaModel, MAX_BATCH, StepInputs};
use super::paged::{AttentionItem, PagedKv};
use super::sample_rows::{RowSamplerInputs, RowSampling};
use crate::batch::backend::{Backend, Row, RowOutput, SampleSpec};
use crate::batch::cpu::logprobs;
use crate::{Error, Result};

/// Tokens of a KV block.
const BLOCK_TOKENS: usize = 16;
/// GPU memory the pool leaves free (for the driver, graphs and the attention's and the
/// sampler's scratch).
const HEADROOM: usize = 1 << 30;

pub struct CudaBatch {
    /// The model, in the single-sequence pipeline that decodes a lone sequence.
    pipe: DecodePipeline,
    /// Whether a lone sequence stays on the batched pass (tokens independent of the batch).
    batch_invariant: bool,
    /// The sequence the pipeline is decoding alone, if any.
    lone: Option<Lone>,
    /// One paged cache per layer: `blocks` for the pool and one more, the padding's.
    kv: Vec<PagedKv>,
    blocks: usize,
    /// Decode-only steps as CUDA graphs: (bucket, the sampler inputs' generation, graph).
    graphs: Vec<(usize, u64, Graph)>,
    step: StepInputs,
    /// The rows whose logits a step computes, and the tokens sampled from them.
    sample_rows: CudaSlice<u32>,
    next: CudaSlice<u32>,
    sampler: RowSamplerInputs,
}

impl CudaBatch {
    /// The backend of `model`, with a KV pool of `kv_tokens` tokens, or by default the smaller
    /// of `default_tokens` and what free GPU memory holds (less `HEADROOM`); `batch_invariant`:
    /// a lone sequence stays on the batched pass.
    pub fn new(
        model: CudaModel,
        kv_tokens: Option<usize>,
        default_tokens: usize,
        batch_invariant: bool,
    ) -> Result<CudaBatch> {
        let c = &model.cfg;
        let token_bytes = 2 * c.n_layers * c.kv_dim() * 2;
        let (free, _) = model.device().memory()?;
        let fits = free.saturating_sub(HEADROOM) / token_bytes;
        let tokens = kv_tokens.unwrap_or(default_tokens.min(fits));
        if tokens > fits {
            return Err(Error::GpuMemory(format!(
                "a KV pool of {tokens} tokens needs {:.2} GiB but {:.2} GiB are free",
                (tokens * token_bytes) as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            )));
        }
        let blocks = tokens / BLOCK_TOKENS;
        if blocks == 0 {
            return Err(Error::Invalid(format!(
                "a KV pool of {tokens} tokens holds no block of {BLOCK_TOKENS}"
            )));
        }
        let dev = model.device();
        let kv = (0..c.n_layers)
            .map(|_| dev.paged_kv((blocks + 1) * BLOCK_TOKENS, c.kv_dim()))
            .collect::<Result<Vec<_>>>()?;
        // Tables of the sequences of a step: each block is in at most one, plus a partly
        // filled last block each.
        let step = model.step_inputs(blocks + MAX_BATCH + 1, BLOCK_TOKENS)?;
        Ok(CudaBatch {
            graphs: Vec::new(),
            sample_rows: dev.zeros(MAX_BATCH)?,
            next: dev.zeros(MAX_BATCH)?,
            sampler: RowSamplerInputs::default(),
            kv,
            blocks,
            step,
            pipe: DecodePipeline::new(model)?,
            batch_invariant,
            lone: None,
        })
    }

    /// One forward pass over `rows` (their tokens `MAX_BATCH` at most in all), and the next
    /// token of each row that samples.
    fn run(&mut self, rows: &[&Row]) -> Result<Vec<RowOutput>> {
        let specs: Vec<&SampleSpec> = rows.iter().filter_map(|r| r.sample.as_ref()).collect();
        let params: Vec<RowSampling> = specs.iter().map(|s| row_sampling(s)).collect();
        // Decode rows alone replay a graph, unless a row wants the raw logits' probabilities
        // (the sampler penalises the logits in place inside the graph).
        let decode = rows
            .iter()
            .all(|r| r.tokens.len() == 1 && r.sample.is_some());
        if decode && specs.iter().all(|s| s.logprobs.is_none()) {
            let bucket = rows.len().next_power_of_two();
            self.upload(rows, bucket)?;
            let mut padded = params;
            padded.resize(bucket, RowSampling::default());
            self.sampler.upload(self.pipe.model().device(), &padded)?;
            self.replay(bucket)?;
            return self.sampled(rows.len());
        }

        let (n, m) = self.upload(rows, 0)?;
        self.pipe
            .model_mut()
            .forward_rows(&mut self.kv, &mut self.step, n)?;
        if m == 0 {
            return Ok(Vec::new());
        }
        let vocab = self.pipe.model().cfg.vocab;
        self.pipe
            .model_mut()
            .logits_of_rows(&self.sample_rows, m, &mut self.step.gemm)?;
        // Log-probabilities are of the raw logits: those rows are read before the sampler
        // penalises them in place.
        let (dev, logits) = self.pipe.model_mut().logits_mut();
        let raw = specs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.logprobs.is_some())
            .map(|(i, _)| Ok((i, dev.download(&logits.slice(i * vocab..(i + 1) * vocab))?)))
            .collect::<Result<Vec<_>>>()?;
        dev.sample_rows(&mut self.next, logits, vocab, &params, &mut self.sampler)?;
        let mut out = self.sampled(m)?;
        for (i, raw) in raw {
            let n = specs[i].logprobs.unwrap_or(0);
            out[i].logprob = Some(logprobs(&raw, out[i].token, n));
        }
        Ok(out)
    }

    /// The tokens the sampler picked for the first `m` sampled rows.
    fn sampled(&self, m: usize) -> Result<Vec<RowOutput>> {
        let tokens = self.pipe.model().device().download(&self.next.slice(..m))?;
        Ok(tokens
            .into_iter()
            .map(|token| RowOutput {
                token,
                logprob: None,
            })
            .collect())
    }

    /// Writes the step's per-row inputs to the device: tokens, positions, cache slots, the
    /// attention's items, the block tables and the rows to sample; with `pad_to` rows of
    /// padding after the real ones up to that many (token 0 at position 0 of the padding's
    /// own block, sampled). Returns the rows fed and the rows sampled.
    fn upload(&mut self, rows: &[&Row], pad_to: usize) -> Result<(usize, usize)> {
        let bt = BLOCK_TOKENS;
        let (mut ids, mut positions, mut slots) = (vec![], vec![], vec![]);
        let (mut items, mut tables, mut sampled) = (vec![], vec![], vec![]);
        for r in rows {
            let (first, table) = (ids.len(), tables.len());
            tables.extend_from_slice(r.blocks);
            for (i, &t) in r.tokens.iter().enumerate() {
                let p = r.start + i;
                let block = match r.blocks.get(p / bt) {
                    Some(&b) if (b as usize) < self.blocks => b as usize,
                    _ => {
                        return Err(Error::Invalid(format!(
                            "position {p} has no block of the pool in its block table"
                        )));
                    }
                };
                ids.push(t);
                positions.push(p as u32);
                slots.push((block * bt + p % bt) as u32);
            }
            items.extend(AttentionItem::split(first, r.tokens.len(), r.start, table));
            if r.sample.is_some() {
                sampled.push((ids.len() - 1) as u32);
            }
        }
        let vocab = self.pipe.model().cfg.vocab;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        let pad_table = tables.len();
        tables.push(self.blocks as u32);
        while ids.len() < pad_to {
            items.extend(AttentionItem::split(ids.len(), 1, 0, pad_table));
            sampled.push(ids.len() as u32);
            ids.push(0);
            positions.push(0);
            slots.push((self.blocks * bt) as u32);
        }
        let s = &mut self.step;
        let dev = self.pipe.model().device();
        dev.copy_to(&mut s.ids, &ids)?;
        dev.copy_to(&mut s.positions, &positions)?;
        dev.copy_to(&mut s.slots, &slots)?;
        dev.copy_to(&mut s.items, &AttentionItem::flatten(&items))?;
        dev.copy_to(&mut s.tables, &tables)?;
        dev.copy_to(&mut self.sample_rows, &sampled)?;
        s.n_items = items.len();
        Ok((ids.len(), sampled.len()))
    }

    /// Runs the decode step of `bucket` rows whose inputs are uploaded: the graph captured for
    /// the bucket (and the sampler's buffers as they are), captured now if there is none.
    fn replay(&mut self, bucket: usize) -> Result<()> {
        let generation = self.sampler.generation;
        self.graphs.retain(|g| g.1 == generation);
        if let Some(g) = self.graphs.iter().find(|g| g.0 == bucket) {
            return Ok(g.2.0.launch()?);
        }
        let stream = self.pipe.model().device().stream().clone();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let captured = self.decode_step(bucket);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
        captured?;
        let graph =
            graph.ok_or_else(|| Error::Cuda("capturing the decode step gave no graph".into()))?;
        graph.launch()?;
        self.graphs.push((bucket, generation, Graph(graph)));
        Ok(())
    }

    /// The launches of a decode step of `n` rows, all reading their inputs from the device.
    fn decode_step(&mut self, n: usize) -> Result<()> {
        let vocab = self.pipe.model().cfg.vocab;
        self.pipe
            .model_mut()
            .forward_rows(&mut self.kv, &mut self.step, n)?;
        self.pipe
            .model_mut()
            .logits_of_rows(&self.sample_rows, n, &mut self.step.gemm)?;
        let (dev, logits) = self.pipe.model_mut().logits_mut();
        dev.sample_rows_launch(&mut self.next, logits, vocab, n, &mut self.sampler)
    }
}

/// A captured decode step.
struct Graph(CudaGraph);

// SAFETY: a CUDA graph may be launched from any thread (cudarc binds the context first); the
// backend that owns it is used by one thread at a time (`&mut self`), so it is never shared.
unsafe impl Send for Graph {}

/// A row's sampling as the batched sampler takes it, with its penalties as `batch::cpu::
/// sample_row` applies them: the repetition penalty on the distinct ids among the last
/// `repeat_last_n` of prompt and output, then `count * frequency + presence` subtracted from
/// the ids of the output.
fn row_sampling(s: &SampleSpec) -> RowSampling {
    let p = &s.sampling.params;
    let (f, pr) = (s.sampling.frequency_penalty, s.sampling.presence_penalty);
    let mut pen: std::collections::BTreeMap<u32, (f32, f32)> = Default::default();
    if p.repeat_penalty != 1.0 {
        let window = &s.history[s.history.len().saturating_sub(p.repeat_last_n)..];
        for &id in window {
            pen.insert(id, (p.repeat_penalty, 0.0));
        }
    }
    if f != 0.0 || pr != 0.0 {
        let mut counts: std::collections::BTreeMap<u32, usize> = Default::default();
        for &id in &s.history[s.prompt_len..] {
            *counts.entry(id).or_default() += 1;
        }
        for (id, n) in counts {
            pen.entry(id).or_insert((1.0, 0.0)).1 = n as f32 * f + pr;
        }
    }
    RowSampling {
        temperature: p.temperature,
        top_k: p.top_k.min(u32::MAX as usize) as u32,
        top_p: p.top_p,
        min_p: p.min_p,
        seed: p.seed,
        draw: s.draw,
        penalties: pen
            .into_iter()
            .map(|(id, (scale, sub))| (id, scale, sub))
            .collect(),
    }
}

/// The sequence the single-sequence pipeline decodes alone.
struct Lone {
    /// Its first block, which with `next` tells its row in a later step.
    first_block: u32,
    /// The position of its next row.
    next: usize,
    /// Its positions from here on are in the pipeline's contiguous cache only.
    from: usize,
}

/// Whether the pipeline samples `s` as the batched sampler does: on the GPU, without
/// log-probabilities or OpenAI's penalties (its sampler has the repetition penalty alone).
fn pipeline_samples(s: &SampleSpec) -> bool {
    s.logprobs.is_none()
        && s.sampling.frequency_penalty == 0.0
        && s.sampling.presence_penalty == 0.0
        && Device::can_sample(&s.sampling.params)
}

impl CudaBatch {
    /// A step of one row that the pipeline samples (a decode row, or a lone prompt's last
    /// chunk, which the pipeline prefills with its own GEMM), unless batch-invariant: the
    /// row's next token from the pipeline, its sequence's earlier keys and values first
    /// copied into the pipeline's cache if they are not there. Before a batched step in which
    /// the lone sequence runs on, the positions only the pipeline holds go back into its
    /// blocks. `None`: the step is the batched pass's.
    fn alone(&mut self, rows: &[Row]) -> Result<Option<Vec<RowOutput>>> {
        let lone = self.lone.take();
        let single = match rows {
            [r] if !self.batch_invariant && !r.blocks.is_empty() => r
                .sample
                .as_ref()
                .filter(|s| pipeline_samples(s))
                .map(|s| (r, s)),
            _ => None,
        };
        let continues =
            |l: &Lone, r: &Row| r.blocks.first() == Some(&l.first_block) && r.start == l.next;
        if let (Some(l), None) = (&lone, &single)
            && let Some(r) = rows.iter().find(|r| continues(l, r))
        {
            self.upload_table(r.blocks)?;
            let model = self.pipe.model_mut();
            model.store_paged(
                &mut self.kv,
                &self.step.tables,
                l.from,
                r.start,
                BLOCK_TOKENS,
            )?;
        }
        let Some((r, s)) = single else {
            return Ok(None);
        };
        let from = match lone.filter(|l| continues(l, r)) {
            Some(l) => l.from,
            None => {
                self.upload_table(r.blocks)?;
                let history = s.history.get(..r.start).ok_or_else(|| {
                    Error::Invalid(format!("a row at {} has a shorter history", r.start))
                })?;
                let model = self.pipe.model_mut();
                model.adopt_paged(&mut self.kv, &self.step.tables, history, BLOCK_TOKENS)?;
                r.start
            }
        };
        self.lone = Some(Lone {
            first_block: r.blocks[0],
            next: r.start + r.tokens.len(),
            from,
        });
        let token = self
            .pipe
            .next_token(r.tokens, &s.sampling.params, s.draw, s.more)?;
        Ok(Some(vec![RowOutput {
            token,
            logprob: None,
        }]))
    }

    /// Writes a block table to the step's tables, checking that its blocks are the pool's.
    fn upload_table(&mut self, blocks: &[u32]) -> Result<()> {
        if let Some(&bad) = blocks.iter().find(|&&b| b as usize >= self.blocks) {
            return Err(Error::Invalid(format!(
                "block {bad} is not one of the pool's {}",
                self.blocks
            )));
        }
        let dev = self.pipe.model().device();
        dev.copy_to(&mut self.step.tables.slice_mut(..blocks.len()), blocks)
    }
}

impl Backend for CudaBatch {
    fn step(&mut self, rows: &[Row]) -> Result<Vec<RowOutput>> {
        if let Some(out) = self.alone(rows)? {
            return Ok(out);
        }
        // Rows go in forward passes of at most MAX_BATCH tokens, whole rows each.
        let mut out = Vec::new();
        let mut group: Vec<&Row> = Vec::new();
        let mut tokens = 0;
        for r in rows {
            if r.tokens.is_empty() || r.tokens.len() > MAX_BATCH {
                return Err(Error::Invalid(format!(
                    "a row of a batched step feeds 1 to {MAX_BATCH} tokens, not {}",
                    r.tokens.len()
                )));
            }
            if tokens + r.tokens.len() > MAX_BATCH {
                out.extend(self.run(&group)?);
                group.clear();
                tokens = 0;
            }
            group.push(r);
            tokens += r.tokens.len();
        }
        if !group.is_empty() {
            out.extend(self.run(&group)?);
        }
        Ok(out)
    }

    fn kv_block_tokens(&self) -> usize {
        BLOCK_TOKENS
    }

    fn kv_blocks(&self) -> usize {
        self.blocks
    }

    fn ctx_len(&self) -> usize {
        self.pipe.model().max_ctx()
    }

    fn device(&self) -> String {
        self.pipe
            .model()
            .device()
            .name()
            .unwrap_or_else(|_| "cuda".into())
    }

    fn memory_gauge(&self) -> Option<MemoryGauge> {
        Some(self.pipe.model().device().memory_gauge())
    }
}
