//! The boundary between the batch scheduler and a device: one call runs every row of a step.
//!
//! The scheduler owns block allocation (which block ids a sequence holds, `kv::BlockPool`); the
//! backend owns the KV storage those ids index. A row's block table always covers the
//! positions it writes, and a block is only ever written by the sequence holding it.
use super::{Sampling, TokenLogprob};
use crate::Result;
use crate::cuda::MemoryGauge;

/// One sequence's share of a step.
pub struct Row<'a> {
    /// Fed this step: a prefill chunk, or the one token generated last.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` in the sequence; positions `0..start` are in the KV cache.
    pub start: usize,
    /// The sequence's block table: covers positions `0..start + tokens.len()`.
    pub blocks: &'a [u32],
    /// `None` for a prefill chunk that does not end the prompt (nothing is sampled).
    pub sample: Option<SampleSpec<'a>>,
}

/// How to pick the token after a row's last.
pub struct SampleSpec<'a> {
    pub sampling: &'a Sampling,
    /// Index of this draw: the number of tokens the sequence has generated so far. The draw's
    /// random number depends only on (seed, draw), so a recomputed sequence draws the same.
    pub draw: u64,
    /// Prompt and output so far (the penalties look at it).
    pub history: &'a [u32],
    /// `history[prompt_len..]` is the output (frequency and presence penalties).
    pub prompt_len: usize,
    /// `Some(n)`: the chosen token's log-probability and the `n` most likely tokens'.
    pub logprobs: Option<usize>,
    /// Tokens the sequence may generate after this one at most (a backend may compute that
    /// many ahead).
    pub more: usize,
}

/// What a sampled row gave.
#[derive(Clone, Debug, PartialEq)]
pub struct RowOutput {
    pub token: u32,
    /// With `SampleSpec::logprobs`: the chosen token's and the top-n, of the raw logits.
    pub logprob: Option<(TokenLogprob, Vec<TokenLogprob>)>,
}

/// A device that runs the forward pass over a paged KV cache.
pub trait Backend: Send {
    /// Runs every row (each at its own positions, through its own block table) and samples
    /// the rows that ask for it: one `RowOutput` per row whose `sample` is `Some`, in row order.
    fn step(&mut self, rows: &[Row]) -> Result<Vec<RowOutput>>;
    /// Positions per KV block.
    fn kv_block_tokens(&self) -> usize;
    /// Blocks in the pool; the storage for them is the backend's.
    fn kv_blocks(&self) -> usize;
    /// Positions one sequence may have at most.
    fn ctx_len(&self) -> usize;
    /// "cpu" or the GPU's name.
    fn device(&self) -> String;
    /// Reads the device's memory in use from other threads; `None` on the CPU.
    fn memory_gauge(&self) -> Option<MemoryGauge> {
        None
    }
}
