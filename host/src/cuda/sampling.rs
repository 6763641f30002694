//! Launch helpers for token choice: greedy argmax and the full sampler, both leaving the token
//! id on the device.
use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{Device, check};
use crate::sampling::SamplingParams;
use crate::{Error, Result};

/// The `sample` kernel's shared memory in 4-byte words, apart from the penalty's bitmap
/// (see the layout in gpu-kernels/src/sampling.rs).
const SAMPLE_SHARED_WORDS: usize = 4224;
/// Shared memory a block may have without opting in to more.
const MAX_SHARED_BYTES: usize = 48 * 1024;

impl Device {
    /// The largest `top_k` that `sample` handles: its candidates are sorted in shared memory.
    pub const MAX_TOP_K: usize = 1024;

    /// `out[0] = argmax(x)`. Twin: `cpu::argmax`.
    pub fn argmax(&self, out: &mut impl DevicePtrMut<u32>, x: &impl DevicePtr<f32>) -> Result<()> {
        check(
            out.len() >= 1 && x.len() <= u32::MAX as usize,
            "argmax: shapes",
        )?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 64 * 4,
        };
        let n = x.len() as u32;
        let (o, _o) = out.device_ptr_mut(self.stream());
        let (x, _x) = x.device_ptr(self.stream());
        let mut l = self.stream().launch_builder(self.kernel("argmax"));
        l.arg(&o).arg(&x).arg(&n);
        // SAFETY: parameters (u32*, const f32*, u32); reads n floats, writes one u32.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// Whether `sample` handles these params on the GPU: greedy (temperature 0), or top-k
    /// on with `1 <= top_k <= MAX_TOP_K`. Otherwise sample on the CPU.
    pub fn can_sample(p: &SamplingParams) -> bool {
        p.temperature == 0.0 || (1..=Self::MAX_TOP_K).contains(&p.top_k)
    }

    /// Picks the next token into `out[0]` as `sampling::sample` does (its twin) for the same
    /// logits, recent tokens, params and step, but for last-bit differences at a boundary.
    /// `logits` `[vocab]` get the repetition penalty in place. The tokens so far are
    /// `recent[..n_recent]` (the buffer may be longer); the penalty looks at the last
    /// `min(n_recent, repeat_last_n)` of them. `step` is the draw index of `uniform(seed, step)`.
    /// One launch of one block, nothing allocated; `p` should have passed `validate`.
    pub fn sample(
        &self,
        out: &mut impl DevicePtrMut<u32>,
        logits: &mut impl DevicePtrMut<f32>,
        recent: &impl DevicePtr<u32>,
        n_recent: usize,
        p: &SamplingParams,
        step: u64,
    ) -> Result<()> {
        check_can_sample(p)?;
        let n = logits.len();
        check(
            out.len() >= 1 && n <= u32::MAX as usize && n_recent <= recent.len(),
            "sample: shapes",
        )?;
        let (f, cfg) = self.sample_launch("sample", n)?;
        let window = n_recent.min(p.repeat_last_n);
        let (o, _o) = out.device_ptr_mut(self.stream());
        let (lp, _l) = logits.device_ptr_mut(self.stream());
        let (r, _r) = recent.device_ptr(self.stream());
        let r = r + 4 * (n_recent - window) as u64;
        let (n, window, top_k) = (n as u32, window as u32, top_k_arg(p));
        let mut l = self.stream().launch_builder(f);
        l.arg(&o).arg(&lp).arg(&n).arg(&r).arg(&window);
        l.arg(&p.repeat_penalty).arg(&p.temperature).arg(&top_k);
        l.arg(&p.top_p).arg(&p.min_p).arg(&p.seed).arg(&step);
        // SAFETY: parameters (u32*, f32*, u32, const u32*, u32, f32, f32, u32, f32, f32, u64,
        // u64); it reads and writes n logits, reads `window` tokens that end at
        // recent[n_recent] (checked in bounds), writes out[0]; shared memory as documented.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// `sample` for a decode step whose position and draw live in device memory, so that a
    /// captured CUDA graph replays it: the tokens so far are `tokens[..=pos[0]]` and the draw
    /// is `uniform(seed, step[0])`. The token goes to `out[0]` and to `tokens[pos[0] + 1]`
    /// (the next step's input, if the buffer holds it), then `pos[0]` and `step[0]` advance by
    /// one. Picks the token `sample(out, logits, tokens, pos[0] + 1, p, step[0])` would.
    /// `pos[0] >= tokens.len()` makes the kernel trap (an error at the next synchronisation).
    pub fn sample_dev(
        &self,
        out: &mut impl DevicePtrMut<u32>,
        logits: &mut impl DevicePtrMut<f32>,
        tokens: &mut impl DevicePtrMut<u32>,
        pos: &mut impl DevicePtrMut<u32>,
        step: &mut impl DevicePtrMut<u64>,
        p: &SamplingParams,
    ) -> Result<()> {
        check_can_sample(p)?;
        let n = logits.len();
        check(
            out.len() >= 1
                && pos.len() >= 1
                && step.len() >= 1
                && tokens.len() >= 1
                && n <= u32::MAX as usize
                && tokens.len() <= u32::MAX as usize,
            "sample_dev: shapes",
        )?;
        let (f, cfg) = self.sample_launch("sample_dev", n)?;
        let (n, n_tokens, top_k) = (n as u32, tokens.len() as u32, top_k_arg(p));
        let last_n = p.repeat_last_n.min(u32::MAX as usize) as u32;
        let stream = self.stream();
        let (o, _o) = out.device_ptr_mut(stream);
        let (lp, _l) = logits.device_ptr_mut(stream);
        let (tp, _t) = tokens.device_ptr_mut(stream);
        let (pp, _p) = pos.device_ptr_mut(stream);
        let (sp, _s) = step.device_ptr_mut(stream);
        let mut l = stream.launch_builder(f);
        l.arg(&o)
            .arg(&lp)
            .arg(&n)
            .arg(&tp)
            .arg(&n_tokens)
            .arg(&pp)
            .arg(&sp);
        l.arg(&last_n)
            .arg(&p.repeat_penalty)
            .arg(&p.temperature)
            .arg(&top_k);
        l.arg(&p.top_p).arg(&p.min_p).arg(&p.seed);
        // SAFETY: parameters (u32*, f32*, u32, u32*, u32, u32*, u64*, u32, f32, f32, u32, f32,
        // f32, u64); it reads and writes n logits, reads tokens[..=pos[0]] (below n_tokens or
        // it traps), writes tokens[pos[0] + 1] only below n_tokens, out[0], pos[0] and
        // step[0]; shared memory as documented.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// The function and launch shape of the sampling kernel `name` over `n` logits: one block
    /// of a power of two up to 1024 threads, with the candidates and the penalty's bitmap of
    /// `n` bits in shared memory.
    /// Ends a greedy decode step whose token `logits(.., best)` left in `out[0]`: writes it to
    /// `tokens[pos[0] + 1]` and advances `pos` and `step`, as `sample_dev` does. Graph-safe.
    pub fn advance(
        &self,
        out: &mut impl DevicePtrMut<u32>,
        tokens: &mut impl DevicePtrMut<u32>,
        pos: &mut impl DevicePtrMut<u32>,
        step: &mut impl DevicePtrMut<u64>,
    ) -> Result<()> {
        check(
            out.len() >= 1
                && pos.len() >= 1
                && step.len() >= 1
                && tokens.len() <= u32::MAX as usize,
            "advance: shapes",
        )?;
        let n_tokens = tokens.len() as u32;
        let stream = self.stream();
        let (o, _o) = out.device_ptr_mut(stream);
        let (tp, _t) = tokens.device_ptr_mut(stream);
        let (pp, _p) = pos.device_ptr_mut(stream);
        let (sp, _s) = step.device_ptr_mut(stream);
        let mut l = stream.launch_builder(self.kernel("advance"));
        l.arg(&o).arg(&tp).arg(&n_tokens).arg(&pp).arg(&sp);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: parameters (u32*, u32*, u32, u32*, u64*); one element of out, pos and step,
        // and tokens written only below its length, checked above.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    fn sample_launch(&self, name: &str, n: usize) -> Result<(&CudaFunction, LaunchConfig)> {
        let shared_bytes = 4 * SAMPLE_SHARED_WORDS.max(n.div_ceil(32));
        if shared_bytes > MAX_SHARED_BYTES {
            return Err(Error::Invalid(format!(
                "sample on the GPU handles vocabularies up to {} tokens, got {n}",
                MAX_SHARED_BYTES * 8
            )));
        }
        let f = self.kernel(name);
        // A power of two up to 1024 threads, fewer if the kernel's registers allow fewer.
        let most = (f.max_threads_per_block()? as u32).min(1024);
        let threads = if most >= 64 { 1 << most.ilog2() } else { 0 };
        if threads == 0 {
            return Err(Error::Cuda(format!(
                "the {name} kernel runs at most {most} threads per block, it needs 64"
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: shared_bytes as u32,
        };
        Ok((f, cfg))
    }
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

/// The kernels' `top_k` (unused when greedy, where `p.top_k` may be anything).
fn top_k_arg(p: &SamplingParams) -> u32 {
    p.top_k.min(Device::MAX_TOP_K) as u32
}
