//! Launch helpers for token choice: greedy argmax and the full sampler, both leaving the token
//! id on the device.
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use kernel_abi::sampling::{
    ARGMAX_SHARED_BYTES, CANDIDATES_SHARED_WORDS, MAX_K, SAMPLE_SHARED_WORDS,
};

use super::kernels::{Argmax, DevPtr, DevPtrMut, Entry, Sample, SampleCandidates, SampleDev};
use super::{Device, Overlap, check};
use crate::sampling::SamplingParams;
use crate::{Error, Result};

/// Slices of the vocabulary in `sample_candidates`, one block each: about two per SM of an H100
/// (132 SMs), so that all run at once, each over ~600 of Qwen's 151,936 logits. More slices
/// shorten the blocks but lengthen the second kernel's pass over `SLICES * top_k` candidates.
const SLICES: usize = 256;
/// Threads per block of `sample_candidates`: two or three logits of a slice each.
const CANDIDATES_THREADS: u32 = 256;
/// Shared memory a block may have without opting in to more.
const MAX_SHARED_BYTES: usize = 48 * 1024;

impl Device {
    /// The largest `top_k` that `sample` handles: its candidates are sorted in shared memory.
    pub const MAX_TOP_K: usize = MAX_K as usize;
    /// The slices of the vocabulary whose top k `sample_candidates` keeps.
    pub const SAMPLE_SLICES: usize = SLICES;

    /// `out[0] = argmax(x)`. Twin: `cpu::argmax`.
    pub fn argmax(&self, out: &mut impl DevicePtrMut<u32>, x: &impl DevicePtr<f32>) -> Result<()> {
        check(
            out.len() >= 1 && x.len() <= u32::MAX as usize,
            "argmax: shapes",
        )?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: ARGMAX_SHARED_BYTES,
        };
        let n = x.len() as u32;
        let (out, _o) = DevPtrMut::of(out, self.stream());
        let (x, _x) = DevPtr::of(x, self.stream());
        let p = Argmax { out, x, n };
        // SAFETY: reads n floats, writes one u32.
        unsafe { p.launch(self, Argmax::argmax, cfg, Overlap::Serial) }
    }

    /// Whether `sample` handles these params on the GPU: greedy (temperature 0), or top-k
    /// on with `1 <= top_k <= MAX_TOP_K`. Otherwise sample on the CPU.
    pub fn can_sample(p: &SamplingParams) -> bool {
        p.temperature == 0.0 || (1..=Self::MAX_TOP_K).contains(&p.top_k)
    }

    /// The scratch of `sample` and `sample_dev` for up to `vocab` logits: every slice's
    /// candidates, `2 * SLICES * min(MAX_TOP_K, slice)` u32 (the values' bits, then the ids).
    /// Allocate it once: the samplers allocate nothing, so that they can be captured in a graph.
    pub fn sample_scratch(&self, vocab: usize) -> Result<CudaSlice<u32>> {
        let (_, cap) = slicing(vocab, Self::MAX_TOP_K);
        self.zeros(2 * SLICES * cap)
    }

    /// Picks the next token into `out[0]` as `sampling::sample` does (its twin) for the same
    /// logits, recent tokens, params and step, but for last-bit differences at a boundary.
    /// `logits` `[vocab]` get the repetition penalty in place. The tokens so far are
    /// `recent[..n_recent]` (the buffer may be longer); the penalty looks at the last
    /// `min(n_recent, repeat_last_n)` of them. `step` is the draw index of `uniform(seed, step)`.
    /// `scratch` from `sample_scratch` for at least `logits.len()`, used by one launch at a
    /// time. Two launches (`sample_candidates`, `sample`), nothing allocated; `p` should have
    /// passed `validate`.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        out: &mut impl DevicePtrMut<u32>,
        logits: &mut impl DevicePtrMut<f32>,
        recent: &impl DevicePtr<u32>,
        n_recent: usize,
        p: &SamplingParams,
        step: u64,
        scratch: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        check_can_sample(p)?;
        check(
            out.len() >= 1
                && logits.len() <= u32::MAX as usize
                && n_recent <= recent.len()
                && n_recent <= u32::MAX as usize,
            "sample: shapes",
        )?;
        let (r, _r) = DevPtr::of(recent, self.stream());
        let c = self.sample_candidates(logits, scratch, r, n_recent as u32, DevPtr::null(), p)?;
        let cfg = self.sample_launch(Sample::sample)?;
        let (out, _o) = DevPtrMut::of(out, self.stream());
        let s = Sample {
            out,
            cand_v: c.values,
            cand_i: c.ids,
            slots: c.slots,
            k: c.k,
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            seed: p.seed,
            step,
        };
        // SAFETY: it reads the `slots` candidates `sample_candidates` wrote to the scratch and
        // writes out[0]; shared memory as documented.
        unsafe { s.launch(self, Sample::sample, cfg, Overlap::Serial) }
    }

    /// `sample` for a decode step whose position and draw live in device memory, so that a
    /// captured CUDA graph replays it: the tokens so far are `tokens[..=pos[0]]` and the draw
    /// is `uniform(seed, step[0])`. The token goes to `out[0]` and to `tokens[pos[0] + 1]`
    /// (the next step's input, if the buffer holds it), then `pos[0]` and `step[0]` advance by
    /// one. Picks the token `sample(out, logits, tokens, pos[0] + 1, p, step[0], scratch)`
    /// would. `pos[0] >= tokens.len()` makes the kernels trap (an error at the next
    /// synchronisation).
    #[allow(clippy::too_many_arguments)]
    pub fn sample_dev(
        &self,
        out: &mut impl DevicePtrMut<u32>,
        logits: &mut impl DevicePtrMut<f32>,
        tokens: &mut impl DevicePtrMut<u32>,
        pos: &mut impl DevicePtrMut<u32>,
        step: &mut impl DevicePtrMut<u64>,
        p: &SamplingParams,
        scratch: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        check_can_sample(p)?;
        check(
            out.len() >= 1
                && pos.len() >= 1
                && step.len() >= 1
                && tokens.len() >= 1
                && logits.len() <= u32::MAX as usize
                && tokens.len() <= u32::MAX as usize,
            "sample_dev: shapes",
        )?;
        let n_tokens = tokens.len() as u32;
        let stream = self.stream();
        let (tokens, _t) = DevPtrMut::of(tokens, stream);
        let (pos, _p) = DevPtrMut::of(pos, stream);
        let c = self.sample_candidates(
            logits,
            scratch,
            tokens.as_const(),
            n_tokens,
            pos.as_const(),
            p,
        )?;
        let cfg = self.sample_launch(SampleDev::sample_dev)?;
        let (out, _o) = DevPtrMut::of(out, stream);
        let (step, _s) = DevPtrMut::of(step, stream);
        let s = SampleDev {
            out,
            cand_v: c.values,
            cand_i: c.ids,
            slots: c.slots,
            k: c.k,
            tokens,
            n_tokens,
            pos,
            step,
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            seed: p.seed,
        };
        // SAFETY: it reads the `slots` candidates `sample_candidates` wrote to the scratch,
        // pos[0] (below n_tokens or it traps) and step[0], writes tokens[pos[0] + 1] only
        // below n_tokens, out[0], pos[0] and step[0]; shared memory as documented.
        unsafe { s.launch(self, SampleDev::sample_dev, cfg, Overlap::Serial) }
    }

    /// Launches `sample_candidates`: the penalty on `logits` and each slice's top k into
    /// `scratch`, with the tokens so far `tokens[..n_tokens]`, or `tokens[..=pos[0]]` if `pos`
    /// is not null. Returns what `sample` and `sample_dev` take next.
    fn sample_candidates(
        &self,
        logits: &mut impl DevicePtrMut<f32>,
        scratch: &mut impl DevicePtrMut<u32>,
        tokens: DevPtr<u32>,
        n_tokens: u32,
        pos: DevPtr<u32>,
        p: &SamplingParams,
    ) -> Result<Candidates> {
        let n = logits.len();
        let k = top_k_arg(p);
        let (slice, cap) = slicing(n, k as usize);
        let slots = SLICES * cap;
        // The penalty's bitmap of the slice reuses the same words.
        let shared_bytes = 4 * CANDIDATES_SHARED_WORDS.max(slice.div_ceil(32));
        if shared_bytes > MAX_SHARED_BYTES {
            return Err(Error::Invalid(format!(
                "sample on the GPU handles vocabularies up to {} tokens, got {n}",
                MAX_SHARED_BYTES * 8 * SLICES
            )));
        }
        if 2 * slots > scratch.len() {
            return Err(Error::Invalid(format!(
                "sample: the scratch holds {} candidates, these logits and top_k need {slots} \
                 (allocate it with sample_scratch for {n} logits)",
                scratch.len() / 2
            )));
        }
        let entry = SampleCandidates::sample_candidates;
        let cfg = LaunchConfig {
            grid_dim: (SLICES as u32, 1, 1),
            block_dim: (
                threads(self.function(entry), CANDIDATES_THREADS, entry.name())?,
                1,
                1,
            ),
            shared_mem_bytes: shared_bytes as u32,
        };
        let stream = self.stream();
        let (logits, _l) = DevPtrMut::of(logits, stream);
        // The values' bits, then the ids.
        let (values, _v) = DevPtrMut::of(scratch, stream);
        let ids = values.add(slots);
        let c = SampleCandidates {
            cand_v: values.cast(),
            cand_i: ids,
            cap: cap as u32,
            logits,
            n: n as u32,
            slice: slice as u32,
            tokens,
            n_tokens,
            pos,
            last_n: p.repeat_last_n.min(u32::MAX as usize) as u32,
            penalty: p.repeat_penalty,
            k,
        };
        // SAFETY: block b reads and writes logits [b * slice, (b + 1) * slice) below n (SLICES
        // * slice >= n), writes values and ids [b * cap, (b + 1) * cap) of the scratch's 2 *
        // SLICES * cap (checked above), reads pos[0] if pos is not null and then the tokens
        // before n_tokens (or traps); the caller checked the tokens' bounds; shared memory as
        // documented.
        unsafe { c.launch(self, entry, cfg, Overlap::Serial) }?;
        Ok(Candidates {
            values: c.cand_v.as_const(),
            ids: c.cand_i.as_const(),
            slots: slots as u32,
            k,
        })
    }

    /// The launch shape of the one-block sampling kernel `entry`: a power of two up to 1024
    /// threads, with the candidates in shared memory.
    fn sample_launch<K>(&self, entry: Entry<K>) -> Result<LaunchConfig> {
        Ok(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (threads(self.function(entry), 1024, entry.name())?, 1, 1),
            shared_mem_bytes: 4 * SAMPLE_SHARED_WORDS as u32,
        })
    }
}

/// What `sample_candidates` leaves for `sample` and `sample_dev`: the candidates' values and
/// ids in the scratch, their number and k.
struct Candidates {
    values: DevPtr<f32>,
    ids: DevPtr<u32>,
    slots: u32,
    k: u32,
}

/// `(slice, cap)` of the samplers for `n` logits and top-k `k`: each of the `SLICES` blocks
/// of `sample_candidates` takes `slice` logits (the last ones fewer, or none) and keeps
/// `cap` candidates, which is k unless the slice is smaller.
fn slicing(n: usize, k: usize) -> (usize, usize) {
    let slice = n.div_ceil(SLICES).max(1);
    (slice, k.min(slice))
}

/// Threads per block for the sampling kernel `f` (`name`): a power of two up to `most`, fewer
/// if its registers allow fewer, and at least 64.
fn threads(f: &CudaFunction, most: u32, name: &str) -> Result<u32> {
    let most = (f.max_threads_per_block()? as u32).min(most);
    if most < 64 {
        return Err(Error::Cuda(format!(
            "the {name} kernel runs at most {most} threads per block, it needs 64"
        )));
    }
    Ok(1 << most.ilog2())
}

/// An error unless `Device::can_sample(p)`.
fn check_can_sample(p: &SamplingParams) -> Result<()> {
    if Device::can_sample(p) {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "sample on the GPU needs temperature 0 or top_k in 1..={}, got temperature {} and top_k {}",
        Device::MAX_TOP_K,
        p.temperature,
        p.top_k
    )))
}

/// The kernels' `k`: `top_k`, or 1 when greedy (where `p.top_k` may be anything): the best
/// logit is the one candidate, drawn with probability 1.
fn top_k_arg(p: &SamplingParams) -> u32 {
    if p.temperature == 0.0 {
        1
    } else {
        p.top_k.min(Device::MAX_TOP_K) as u32
    }
}
