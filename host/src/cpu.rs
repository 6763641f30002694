//! CPU twins of the GPU kernels: the same names and the same math in plain f32, so that each
//! kernel can be checked against them and the CPU forward pass can be built from them.
use half::f16;
use rayon::prelude::*;

/// RMSNorm of each `w.len()`-long row of `x` into `out`: `x / sqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let n = w.len();
    for (o, x) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        let ss: f32 = x.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / n as f32 + eps).sqrt();
        for ((o, x), w) in o.iter_mut().zip(x).zip(w) {
            *o = x * scale * w;
        }
    }
}

/// Index of the largest value; the first index wins on ties and NaN never wins
/// (`u32::MAX` when every value is NaN).
pub fn argmax(x: &[f32]) -> u32 {
    let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX);
    for (i, &v) in x.iter().enumerate() {
        if v > bv || (v == bv && (i as u32) < bi) {
            (bv, bi) = (v, i as u32);
        }
    }
    bi
}

/// `y[r] = sum_c w[r, c] * x[c]` for an f16 `[y.len(), x.len()]` row-major matrix.
pub fn gemv_f16(y: &mut [f32], w: &[f16], x: &[f32]) {
    let cols = x.len();
    y.par_iter_mut()
        .zip(w.par_chunks_exact(cols))
        .for_each(|(y, row)| {
            *y = row.iter().zip(x).map(|(w, x)| w.to_f32() * x).sum();
        });
}
