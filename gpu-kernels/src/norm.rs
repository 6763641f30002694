//! RMSNorm. CPU twin: `orcd::cpu::rms_norm`.
use crate::params::RmsNorm;
use crate::util::{block, block_dim, block_sum, thread};

/// `out[r, i] = x[r, i] / sqrt(mean(x[r]^2) + eps) * w[i]` for `n` columns.
/// Grid: one block per row; block: a multiple of 32 threads; shared: 32 f32.
#[inline(always)]
pub(crate) unsafe fn rms_norm(p: RmsNorm) {
    let RmsNorm { out, x, w, n, eps } = p;
    let row = block() as usize * n as usize;
    let (x, out) = unsafe { (x.add(row), out.add(row)) };
    let mut ss = 0.0f32;
    let mut i = thread();
    while i < n {
        let v = unsafe { *x.add(i as usize) };
        ss += v * v;
        i += block_dim();
    }
    let scale = 1.0 / libm_sqrt(block_sum(ss) / n as f32 + eps);
    let mut i = thread();
    while i < n {
        let i_ = i as usize;
        unsafe { *out.add(i_) = *x.add(i_) * scale * *w.add(i_) };
        i += block_dim();
    }
}

/// Correctly rounded square root (`sqrt.rn.f32`), as the CPU's `f32::sqrt`.
#[inline(always)]
fn libm_sqrt(v: f32) -> f32 {
    core::intrinsics::sqrtf32(v)
}
