//! CPU twins of the GPU kernels: the same names and the same math in plain f32. They are the
//! building blocks of the CPU reference forward pass (`cpu::model`) and the oracle every GPU
//! kernel is tested against.
use half::f16;
use rayon::prelude::*;

pub mod model;

/// RMSNorm of each `w.len()`-long row of `x` into `out`: `x / sqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let n = w.len();
    for (o, x) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        let scale = rms_scale(x, eps);
        for ((o, x), w) in o.iter_mut().zip(x).zip(w) {
            *o = x * scale * w;
        }
    }
}

/// RMSNorm's scale of the row `x`: `1 / sqrt(mean(x^2) + eps)`.
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// Twin of the decode GEMVs' vector as two int8 digits an element (gpu-kernels'
/// `quant::digits4`: FFN gate/up's `x ∘ norm`, FFN down's input, greedy's first pass): rounds
/// each chunk of 32 of `x` in place to `unit·(256h + l)`, as the GPU multiplies it, and returns
/// each chunk's `unit`. With `e` the biased exponent of the chunk's largest magnitude (at
/// least 14), `t = x·2^(132 - e)`, `h` is `t` rounded to nearest (even), `l` is `256·(t - h)`
/// so rounded and cut to 127, and `unit = 2^(e - 140)`: each element moves by at most `unit`,
/// 2^-13 of the chunk's largest. A chunk with an infinity or NaN becomes NaN.
pub fn digits(x: &mut [f32]) -> Vec<f32> {
    // Adding 1.5·2^23 rounds to an integer (below 2^22 in magnitude), as the GPU does.
    const ROUND: f32 = 12_582_912.0;
    x.chunks_mut(32)
        .map(|c| {
            let top = c
                .iter()
                .map(|v| v.to_bits() & 0x7fff_ffff)
                .max()
                .unwrap_or(0);
            let e = (top >> 23).max(14);
            if e == 255 {
                c.fill(f32::NAN);
                return f32::NAN;
            }
            let (p2, unit) = (
                f32::from_bits((259 - e) << 23),
                f32::from_bits((e - 13) << 23),
            );
            for v in c {
                let t = *v * p2;
                let h = (t + ROUND) - ROUND;
                let l = ((t - h) * 256.0 + ROUND).min(ROUND + 127.0) - ROUND;
                *v = (256.0 * h + l) * unit;
            }
            unit
        })
        .collect()
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

/// Twin of the greedy arg-max's first pass over a q8_0 matrix (`logit_bounds_q8_0`): for
/// each row of `w` (the file's blocks, rows of `xg.len()`), `(e, r)` such that its logit
/// `s·w[r]·xg` (`xg = x ∘ norm`, `s` the norm's scale) lies within `e ± r`. As the GPU, `e` takes
/// `xg` as [`digits`] and the low nibble of each quant `q + 128` as 7.5, the middle of 0..=15;
/// `r = 7.5·s·Σ|d|·(Σ|xg| + 515·unit)` over the row's blocks (515 units cover the digits: each
/// element within a unit moves `Σ(16t - 120.5)·x` by at most 120.5 of them). In f64.
pub fn logit_bounds_q8_0(w: &[u8], xg: &[f32], s: f32) -> Vec<(f64, f64)> {
    let row_bytes = xg.len() / 32 * 34;
    let mut xd = xg.to_vec();
    let units = digits(&mut xd);
    let s = f64::from(s);
    w.par_chunks(row_bytes)
        .map(|row| {
            let (mut e, mut m) = (0.0, 0.0);
            for (((b, x), xd), unit) in row
                .chunks(34)
                .zip(xg.chunks(32))
                .zip(xd.chunks(32))
                .zip(&units)
            {
                let d = f64::from(f16::from_le_bytes([b[0], b[1]]).to_f32());
                let (mut t, mut a) = (0.0, 0.0);
                for ((q, x), xd) in b[2..].iter().zip(x).zip(xd) {
                    let top = f64::from((q ^ 0x80) >> 4);
                    t += (16.0 * top + 7.5 - 128.0) * f64::from(*xd);
                    a += f64::from(x.abs());
                }
                e += d * t;
                m += d.abs() * (a + 515.0 * f64::from(*unit));
            }
            (s * e, s * 7.5 * m)
        })
        .collect()
}

/// Twin of the greedy arg-max's first pass over an f16 matrix (`logit_bounds_f16`): for each
/// row of `w` (rows of `xn.len()`), `(e, r)` such that its logit `w[r]·xn` lies within `e ± r`,
/// from the high byte `t` of each weight alone (sign, exponent, 2 mantissa bits; the weight lies
/// in `[t, t + 2^(E-17))` by magnitude, E its exponent or 1 for subnormals): `e = Σ 1.125·t·xn`
/// and `r = Σ (0.125·|t| + 2^-16)·|xn|`. In f64.
pub fn logit_bounds_f16(w: &[f16], xn: &[f32]) -> Vec<(f64, f64)> {
    w.par_chunks(xn.len())
        .map(|row| {
            let (mut e, mut r) = (0.0, 0.0);
            for (w, x) in row.iter().zip(xn) {
                let t = f64::from(f16::from_bits(w.to_bits() & 0xff00).to_f32());
                let x = f64::from(*x);
                e += 1.125 * t * x;
                r += (0.125 * t.abs() + 1.0 / 65536.0) * x.abs();
            }
            (e, r)
        })
        .collect()
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

/// Dot product with eight independent sums, so that the compiler vectorises it.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += a[i] * b[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out[t, o] = sum_i x[t, i] * w[o, i] (+ bias[o])` for the rows of `x` of length `n_in`:
/// every token times every row of the `[n_out, n_in]` weight. Parallel over weight rows, so
/// each row is read once for all tokens.
pub fn matmul(out: &mut [f32], x: &[f32], w: &[f32], n_in: usize, bias: Option<&[f32]>) {
    let n_tok = x.len() / n_in;
    let n_out = w.len() / n_in;
    assert_eq!(out.len(), n_tok * n_out, "matmul: shapes");
    let cols: Vec<f32> = w
        .par_chunks_exact(n_in)
        .with_min_len(16)
        .enumerate()
        .flat_map_iter(|(o, row)| {
            let b = bias.map_or(0.0, |b| b[o]);
            x.chunks_exact(n_in).map(move |xt| dot(row, xt) + b)
        })
        .collect();
    for (o, col) in cols.chunks_exact(n_tok).enumerate() {
        for (t, v) in col.iter().enumerate() {
            out[t * n_out + o] = *v;
        }
    }
}

/// NeoX-style rotary embedding in place. `x` holds rows of `row_len` (heads of `head_dim`);
/// row `t` is at position `pos + t`. Each head's element `i` rotates with element
/// `i + head_dim/2` by `position * theta^(-2i/head_dim)`, in f32 as Hugging Face's Qwen2 does.
pub fn rope_neox(x: &mut [f32], row_len: usize, pos: usize, head_dim: usize, theta: f32) {
    let half = head_dim / 2;
    let inv_freq = rope_inv_freq(head_dim, theta);
    for (t, row) in x.chunks_exact_mut(row_len).enumerate() {
        let p = (pos + t) as f32;
        for head in row.chunks_exact_mut(head_dim) {
            let (lo, hi) = head.split_at_mut(half);
            for ((a, b), f) in lo.iter_mut().zip(hi).zip(&inv_freq) {
                let (sin, cos) = (p * f).sin_cos();
                (*a, *b) = (*a * cos - *b * sin, *a * sin + *b * cos);
            }
        }
    }
}

/// Causal grouped-query attention for `n_tok` query rows at positions `pos..pos + n_tok`.
/// `q` is `[n_tok, n_heads * head_dim]`; `k_cache`/`v_cache` hold `[pos + n_tok, n_kv * head_dim]`
/// (this call's keys already appended). Query head `h` reads kv head `h / (n_heads / n_kv)`.
/// Softmax subtracts the row maximum for stability.
#[allow(clippy::too_many_arguments)] // the shapes, as the GPU kernel takes them
pub fn attention(
    out: &mut [f32],
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    pos: usize,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
) {
    let shape = (n_heads, n_kv, head_dim);
    attend(out, q, (k_cache, v_cache), |j| j, pos, shape);
}

/// `attention` over a paged KV cache: key and value `j` of the sequence are row `j %
/// block_tokens` of block `blocks[j / block_tokens]` of `k_cache`/`v_cache`
/// (`[blocks, block_tokens, n_kv * head_dim]`), so many sequences share one cache and none needs
/// its positions side by side. The same math as `attention`, key for key.
#[allow(clippy::too_many_arguments)] // the shapes, as the GPU kernel takes them
pub fn paged_attention(
    out: &mut [f32],
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    blocks: &[u32],
    block_tokens: usize,
    pos: usize,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
) {
    let row = |j: usize| blocks[j / block_tokens] as usize * block_tokens + j % block_tokens;
    attend(
        out,
        q,
        (k_cache, v_cache),
        row,
        pos,
        (n_heads, n_kv, head_dim),
    );
}

/// The body of `attention` and `paged_attention`: key `j` of the sequence is row `row(j)` of
/// the caches.
fn attend(
    out: &mut [f32],
    q: &[f32],
    (k_cache, v_cache): (&[f32], &[f32]),
    row: impl Fn(usize) -> usize + Sync,
    pos: usize,
    (n_heads, n_kv, head_dim): (usize, usize, usize),
) {
    let (q_dim, kv_dim) = (n_heads * head_dim, n_kv * head_dim);
    let group = n_heads / n_kv;
    let scale = 1.0 / (head_dim as f32).sqrt();
    out.par_chunks_exact_mut(head_dim)
        .enumerate()
        .for_each(|(i, out)| {
            let (t, h) = (i / n_heads, i % n_heads);
            let q = &q[t * q_dim + h * head_dim..][..head_dim];
            let kv_off = (h / group) * head_dim;
            let n_keys = pos + t + 1;
            let mut scores: Vec<f32> = (0..n_keys)
                .map(|j| dot(q, &k_cache[row(j) * kv_dim + kv_off..][..head_dim]) * scale)
                .collect();
            softmax(&mut scores);
            out.fill(0.0);
            for (j, s) in scores.iter().enumerate() {
                let v = &v_cache[row(j) * kv_dim + kv_off..][..head_dim];
                for (o, v) in out.iter_mut().zip(v) {
                    *o += s * v;
                }
            }
        });
}

/// In-place softmax, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`, SwiGLU's elementwise step.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x += y`, the residual connection.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (x, y) in x.iter_mut().zip(y) {
        *x += y;
    }
}

/// The angles of `rope_neox` as a table for positions `0..max_pos`: `[max_pos, head_dim/2, 2]`
/// of (cos, sin), each computed exactly as `rope_neox` computes it, so that a rotation read from
/// the table (the GPU's way: nvptx has no accurate sin/cos) matches `rope_neox` bit for bit.
pub fn rope_table(max_pos: usize, head_dim: usize, theta: f32) -> Vec<f32> {
    let inv_freq = rope_inv_freq(head_dim, theta);
    let mut table = Vec::with_capacity(max_pos * head_dim);
    for p in 0..max_pos {
        for f in &inv_freq {
            let (sin, cos) = (p as f32 * f).sin_cos();
            table.extend([cos, sin]);
        }
    }
    table
}

/// RoPE's frequency of each pair of a head: `theta^(-2i/head_dim)`, in f32 as Hugging Face does.
fn rope_inv_freq(head_dim: usize, theta: f32) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream of pseudo-random u32 from `seed` (a 64-bit LCG's high bits).
    fn lcg(mut s: u64) -> impl FnMut() -> u32 {
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        }
    }

    /// `digits` moves each element by at most its chunk's unit, `2^(e - 140)` for the exponent
    /// `e` of the chunk's largest magnitude (at least 14), onto a whole number of units that
    /// two int8 digits hold; whole numbers of units below 64·256 of them stay; a chunk with a
    /// NaN or an infinity becomes NaN.
    #[test]
    fn digits_round_within_a_unit() {
        let mut next = lcg(11);
        // Chunks of random values of one magnitude each, from subnormal to 2^127.
        for scale in [-149, -130, -115, -20, 0, 3, 60, 120, 127] {
            let mut x: Vec<f32> = (0..64)
                .map(|_| (next() as f32 / u32::MAX as f32 - 0.5) * 2f32.powi(scale))
                .collect();
            let orig = x.clone();
            let units = digits(&mut x);
            for (c, unit) in units.iter().enumerate() {
                let chunk = &orig[32 * c..32 * c + 32];
                let top = chunk
                    .iter()
                    .map(|v| v.to_bits() & 0x7fff_ffff)
                    .max()
                    .unwrap();
                let e = (top >> 23).max(14);
                assert_eq!(*unit, f32::from_bits((e - 13) << 23), "unit at 2^{scale}");
                for (v, d) in chunk.iter().zip(&x[32 * c..32 * c + 32]) {
                    assert!((v - d).abs() <= *unit, "{v} -> {d}, unit {unit}");
                    let n = d / unit;
                    assert!(n == n.round() && n.abs() <= 16512.0, "{d} is {n} units");
                }
            }
        }
        // Whole numbers of units stay; the unit of a chunk whose largest is 1.5 is 2^-13.
        let mut x: Vec<f32> = (0..32)
            .map(|i| (i as f32 * 511.0 - 8000.0) / 8192.0)
            .collect();
        x[0] = 1.5;
        let orig = x.clone();
        assert_eq!(digits(&mut x), [2f32.powi(-13)]);
        assert_eq!(x, orig);
        // NaN and infinity.
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = vec![1.0f32; 64];
            x[40] = bad;
            let units = digits(&mut x);
            assert!(units[1].is_nan() && x[32..].iter().all(|v| v.is_nan()));
            assert!(x[..32].iter().all(|v| *v == 1.0));
        }
    }

    /// `paged_attention` over keys scattered into blocks in any order gives `attention`'s
    /// output over the same keys side by side, bit for bit, for a decode row and a chunk.
    #[test]
    fn paged_attention_is_attention_through_a_block_table() {
        let (n_heads, n_kv, head_dim, bt) = (4, 2, 8, 4);
        let kv_dim = n_kv * head_dim;
        let mut next = lcg(5);
        let mut rand = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
                .collect()
        };
        // 11 positions in blocks 5, 0, 3 of a pool of 6 (the rest of the pool is noise).
        let (n, table) = (11, [5u32, 0, 3]);
        let (k, v) = (rand(n * kv_dim), rand(n * kv_dim));
        let (mut kp, mut vp) = (rand(6 * bt * kv_dim), rand(6 * bt * kv_dim));
        for p in 0..n {
            let at = (table[p / bt] as usize * bt + p % bt) * kv_dim;
            kp[at..at + kv_dim].copy_from_slice(&k[p * kv_dim..][..kv_dim]);
            vp[at..at + kv_dim].copy_from_slice(&v[p * kv_dim..][..kv_dim]);
        }
        for n_tok in [1, 4] {
            let pos = n - n_tok;
            let q = rand(n_tok * n_heads * head_dim);
            let mut want = vec![0.0; q.len()];
            attention(&mut want, &q, &k, &v, pos, n_heads, n_kv, head_dim);
            let mut got = vec![0.0; q.len()];
            paged_attention(
                &mut got, &q, &kp, &vp, &table, bt, pos, n_heads, n_kv, head_dim,
            );
            assert_eq!(got, want, "{n_tok} rows");
        }
    }

    /// `logit_bounds_q8_0` holds each row's logit within `e ± r`, reached (up to the digits'
    /// share of `r`) when every low nibble is 0 and `d·x` has one sign.
    #[test]
    fn logit_bounds_hold_the_logits() {
        let (rows, n_in) = (64, 96);
        let mut next = lcg(7);
        let mut w: Vec<u8> = (0..rows * n_in / 32 * 34).map(|_| next() as u8).collect();
        for b in w.chunks_mut(34) {
            b[..2]
                .copy_from_slice(&f16::from_f32((next() % 1000) as f32 / 1e4 - 0.05).to_le_bytes());
        }
        // Row 0: low nibbles all 0 (of q + 128), scales positive.
        for b in w[..n_in / 32 * 34].chunks_mut(34) {
            b[1] &= 0x7f;
            for q in &mut b[2..] {
                *q = ((*q ^ 0x80) & !15) ^ 0x80;
            }
        }
        let x: Vec<f32> = (0..n_in).map(|_| (next() % 2000) as f32 / 1000.0).collect();
        let mut dq = vec![0.0; rows * n_in];
        crate::quant::dequantize(crate::quant::GgmlType::Q8_0, &w, &mut dq).unwrap();
        let exact = |w: &[f32]| -> f64 {
            w.iter()
                .zip(&x)
                .map(|(w, x)| f64::from(*w) * f64::from(*x))
                .sum()
        };
        let x_abs: Vec<f64> = x
            .chunks(32)
            .map(|c| c.iter().map(|v| f64::from(v.abs())).sum())
            .collect();
        for (r, (e, b)) in logit_bounds_q8_0(&w, &x, 1.0).into_iter().enumerate() {
            let off = (exact(&dq[r * n_in..(r + 1) * n_in]) - e).abs();
            assert!(
                off <= b * (1.0 + 1e-9),
                "q8_0 row {r}: off by {off}, bound {b}"
            );
            if r == 0 {
                // The bound without the digits' share, which the digits move `e` within.
                let row = &w[..n_in / 32 * 34];
                let plain: f64 = row
                    .chunks(34)
                    .zip(&x_abs)
                    .map(|(b, a)| 7.5 * f64::from(f16::from_le_bytes([b[0], b[1]]).to_f32()) * a)
                    .sum();
                assert!(
                    (off - plain).abs() <= b - plain,
                    "row 0 reaches the bound: off by {off}, {plain} without the digits, {b} with"
                );
            }
        }
        // f16: the same weights, and f16 ones of every exponent, subnormals included.
        let mut h: Vec<f16> = dq.iter().map(|v| f16::from_f32(*v)).collect();
        for (i, v) in h.iter_mut().enumerate().take(n_in) {
            *v = f16::from_bits((next() as u16) & 0x7bff | (i as u16 & 1) << 15);
        }
        let w16: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        for (r, (e, b)) in logit_bounds_f16(&h, &x).into_iter().enumerate() {
            let off = (exact(&w16[r * n_in..(r + 1) * n_in]) - e).abs();
            assert!(
                off <= b * (1.0 + 1e-9),
                "f16 row {r}: off by {off}, bound {b}"
            );
        }
    }
}
