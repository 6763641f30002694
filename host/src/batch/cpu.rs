//! The batch engine on the CPU: the reference forward pass over a paged KV cache, one row after
//! another, each row sampled with the library's sampler.
use std::sync::Arc;

use super::TokenLogprob;
use super::backend::{Backend, Row, RowOutput, SampleSpec};
use crate::Result;
use crate::cpu::model::{CpuModel, KvCache};
use crate::sampling::{apply_frequency_presence, apply_repeat_penalty, sample, top_k};

/// Positions per KV block on the CPU.
pub const BLOCK_TOKENS: usize = 16;

pub struct CpuBackend {
    /// Shared, so that tests can run several engines on one copy of the weights.
    model: Arc<CpuModel>,
    kv: KvCache,
    blocks: usize,
}

impl CpuBackend {
    /// Serves `model` with a pool of `kv_tokens` positions (rounded up to whole blocks); the
    /// cache's memory grows with the blocks in use.
    pub fn new(model: Arc<CpuModel>, kv_tokens: usize) -> CpuBackend {
        CpuBackend {
            kv: KvCache::new(&model.cfg, BLOCK_TOKENS),
            blocks: kv_tokens.div_ceil(BLOCK_TOKENS),
            model,
        }
    }
}

impl Backend for CpuBackend {
    fn step(&mut self, rows: &[Row]) -> Result<Vec<RowOutput>> {
        let mut out = Vec::new();
        for row in rows {
            let mut logits =
                self.model
                    .forward_paged(row.tokens, row.start, &mut self.kv, row.blocks, false)?;
            if let Some(s) = &row.sample {
                out.push(sample_row(&mut logits, s));
            }
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
        self.model.max_ctx()
    }

    fn device(&self) -> String {
        "cpu".into()
    }
}

/// The token `s` picks from the raw `logits` (penalised in place): the repetition penalty over
/// prompt and output, then the frequency and presence penalties over the output (vLLM's order),
/// then `sample` with draw number `s.draw`. Log-probabilities are of the raw logits.
pub fn sample_row(logits: &mut [f32], s: &SampleSpec) -> RowOutput {
    let raw = s.logprobs.map(|n| (logits.to_vec(), n));
    let p = &s.sampling.params;
    apply_repeat_penalty(logits, s.history, p.repeat_penalty, p.repeat_last_n);
    let output = &s.history[s.prompt_len..];
    let (f, pr) = (s.sampling.frequency_penalty, s.sampling.presence_penalty);
    apply_frequency_presence(logits, output, f, pr);
    // No history for `sample`: the repetition penalty is applied already.
    let token = sample(logits, &[], p, s.draw);
    RowOutput {
        token,
        logprob: raw.map(|(raw, n)| logprobs(&raw, token, n)),
    }
}

/// The log-softmax of `logits` at `token`, and at the `n` most likely tokens (best first, ties
/// to the lower id).
pub fn logprobs(logits: &[f32], token: u32, n: usize) -> (TokenLogprob, Vec<TokenLogprob>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let ln_sum = sum.ln() as f32;
    let entry = |id: u32, shifted: f32| TokenLogprob {
        id,
        logprob: shifted - ln_sum,
    };
    // `top_k` at temperature 1 gives the `n` best as `logit - max`; `top_k(.., 0)` is all.
    let mut top = if n == 0 {
        Vec::new()
    } else {
        top_k(logits, 1.0, n)
    };
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let chosen = entry(token, logits[token as usize] - max);
    (
        chosen,
        top.into_iter().map(|(id, v)| entry(id, v)).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Sampling;
    use crate::sampling::SamplingParams;

    /// Greedy with the given penalties, on history `[prompt.., output..]`.
    fn pick(history: &[u32], prompt_len: usize, repeat: f32, presence: f32) -> RowOutput {
        let sampling = Sampling {
            params: SamplingParams {
                repeat_penalty: repeat,
                repeat_last_n: usize::MAX,
                ..SamplingParams::greedy()
            },
            frequency_penalty: 0.0,
            presence_penalty: presence,
        };
        let spec = SampleSpec {
            sampling: &sampling,
            draw: 0,
            history,
            prompt_len,
            logprobs: Some(1),
            more: 0,
        };
        sample_row(&mut [3.0, 2.9, 1.0], &spec)
    }

    #[test]
    fn penalties_see_the_prompt_or_the_output_and_logprobs_see_neither() {
        // Presence: the output only. Token 0 in the prompt keeps its 3.0; in the output it
        // drops to 2.5, below token 1.
        assert_eq!(pick(&[0, 2], 1, 1.0, 0.5).token, 0);
        assert_eq!(pick(&[2, 0], 1, 1.0, 0.5).token, 1);
        // Repetition: prompt and output. 3.0 / 2 = 1.5.
        assert_eq!(pick(&[0, 2], 2, 2.0, 0.0).token, 1);
        assert_eq!(pick(&[0, 2], 0, 2.0, 0.0).token, 1);
        assert_eq!(pick(&[2], 1, 2.0, 0.0).token, 0);
        // The log-probabilities are of the raw logits: token 1's, and token 0 as the best.
        let out = pick(&[2, 0], 1, 1.0, 0.5);
        let (chosen, top) = out.logprob.unwrap();
        let raw = logprobs(&[3.0, 2.9, 1.0], 1, 1);
        assert_eq!((chosen.id, top[0].id), (1, 0));
        assert_eq!((&chosen, &top), (&raw.0, &raw.1));
        assert!(
            (chosen.logprob - (2.9 - (3f32.exp() + 2.9f32.exp() + 1f32.exp()).ln())).abs() < 1e-6
        );
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_ties_to_the_lower_id() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let lse = logits.iter().map(|l| f64::from(*l).exp()).sum::<f64>().ln();
        let (chosen, top) = logprobs(&logits, 2, 3);
        assert_eq!(chosen.id, 2);
        assert!((f64::from(chosen.logprob) - (2.0 - lse)).abs() < 1e-6);
        let ids: Vec<u32> = top.iter().map(|t| t.id).collect();
        assert_eq!(ids, [1, 3, 2]);
        for t in &top {
            let want = f64::from(logits[t.id as usize]) - lse;
            assert!((f64::from(t.logprob) - want).abs() < 1e-6, "{t:?}");
        }
        assert!(logprobs(&logits, 0, 0).1.is_empty());
    }
}
