//! The Qwen2 forward pass on the CPU, in f32, readable top to bottom: the reference every
//! other path is judged against, and the engine's fallback without a GPU.
//!
//! Weights are dequantized to f32 at load (about 2 GB for the 0.5B model), so the only
//! differences from Hugging Face's fp32 model are the order of floating-point sums.
use rayon::prelude::*;

use super::{add, matmul, paged_attention, rms_norm, rope_neox, silu_mul};
use crate::config::Config;
use crate::gguf::Gguf;
use crate::quant::dequantize_to_vec;
use crate::{Error, Result};

struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    bq: Vec<f32>,
    wk: Vec<f32>,
    bk: Vec<f32>,
    wv: Vec<f32>,
    bv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// The KV cache the forward pass writes and reads: per layer, K and V rows of `kv_dim` in
/// blocks of `block_tokens` positions. Position `p` of a sequence lives in block
/// `table[p / block_tokens]` of its block table, so many sequences share one cache (the batch
/// engine's paged KV cache) and a lone sequence owns one (`CpuModel::forward`). The storage
/// grows to the highest block written: a large pool costs only the memory it uses.
/// (`Default`: an empty stand-in, so that `CpuModel::forward` can lend its cache out.)
#[derive(Default)]
pub struct KvCache {
    block_tokens: usize,
    kv_dim: usize,
    /// Per layer, `[blocks, block_tokens, kv_dim]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(cfg: &Config, block_tokens: usize) -> KvCache {
        KvCache {
            block_tokens,
            kv_dim: cfg.kv_dim(),
            k: vec![Vec::new(); cfg.n_layers],
            v: vec![Vec::new(); cfg.n_layers],
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Stores layer `l`'s K and V rows (`[n, kv_dim]`) of positions `start..start + n`.
    fn write(&mut self, l: usize, table: &[u32], start: usize, k: &[f32], v: &[f32]) {
        let (bt, dim) = (self.block_tokens, self.kv_dim);
        for (i, (k, v)) in k.chunks_exact(dim).zip(v.chunks_exact(dim)).enumerate() {
            let p = start + i;
            let block = table[p / bt] as usize;
            let at = (block * bt + p % bt) * dim;
            for (cache, row) in [(&mut self.k[l], k), (&mut self.v[l], v)] {
                if cache.len() < at + dim {
                    cache.resize((block + 1) * bt * dim, 0.0);
                }
                cache[at..at + dim].copy_from_slice(row);
            }
        }
    }
}

/// Positions per block of `forward`'s own cache (it takes blocks 0, 1, 2, … as it grows).
const OWN_BLOCK_TOKENS: usize = 16;

pub struct CpuModel {
    pub cfg: Config,
    token_embd: Vec<f32>,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    /// `None` when the output projection is tied to `token_embd`.
    output: Option<Vec<f32>>,
    /// `forward`'s own sequence: its cache, its block table (blocks 0, 1, 2, …) and its length.
    cache: KvCache,
    table: Vec<u32>,
    pos: usize,
    max_ctx: usize,
}

impl CpuModel {
    /// Dequantizes every weight of `g` to f32; the cache holds at most `max_ctx` positions.
    pub fn load(g: &Gguf, max_ctx: usize) -> Result<CpuModel> {
        let cfg = Config::from_gguf(g)?;
        cfg.check_tensors(g)?;
        let load = |name: &str| -> Result<Vec<f32>> {
            let t = g.tensor(name)?;
            dequantize_to_vec(t.ty, g.tensor_data(t))
        };
        let layers = (0..cfg.n_layers)
            .into_par_iter()
            .map(|l| {
                let w = |s: &str| load(&format!("blk.{l}.{s}"));
                Ok(Layer {
                    attn_norm: w("attn_norm.weight")?,
                    wq: w("attn_q.weight")?,
                    bq: w("attn_q.bias")?,
                    wk: w("attn_k.weight")?,
                    bk: w("attn_k.bias")?,
                    wv: w("attn_v.weight")?,
                    bv: w("attn_v.bias")?,
                    wo: w("attn_output.weight")?,
                    ffn_norm: w("ffn_norm.weight")?,
                    w_gate: w("ffn_gate.weight")?,
                    w_up: w("ffn_up.weight")?,
                    w_down: w("ffn_down.weight")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let output = if cfg.tied_output {
            None
        } else {
            Some(load("output.weight")?)
        };
        Ok(CpuModel {
            token_embd: load("token_embd.weight")?,
            layers,
            output_norm: load("output_norm.weight")?,
            output,
            cache: KvCache::new(&cfg, OWN_BLOCK_TOKENS),
            table: Vec::new(),
            pos: 0,
            max_ctx: max_ctx.min(cfg.ctx_len),
            cfg,
        })
    }

    /// Bytes of f32 weights one token reads: every layer's, the final norm and the output
    /// projection, and one row of the embedding table.
    pub fn weight_bytes_per_token(&self) -> u64 {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [
                    &l.attn_norm,
                    &l.wq,
                    &l.bq,
                    &l.wk,
                    &l.bk,
                    &l.wv,
                    &l.bv,
                    &l.wo,
                    &l.ffn_norm,
                    &l.w_gate,
                    &l.w_up,
                    &l.w_down,
                ]
                .iter()
                .map(|w| w.len())
                .sum::<usize>()
            })
            .sum();
        let output = self.output.as_ref().unwrap_or(&self.token_embd).len();
        ((layers + self.output_norm.len() + output + self.cfg.hidden) * 4) as u64
    }

    /// Positions held in the KV cache: where the next token goes.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// The most positions this model's cache holds.
    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// Empties the KV cache, for a new sequence.
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Runs `tokens` at the positions after the cache's end (prefill when there are many,
    /// decode when there is one) and returns the logits of the last token, or of every token
    /// (`[tokens.len(), vocab]`) when `all_logits`.
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        let blocks = (self.pos + tokens.len()).div_ceil(OWN_BLOCK_TOKENS) as u32;
        self.table.extend(self.table.len() as u32..blocks);
        // The cache is lent to the pass, which reads the weights through `&self`.
        let mut cache = std::mem::take(&mut self.cache);
        let logits = self.forward_paged(tokens, self.pos, &mut cache, &self.table, all_logits);
        self.cache = cache;
        let logits = logits?;
        self.pos += tokens.len();
        Ok(logits)
    }

    /// Runs `tokens` at positions `start..start + tokens.len()` of the sequence whose block
    /// table is `table` in `kv` (it must cover those positions; the earlier ones are read from
    /// it) and returns the logits as `forward` does.
    pub fn forward_paged(
        &self,
        tokens: &[u32],
        start: usize,
        kv: &mut KvCache,
        table: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (n, hidden, kv_dim, pos) = (tokens.len(), c.hidden, c.kv_dim(), start);
        if pos + n > self.max_ctx {
            return Err(Error::Invalid(format!(
                "{} tokens do not fit the context: {pos} + {n} > {}",
                n, self.max_ctx
            )));
        }
        if pos + n > table.len() * kv.block_tokens {
            return Err(Error::Invalid(format!(
                "the block table covers {} positions, not {pos} + {n}",
                table.len() * kv.block_tokens
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary ({})",
                c.vocab
            )));
        }

        // Token embedding.
        let mut x: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| &self.token_embd[t as usize * hidden..][..hidden])
            .copied()
            .collect();
        let mut xb = vec![0.0; n * hidden];
        let mut q = vec![0.0; n * hidden];
        let mut k = vec![0.0; n * kv_dim];
        let mut v = vec![0.0; n * kv_dim];
        let mut att = vec![0.0; n * hidden];
        let mut gate = vec![0.0; n * c.ffn];
        let mut up = vec![0.0; n * c.ffn];

        for (l, w) in self.layers.iter().enumerate() {
            // Attention block.
            rms_norm(&mut xb, &x, &w.attn_norm, c.rms_eps);
            matmul(&mut q, &xb, &w.wq, hidden, Some(&w.bq));
            matmul(&mut k, &xb, &w.wk, hidden, Some(&w.bk));
            matmul(&mut v, &xb, &w.wv, hidden, Some(&w.bv));
            rope_neox(&mut q, hidden, pos, c.head_dim, c.rope_theta);
            rope_neox(&mut k, kv_dim, pos, c.head_dim, c.rope_theta);
            kv.write(l, table, pos, &k, &v);
            paged_attention(
                &mut att,
                &q,
                &kv.k[l],
                &kv.v[l],
                table,
                kv.block_tokens,
                pos,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
            );
            matmul(&mut xb, &att, &w.wo, hidden, None);
            add(&mut x, &xb);

            // Feed-forward block (SwiGLU).
            rms_norm(&mut xb, &x, &w.ffn_norm, c.rms_eps);
            matmul(&mut gate, &xb, &w.w_gate, hidden, None);
            matmul(&mut up, &xb, &w.w_up, hidden, None);
            silu_mul(&mut gate, &up);
            matmul(&mut xb, &gate, &w.w_down, c.ffn, None);
            add(&mut x, &xb);
        }

        // Final norm and output projection, for the rows asked for.
        let x = if all_logits {
            &x[..]
        } else {
            &x[(n - 1) * hidden..]
        };
        let mut xn = vec![0.0; x.len()];
        rms_norm(&mut xn, x, &self.output_norm, c.rms_eps);
        let mut logits = vec![0.0; x.len() / hidden * c.vocab];
        matmul(
            &mut logits,
            &xn,
            self.output.as_ref().unwrap_or(&self.token_embd),
            hidden,
            None,
        );
        Ok(logits)
    }
}
