//! The Qwen2 forward pass on the GPU: the twin of `cpu::model`, the same steps in the same
//! order with the same names, each a kernel from `gpu-kernels/`.
//!
//! Weights are uploaded once: matrices in the file's own quantized blocks (read and dequantized
//! in registers by the kernels, as exact as the CPU's dequantization) or, with
//! `WeightFormat::F16`, dequantized to f16 on the GPU at load; the embedding table in the
//! file's type; norms and biases f32. The KV cache and every activation buffer are allocated
//! at load, so nothing is allocated per token. The run-ahead decode of one sequence (graphs,
//! slots) is `decode_pipeline`'s.
use std::cell::{Cell, RefCell};

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

use super::decode_pipeline::GRAPH_STEPS;
use super::paged::{KvCopy, PagedKv};
use super::{
    AttentionSums, BoundedArgmax, Device, GpuMatrix, SplitScratch, StepEnd, gemm_rows_scratch,
};
use crate::config::Config;
use crate::gguf::{Gguf, TensorInfo};
use crate::models::Progress;
use crate::quant::{GgmlType, dequantize_to_vec};
use crate::sampling::SamplingParams;
use crate::{Error, Result};

/// Most tokens one prefill step runs; longer prompts go in chunks of this many.
pub(crate) const MAX_BATCH: usize = 512;
/// How the weight matrices are kept on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightFormat {
    /// The file's quantized blocks, as they are (~0.4 GB for the default model).
    #[default]
    Native,
    /// Dequantized to f16 at load (~1.1 GB), rounding each weight to 11 bits.
    F16,
}

/// The matrix `name` of `g` on the GPU in `format`; its rows are the tensor's `shape[0]`.
fn load_matrix(dev: &Device, g: &Gguf, name: &str, format: WeightFormat) -> Result<GpuMatrix> {
    let t = g.tensor(name)?;
    let (data, n_in) = (g.tensor_data(t), t.shape[0] as usize);
    match format {
        WeightFormat::Native => dev.upload_matrix(t.ty, data, n_in),
        WeightFormat::F16 => dev.upload_matrix_f16(t.ty, data, n_in),
    }
}

struct Layer {
    attn_norm: CudaSlice<f32>,
    wq: GpuMatrix,
    bq: CudaSlice<f32>,
    wk: GpuMatrix,
    bk: CudaSlice<f32>,
    wv: GpuMatrix,
    bv: CudaSlice<f32>,
    wo: GpuMatrix,
    ffn_norm: CudaSlice<f32>,
    w_gate: GpuMatrix,
    w_up: GpuMatrix,
    w_down: GpuMatrix,
    k_cache: CudaSlice<f32>,
    v_cache: CudaSlice<f32>,
    /// What the decode attention adds into, zeroed by the layer's `attn_qkv`.
    sums: AttentionSums,
}

/// Activations for up to `MAX_BATCH` tokens.
struct Buffers {
    x: CudaSlice<f32>,
    xb: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    att: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    /// Every token fed so far (the embedding reads its ids here, the sampler's penalty too).
    tokens: CudaSlice<u32>,
    /// Position of the first token of the current step, read by RoPE, the cache and attention.
    pos: CudaSlice<u32>,
    /// The tokens the device picks: `GRAPH_STEPS` for each of the decode pipeline's two
    /// slots, then the prefill's.
    next: CudaSlice<u32>,
    /// Draws of the sampler so far: the sampler's `step`, advanced on the device.
    step: CudaSlice<u64>,
    /// Scratch of the output projection's fused arg-max.
    best: CudaSlice<u64>,
    /// The sampler's candidates, each slice's top k.
    cands: CudaSlice<u32>,
}

/// The model on the GPU: its weights, its KV cache and activation buffers, and the forward
/// passes over them (`forward_chunk`, `decode_step`, `forward_rows`). Single-sequence decoding
/// wraps it in a `DecodePipeline`; the batching backend drives `forward_rows`.
pub struct CudaModel {
    pub cfg: Config,
    dev: Device,
    token_embd: GpuMatrix,
    layers: Vec<Layer>,
    output_norm: CudaSlice<f32>,
    output: GpuMatrix,
    /// Greedy decoding's bounded arg-max over `output`, where it applies (q8_0, f16).
    bounded: Option<BoundedArgmax>,
    rope: CudaSlice<f32>,
    buf: Buffers,
    /// Tokens in the KV cache.
    pos: usize,
    max_ctx: usize,
    /// Free device memory before the first allocation, to tell how much the model took.
    free_before: usize,
}

impl CudaModel {
    /// Uploads the weights of `g` and allocates a KV cache of `max_ctx` positions. Fails with
    /// what is needed and what is free when the GPU's memory is too small.
    /// `progress` hears of the upload: a step, then the bytes of tensors uploaded so far.
    pub fn load(
        dev: Device,
        g: &Gguf,
        max_ctx: usize,
        format: WeightFormat,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<CudaModel> {
        let cfg = Config::from_gguf(g)?;
        cfg.check_tensors(g)?;
        let max_ctx = max_ctx.min(cfg.ctx_len);
        let free_before = check_memory(&dev, &cfg, g, max_ctx, format)?;

        progress(Progress::Step(&format!(
            "uploading weights to {}",
            dev.name()?
        )));
        let embd = g.tensor("token_embd.weight")?;
        let total = g.tensors().iter().map(|t| t.bytes).sum::<u64>()
            + if cfg.tied_output { embd.bytes } else { 0 };
        let (done, progress) = (Cell::new(0u64), RefCell::new(progress));
        let uploaded = |name: &str| -> Result<&TensorInfo> {
            let t = g.tensor(name)?;
            done.set(done.get() + t.bytes);
            (progress.borrow_mut())(Progress::Bytes {
                done: done.get(),
                total,
            });
            Ok(t)
        };
        let f32s = |name: &str| -> Result<CudaSlice<f32>> {
            let t = uploaded(name)?;
            dev.upload(&dequantize_to_vec(t.ty, g.tensor_data(t))?)
        };
        let matrix = |name: &str| {
            uploaded(name)?;
            load_matrix(&dev, g, name, format)
        };
        let kv_len = max_ctx * cfg.kv_dim();
        let layers = (0..cfg.n_layers)
            .map(|l| {
                let name = |s: &str| format!("blk.{l}.{s}");
                Ok(Layer {
                    attn_norm: f32s(&name("attn_norm.weight"))?,
                    wq: matrix(&name("attn_q.weight"))?,
                    bq: f32s(&name("attn_q.bias"))?,
                    wk: matrix(&name("attn_k.weight"))?,
                    bk: f32s(&name("attn_k.bias"))?,
                    wv: matrix(&name("attn_v.weight"))?,
                    bv: f32s(&name("attn_v.bias"))?,
                    wo: matrix(&name("attn_output.weight"))?,
                    ffn_norm: f32s(&name("ffn_norm.weight"))?,
                    w_gate: matrix(&name("ffn_gate.weight"))?,
                    w_up: matrix(&name("ffn_up.weight"))?,
                    w_down: matrix(&name("ffn_down.weight"))?,
                    k_cache: dev.zeros(kv_len)?,
                    v_cache: dev.zeros(kv_len)?,
                    sums: dev.attention_sums(cfg.n_heads, cfg.head_dim)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let output_name = output_name(&cfg);
        let output = matrix(output_name)?;
        let bounded = dev.bounded_argmax(&output)?;
        let (h, n) = (cfg.hidden, MAX_BATCH);
        let buf = Buffers {
            x: dev.zeros(n * h)?,
            xb: dev.zeros(n * h)?,
            q: dev.zeros(n * h)?,
            k: dev.zeros(n * cfg.kv_dim())?,
            v: dev.zeros(n * cfg.kv_dim())?,
            att: dev.zeros(n * h)?,
            gate: dev.zeros(n * cfg.ffn)?,
            up: dev.zeros(n * cfg.ffn)?,
            logits: dev.zeros(n * cfg.vocab)?,
            tokens: dev.zeros(max_ctx)?,
            pos: dev.zeros(1)?,
            next: dev.zeros(2 * GRAPH_STEPS + 1)?,
            step: dev.zeros(1)?,
            best: dev.logits_scratch()?,
            cands: dev.sample_scratch(cfg.vocab)?,
        };
        Ok(CudaModel {
            token_embd: {
                let t = uploaded("token_embd.weight")?;
                dev.upload_matrix(t.ty, g.tensor_data(t), cfg.hidden)?
            },
            layers,
            output_norm: f32s("output_norm.weight")?,
            output,
            bounded,
            rope: dev.rope_table(max_ctx, cfg.head_dim, cfg.rope_theta)?,
            buf,
            pos: 0,
            max_ctx,
            free_before,
            cfg,
            dev,
        })
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Bytes of weights one greedy decoded token reads: every matrix, norm and bias once (of
    /// the output projection, what the bounded arg-max's first pass reads, where it applies),
    /// and one row of the embedding table.
    pub fn weight_bytes_per_token(&self) -> u64 {
        let f32s = |v: &CudaSlice<f32>| v.len() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.attn_norm, &l.bq, &l.bk, &l.bv, &l.ffn_norm]
                    .map(f32s)
                    .iter()
                    .sum::<usize>()
                    + [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                        .map(GpuMatrix::bytes)
                        .iter()
                        .sum::<usize>()
            })
            .sum();
        let embd_row = self.token_embd.bytes() / self.token_embd.rows().max(1);
        let output = self
            .bounded
            .as_ref()
            .map_or(self.output.bytes(), BoundedArgmax::first_pass_bytes);
        (layers + f32s(&self.output_norm) + output + embd_row) as u64
    }

    /// Device memory taken since before the model was loaded (it allocates nothing later).
    pub fn gpu_memory_used(&self) -> Result<u64> {
        let (free, _) = self.dev.memory()?;
        Ok(self.free_before.saturating_sub(free) as u64)
    }

    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// Empties the KV cache, for a new sequence.
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Tokens in the KV cache.
    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    /// Counts the token of a decode step run on the device into the cache.
    pub(super) fn advance(&mut self) {
        self.pos += 1;
    }

    /// Every token fed so far, read back from the device.
    pub(super) fn fed_tokens(&self) -> Result<Vec<u32>> {
        self.dev.download(&self.buf.tokens.slice(..self.pos))
    }

    /// Sets the device's position to the cache's end and the sampler's draw to `step`.
    pub(super) fn set_position_and_draw(&mut self, step: u64) -> Result<()> {
        let (dev, b) = (&self.dev, &mut self.buf);
        dev.copy_to(&mut b.pos, &[self.pos as u32])?;
        dev.copy_to(&mut b.step, &[step])
    }

    /// `n` of the tokens the device picked, from `first` (`Buffers::next`).
    pub(super) fn picked(&self, first: usize, n: usize) -> CudaView<'_, u32> {
        self.buf.next.slice(first..first + n)
    }

    /// Samples the token after the last one run (by `forward_chunk`) with `p` and draw `step`
    /// on the device, into `Buffers::next[out]`.
    pub(super) fn sample_last(&mut self, p: &SamplingParams, step: u64, out: usize) -> Result<()> {
        // The sampler reads the position of the last token run and the draw index.
        let (dev, b) = (&self.dev, &mut self.buf);
        dev.copy_to(&mut b.pos, &[self.pos as u32 - 1])?;
        dev.copy_to(&mut b.step, &[step])?;
        let mut logits = b.logits.slice_mut(..self.cfg.vocab);
        let mut out = b.next.slice_mut(out..);
        dev.sample_dev(
            &mut out,
            &mut logits,
            &mut b.tokens,
            &mut b.pos,
            &mut b.step,
            p,
            &mut b.cands,
        )
    }

    /// Runs `tokens` after the cache's end and returns the logits of the last token, or of every
    /// token (`[tokens.len(), vocab]`) when `all_logits`.
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        let vocab = self.cfg.vocab;
        let mut logits = Vec::with_capacity(if all_logits {
            tokens.len() * vocab
        } else {
            vocab
        });
        for chunk in tokens.chunks(MAX_BATCH) {
            let rows = self.forward_chunk(chunk, all_logits)?;
            logits.extend(self.dev.download(&self.buf.logits.slice(..rows * vocab))?);
        }
        if !all_logits {
            logits.drain(..logits.len() - vocab);
        }
        Ok(logits)
    }

    /// The launches of one decode step, all reading the position and the token from the
    /// device: the twin of the CPU forward pass for one token, with its steps fused.
    /// `out` indexes `Buffers::next`, where the step's token goes.
    pub(super) fn decode_step(&mut self, p: &SamplingParams, out: usize) -> Result<()> {
        let c = &self.cfg;
        let (hidden, eps) = (c.hidden, c.rms_eps);
        let (dev, b) = (&self.dev, &mut self.buf);

        // Token embedding of tokens[pos].
        let mut x = b.x.slice_mut(..hidden);
        dev.embed_at(&mut x, &self.token_embd, &b.tokens, &b.pos)?;

        for w in &mut self.layers {
            // Attention block: norm, q/k/v with bias, RoPE and the cache append in one kernel
            // (which also zeroes the layer's sums); attention, its key slices added into the
            // sums; the output projection of the sums, normalised, added to the residual.
            let qkv = [
                (&w.wq, Some(&w.bq)),
                (&w.wk, Some(&w.bk)),
                (&w.wv, Some(&w.bv)),
            ];
            let mut q = b.q.slice_mut(..hidden);
            dev.attn_qkv(
                &mut q,
                &mut w.k_cache,
                &mut w.v_cache,
                &x,
                &w.attn_norm,
                eps,
                qkv,
                &b.pos,
                &self.rope,
                &mut w.sums,
                c.n_heads,
                c.n_kv_heads,
            )?;
            dev.attention_decode(
                &mut w.sums,
                &q,
                &w.k_cache,
                &w.v_cache,
                &b.pos,
                c.n_kv_heads,
            )?;
            dev.attn_output(&mut x, &w.wo, &w.sums)?;

            // Feed-forward block: norm, gate and up with SiLU·mul in one kernel; the down
            // projection added to the residual.
            let mut h = b.gate.slice_mut(..c.ffn);
            dev.ffn_gate_up(&mut h, &x, &w.ffn_norm, eps, &w.w_gate, &w.w_up)?;
            dev.gemv_residual(&mut x, &w.w_down, None, &h)?;
        }

        // Final norm and output projection, then the next token, written to tokens[pos + 1]:
        // greedy takes the projection's arg-max (bounded where it can be, else fused; its last
        // block ends the step), sampling reads the logits.
        let mut logits = b.logits.slice_mut(..c.vocab);
        let (out_norm, output) = (&self.output_norm, &self.output);
        let mut next = b.next.slice_mut(out..out + 1);
        if p.temperature == 0.0 && p.repeat_penalty == 1.0 {
            let end = StepEnd {
                tokens: &mut b.tokens,
                pos: &mut b.pos,
                step: &mut b.step,
            };
            let best = (
                &mut next as &mut dyn DevicePtrMut<u32>,
                &mut b.best,
                Some(end),
            );
            match &mut self.bounded {
                Some(bounded) => dev.argmax_bounded(bounded, &x, out_norm, eps, output, best),
                None => dev.logits(&mut logits, &x, out_norm, eps, output, Some(best)),
            }
        } else {
            dev.logits(&mut logits, &x, out_norm, eps, output, None)?;
            dev.sample_dev(
                &mut next,
                &mut logits,
                &mut b.tokens,
                &mut b.pos,
                &mut b.step,
                p,
                &mut b.cands,
            )
        }
    }

    /// One forward step over at most `MAX_BATCH` tokens; leaves the logits of the last token
    /// (or of all, with `all_logits`) at the start of `buf.logits` and returns how many rows.
    pub(super) fn forward_chunk(&mut self, tokens: &[u32], all_logits: bool) -> Result<usize> {
        let c = &self.cfg;
        let (n, hidden, kv_dim, pos) = (tokens.len(), c.hidden, c.kv_dim(), self.pos);
        if pos + n > self.max_ctx {
            return Err(Error::Invalid(format!(
                "{n} tokens do not fit the context: {pos} + {n} > {}",
                self.max_ctx
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary ({})",
                c.vocab
            )));
        }
        let (dev, b) = (&self.dev, &mut self.buf);
        dev.copy_to(&mut b.tokens.slice_mut(pos..pos + n), tokens)?;
        dev.copy_to(&mut b.pos, &[pos as u32])?;

        // Token embedding.
        let ids = b.tokens.slice(pos..pos + n);
        dev.embed(
            &mut view_mut(&mut b.x, n * hidden),
            &self.token_embd,
            &ids,
            n,
        )?;

        for w in &mut self.layers {
            // Attention block: q/k/v, RoPE at pos.., the cache append, causal attention.
            qkv(dev, c, w, b, n, &mut Product::Matmul)?;
            dev.rope_neox(
                &mut view_mut(&mut b.q, n * hidden),
                &b.pos,
                &self.rope,
                c.n_heads,
                c.head_dim,
            )?;
            dev.rope_neox(
                &mut view_mut(&mut b.k, n * kv_dim),
                &b.pos,
                &self.rope,
                c.n_kv_heads,
                c.head_dim,
            )?;
            dev.kv_append(
                &mut w.k_cache,
                &mut w.v_cache,
                &view(&b.k, n * kv_dim),
                &view(&b.v, n * kv_dim),
                &b.pos,
                kv_dim,
            )?;
            dev.attention(
                &mut view_mut(&mut b.att, n * hidden),
                &view(&b.q, n * hidden),
                &w.k_cache,
                &w.v_cache,
                &b.pos,
                n,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
            )?;
            attn_output(dev, w, b, n, hidden, &mut Product::Matmul)?;
            ffn(dev, c, w, b, n, &mut Product::Matmul)?;
        }

        // Final norm and output projection, for the rows asked for.
        let first = if all_logits { 0 } else { n - 1 };
        let out_rows = n - first;
        dev.rms_norm(
            &mut b.xb.slice_mut(..out_rows * hidden),
            &b.x.slice(first * hidden..n * hidden),
            &self.output_norm,
            c.rms_eps,
        )?;
        dev.matmul(
            &mut b.logits.slice_mut(..out_rows * c.vocab),
            &view(&b.xb, out_rows * hidden),
            &self.output,
            None,
            out_rows,
        )?;
        self.pos += n;
        Ok(out_rows)
    }
}

impl CudaModel {
    /// One batched forward step over the `n` rows of `step` (at most `MAX_BATCH`), every row
    /// at its own position in its own sequence, the KV cache paged (`kv`: one per layer):
    /// leaves the final hidden state of each row in `buf.x`, the twin of
    /// `cpu::model::CpuModel::forward` for each sequence.
    pub(crate) fn forward_rows(
        &mut self,
        kv: &mut [PagedKv],
        step: &mut StepInputs,
        n: usize,
    ) -> Result<()> {
        let c = &self.cfg;
        let hidden = c.hidden;
        if n == 0 || n > MAX_BATCH {
            return Err(Error::Invalid(format!(
                "a batched step takes 1 to {MAX_BATCH} rows, not {n}"
            )));
        }
        let (dev, b) = (&self.dev, &mut self.buf);
        dev.embed(
            &mut view_mut(&mut b.x, n * hidden),
            &self.token_embd,
            &step.ids,
            n,
        )?;
        for (w, kv) in self.layers.iter_mut().zip(kv) {
            // Attention block: q/k/v, RoPE at each row's position and the store into its cache
            // slot, attention over each sequence's blocks.
            qkv(dev, c, w, b, n, &mut Product::Rows(&mut step.gemm))?;
            dev.rope_kv_paged(
                &mut view_mut(&mut b.q, n * hidden),
                &b.k,
                &b.v,
                kv,
                &step.positions,
                &step.slots,
                &self.rope,
                n,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
            )?;
            dev.paged_attention(
                &mut view_mut(&mut b.att, n * hidden),
                &view(&b.q, n * hidden),
                kv,
                &step.items,
                step.n_items,
                &step.tables,
                &mut step.attention,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
                step.block_tokens,
            )?;
            attn_output(dev, w, b, n, hidden, &mut Product::Rows(&mut step.gemm))?;
            ffn(dev, c, w, b, n, &mut Product::Rows(&mut step.gemm))?;
        }
        Ok(())
    }

    /// The logits `[rows.len(), vocab]` (at the start of `buf.logits`) of the rows `rows` of the
    /// last `forward_rows`: the final norm and the output projection of those rows alone.
    pub(crate) fn logits_of_rows(
        &mut self,
        rows: &CudaSlice<u32>,
        n: usize,
        scratch: &mut SplitScratch,
    ) -> Result<()> {
        let c = &self.cfg;
        let (dev, b) = (&self.dev, &mut self.buf);
        dev.gather_rows(&mut b.att, &b.x, rows, n, c.hidden)?;
        dev.rms_norm(
            &mut view_mut(&mut b.xb, n * c.hidden),
            &view(&b.att, n * c.hidden),
            &self.output_norm,
            c.rms_eps,
        )?;
        dev.matmul_rows(
            &mut view_mut(&mut b.logits, n * c.vocab),
            &view(&b.xb, n * c.hidden),
            &self.output,
            None,
            n,
            scratch,
        )
    }

    /// The device, and the logits buffer `[MAX_BATCH, vocab]` where `logits_of_rows` leaves
    /// its rows.
    pub(crate) fn logits_mut(&mut self) -> (&Device, &mut CudaSlice<f32>) {
        (&self.dev, &mut self.buf.logits)
    }

    /// Makes the contiguous cache hold the sequence `history`, whose keys and values are in the
    /// paged caches `kv` (one per layer) through the block table `table`, so that the
    /// single-sequence passes continue it.
    pub(crate) fn adopt_paged(
        &mut self,
        kv: &mut [PagedKv],
        table: &CudaSlice<u32>,
        history: &[u32],
        block_tokens: usize,
    ) -> Result<()> {
        let n = history.len();
        if n > self.max_ctx {
            return Err(Error::Invalid(format!(
                "a sequence of {n} tokens does not fit the context ({})",
                self.max_ctx
            )));
        }
        self.copy_paged(KvCopy::FromPaged, kv, table, 0, n, block_tokens)?;
        if n > 0 {
            self.dev
                .copy_to(&mut self.buf.tokens.slice_mut(..n), history)?;
        }
        self.pos = n;
        Ok(())
    }

    /// Writes positions `first..end` of the contiguous cache into the paged caches `kv`
    /// through the sequence's block table `table`: what the single-sequence passes added.
    pub(crate) fn store_paged(
        &mut self,
        kv: &mut [PagedKv],
        table: &CudaSlice<u32>,
        first: usize,
        end: usize,
        block_tokens: usize,
    ) -> Result<()> {
        let n = end.saturating_sub(first);
        self.copy_paged(KvCopy::ToPaged, kv, table, first, n, block_tokens)
    }

    /// `kv_copy_paged` of positions `first..first + n` for every layer.
    fn copy_paged(
        &mut self,
        dir: KvCopy,
        kv: &mut [PagedKv],
        table: &CudaSlice<u32>,
        first: usize,
        n: usize,
        block_tokens: usize,
    ) -> Result<()> {
        let (dev, kv_dim) = (&self.dev, self.cfg.kv_dim());
        for (w, kv) in self.layers.iter_mut().zip(kv) {
            let (k, v) = (&mut w.k_cache, &mut w.v_cache);
            dev.kv_copy_paged(dir, k, v, kv, table, first, n, kv_dim, block_tokens)?;
        }
        Ok(())
    }

    /// Floats of `gemm_scratch` a row of the batched pass takes: its widest parts of K.
    fn gemm_rows_scratch(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|w| [&w.wq, &w.wk, &w.wv, &w.wo, &w.w_gate, &w.w_up, &w.w_down])
            .chain([&self.output])
            .map(|m| gemm_rows_scratch(m.n_in(), m.rows()))
            .max()
            .unwrap_or(0)
    }

    /// The device buffers of the rows of one batched step, for up to `MAX_BATCH` rows and
    /// `tables` block-table entries.
    pub(crate) fn step_inputs(&self, tables: usize, block_tokens: usize) -> Result<StepInputs> {
        let (dev, c) = (&self.dev, &self.cfg);
        Ok(StepInputs {
            ids: dev.zeros(MAX_BATCH)?,
            positions: dev.zeros(MAX_BATCH)?,
            slots: dev.zeros(MAX_BATCH)?,
            items: dev.zeros(4 * 2 * MAX_BATCH)?,
            n_items: 0,
            tables: dev.zeros(tables.max(1))?,
            attention: dev.paged_scratch(
                MAX_BATCH,
                2 * MAX_BATCH,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
            )?,
            gemm: dev.gemm_scratch(MAX_BATCH, self.gemm_rows_scratch())?,
            block_tokens,
        })
    }
}

/// What a batched step's kernels read about its rows, on the device: each row's token, position
/// and cache slot, the attention's work items, and the sequences' block tables.
pub(crate) struct StepInputs {
    pub ids: CudaSlice<u32>,
    pub positions: CudaSlice<u32>,
    pub slots: CudaSlice<u32>,
    pub items: CudaSlice<u32>,
    pub n_items: usize,
    pub tables: CudaSlice<u32>,
    /// `paged_attention`'s partial results of its key splits.
    pub attention: SplitScratch,
    /// Where `matmul_rows`'s parts of K meet.
    pub gemm: SplitScratch,
    pub block_tokens: usize,
}

/// Which matrix product a pass runs.
enum Product<'a> {
    /// `Device::matmul`: the single sequence's prefill (the tiled tensor-core GEMM).
    Matmul,
    /// `Device::matmul_rows`: the batched pass, each row's values independent of the batch,
    /// with the scratch where its parts of K meet.
    Rows(&'a mut SplitScratch),
}

impl Product<'_> {
    fn run(
        &mut self,
        dev: &Device,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        w: &GpuMatrix,
        bias: Option<&CudaSlice<f32>>,
        n: usize,
    ) -> Result<()> {
        match self {
            Product::Matmul => dev.matmul(y, x, w, bias, n),
            Product::Rows(scratch) => dev.matmul_rows(y, x, w, bias, n, scratch),
        }
    }
}

/// RMSNorm of rows `..n` of the residual `b.x` with `norm`, into `b.xb`: where both blocks
/// start.
fn norm_rows(
    dev: &Device,
    c: &Config,
    b: &mut Buffers,
    norm: &CudaSlice<f32>,
    n: usize,
) -> Result<()> {
    dev.rms_norm(
        &mut view_mut(&mut b.xb, n * c.hidden),
        &view(&b.x, n * c.hidden),
        norm,
        c.rms_eps,
    )
}

/// The attention block's start for rows `..n` of `b.x`: RMSNorm, then q, k and v with their
/// biases.
fn qkv(
    dev: &Device,
    c: &Config,
    w: &Layer,
    b: &mut Buffers,
    n: usize,
    product: &mut Product,
) -> Result<()> {
    let (hidden, kv_dim) = (c.hidden, c.kv_dim());
    norm_rows(dev, c, b, &w.attn_norm, n)?;
    let xb = view(&b.xb, n * hidden);
    let mut mm = |y: &mut CudaViewMut<f32>, w, bias| product.run(dev, y, &xb, w, bias, n);
    mm(&mut view_mut(&mut b.q, n * hidden), &w.wq, Some(&w.bq))?;
    mm(&mut view_mut(&mut b.k, n * kv_dim), &w.wk, Some(&w.bk))?;
    mm(&mut view_mut(&mut b.v, n * kv_dim), &w.wv, Some(&w.bv))
}

/// The attention block's end: the output projection of `b.att`, added to the residual.
fn attn_output(
    dev: &Device,
    w: &Layer,
    b: &mut Buffers,
    n: usize,
    hidden: usize,
    product: &mut Product,
) -> Result<()> {
    let (att, mut out) = (view(&b.att, n * hidden), view_mut(&mut b.xb, n * hidden));
    product.run(dev, &mut out, &att, &w.wo, None, n)?;
    dev.add(
        &mut view_mut(&mut b.x, n * hidden),
        &view(&b.xb, n * hidden),
    )
}

/// The feed-forward block (SwiGLU) on rows `..n` of the residual `b.x`.
fn ffn(
    dev: &Device,
    c: &Config,
    w: &Layer,
    b: &mut Buffers,
    n: usize,
    product: &mut Product,
) -> Result<()> {
    let (hidden, ffn) = (c.hidden, c.ffn);
    norm_rows(dev, c, b, &w.ffn_norm, n)?;
    let xb = view(&b.xb, n * hidden);
    let mut mm = |y: &mut CudaViewMut<f32>, w| product.run(dev, y, &xb, w, None, n);
    mm(&mut view_mut(&mut b.gate, n * ffn), &w.w_gate)?;
    mm(&mut view_mut(&mut b.up, n * ffn), &w.w_up)?;
    dev.silu_mul(&mut view_mut(&mut b.gate, n * ffn), &view(&b.up, n * ffn))?;
    let (gate, mut out) = (view(&b.gate, n * ffn), view_mut(&mut b.xb, n * hidden));
    product.run(dev, &mut out, &gate, &w.w_down, None, n)?;
    dev.add(
        &mut view_mut(&mut b.x, n * hidden),
        &view(&b.xb, n * hidden),
    )
}

/// The first `len` elements of a buffer.
fn view<T>(buf: &CudaSlice<T>, len: usize) -> CudaView<'_, T> {
    buf.slice(..len)
}

fn view_mut<T>(buf: &mut CudaSlice<T>, len: usize) -> CudaViewMut<'_, T> {
    buf.slice_mut(..len)
}

/// The tensor of the output projection: its own, or the token embedding's when they are tied.
fn output_name(c: &Config) -> &'static str {
    if c.tied_output {
        "token_embd.weight"
    } else {
        "output.weight"
    }
}

/// Bytes the model will take on the GPU, checked against what is free before anything is
/// allocated; returns what is free.
fn check_memory(
    dev: &Device,
    c: &Config,
    g: &Gguf,
    max_ctx: usize,
    format: WeightFormat,
) -> Result<usize> {
    // A tensor's bytes in the kernels' layout (`pack`), for the types that have one.
    let packed = |t: &TensorInfo| {
        let (n_in, rows) = (
            t.shape[0] as usize,
            (t.n_elems() / t.shape[0].max(1)) as usize,
        );
        crate::pack::layout(t.ty, rows, n_in).map(|l| l.bytes as u64)
    };
    let weights: u64 = g
        .tensors()
        .iter()
        .map(|t| match (t.name.as_str(), t.ty, format) {
            ("token_embd.weight", _, _) | (_, GgmlType::F32, _) | (_, _, WeightFormat::Native) => {
                packed(t).unwrap_or(t.bytes)
            }
            (_, _, WeightFormat::F16) => t.n_elems() * 2,
        })
        .sum::<u64>()
        + if c.tied_output {
            // The output projection gets its own copy of the embedding table.
            let t = g.tensor("token_embd.weight")?;
            if format == WeightFormat::Native {
                t.bytes
            } else {
                t.n_elems() * 2
            }
        } else {
            0
        };
    // f16: each quantized matrix goes up packed and is converted on the GPU, so the largest
    // one's packed copy is there beside the f16 weights for a moment.
    let transient = if format == WeightFormat::F16 {
        g.tensors()
            .iter()
            .filter(|t| t.ty.block_elems() > 1)
            .filter_map(packed)
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    // The bounded arg-max's plane and upper bounds, for a q8_0 or f16 output matrix.
    let out = g.tensor(output_name(c))?;
    let out_ty = match format {
        WeightFormat::Native => out.ty,
        WeightFormat::F16 => GgmlType::F16,
    };
    let bounded = if BoundedArgmax::applies(out_ty, c.hidden) {
        BoundedArgmax::bytes(out_ty, c.vocab, c.hidden) as u64
    } else {
        0
    };
    let weights = weights + transient + bounded;
    let cache = (2 * c.n_layers * max_ctx * c.kv_dim() * 4) as u64;
    let acts = (MAX_BATCH * (5 * c.hidden + 2 * c.kv_dim() + 2 * c.ffn + c.vocab) * 4
        + max_ctx * 4
        + max_ctx * c.head_dim * 4) as u64;
    let needed = weights + cache + acts;
    let (free, _total) = dev.memory()?;
    if needed > free as u64 {
        // Only the cache grows with --ctx: suggest it when a smaller cache would do.
        let hint = if needed - cache < free as u64 {
            "; a smaller --ctx fits"
        } else {
            ""
        };
        return Err(Error::GpuMemory(format!(
            "not enough GPU memory: the model needs {:.2} GiB ({:.2} GiB of weights, {:.2} GiB of KV cache for {max_ctx} positions) but {:.2} GiB are free{hint}",
            gib(needed),
            gib(weights),
            gib(cache),
            gib(free as u64)
        )));
    }
    Ok(free)
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
