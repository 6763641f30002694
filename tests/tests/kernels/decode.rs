//! The fused decode-step kernels (`attn_qkv`, `ffn_gate_up`, `gemv_residual`, `logits` with its
//! arg-max) against the compositions of CPU twins the forward pass runs: `cpu::rms_norm`,
//! `cpu::matmul` on the dequantized weights, `cpu::rope_neox`, `cpu::silu_mul`, `cpu::add` and
//! `cpu::argmax`. Random weights of every type, at the model's sizes and odd ones, then the
//! real model's layers 0 and 11 and its output projection, with the weights in the file's
//! formats and in f16.
//!
//! Tolerance: the kernels dequantize exactly as `quant::dequantize` does, so the GPU and the CPU
//! sum the same f32 products in another order (by FMA), and the norm's scale is applied to the
//! finished products instead of to `x`: a few float roundings of each term. The error of an
//! output is therefore measured against the sum of its terms' magnitudes, `sum|w·xn|` (plus
//! |bias| and what is added to it), and must stay below `TOL`, as in matmul.rs.
use cudarc::driver::{CudaSlice, DevicePtrMut};
use half::f16;
use orcd::cpu;
use orcd::cuda::decode::Argmax;
use orcd::cuda::{BoundedArgmax, Device, GpuMatrix, StepEnd};
use orcd::quant::{self, GgmlType};
use orcd_tests::{Rng, gpu};

/// Error bound relative to the sum of the terms' magnitudes (see the top of the file).
const TOL: f32 = 1e-5;
const EPS: f32 = 1e-6;
const THETA: f32 = 1e6;

/// Every weight type the engine reads.
const TYPES: [GgmlType; 9] = GgmlType::ALL;

fn abs(v: &[f32]) -> Vec<f32> {
    v.iter().map(|v| v.abs()).collect()
}

/// The worst `|got - want| / scale`; NaN (an output never written) counts as infinite.
fn worst(got: &[f32], want: &[f32], scale: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let mut w = 0.0f32;
    for ((g, v), s) in got.iter().zip(want).zip(scale) {
        let e = (g - v).abs() / s.max(1e-30);
        w = if e.is_nan() { f32::INFINITY } else { w.max(e) };
    }
    w
}

/// `n_rows` rows of `n_in` random weights of type `ty`: plain floats in ±4; for the block
/// types random bytes, each block whose values are not all finite (a NaN or infinite f16
/// scale) drawn again, so every quant and scale bit pattern occurs.
fn random_weights(rng: &mut Rng, ty: GgmlType, n_rows: usize, n_in: usize) -> Vec<u8> {
    let n = n_rows * n_in;
    let mut floats = |bytes: fn(f32) -> Vec<u8>| -> Vec<u8> {
        (0..n).flat_map(|_| bytes(rng.next_f32() * 4.0)).collect()
    };
    match ty {
        GgmlType::F32 => floats(|v| v.to_le_bytes().to_vec()),
        GgmlType::F16 => floats(|v| f16::from_f32(v).to_le_bytes().to_vec()),
        // bf16 is the top half of an f32.
        GgmlType::BF16 => floats(|v| ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec()),
        _ => {
            let bytes = ty.row_bytes(n_in).unwrap() * n_rows;
            let mut t: Vec<u8> = (0..bytes)
                .map(|_| (rng.next_f32() * 128.0 + 128.0) as u8)
                .collect();
            let mut vals = vec![0.0; ty.block_elems()];
            for block in t.chunks_exact_mut(ty.block_bytes()) {
                loop {
                    quant::dequantize(ty, block, &mut vals).unwrap();
                    if vals.iter().all(|v| v.is_finite()) {
                        break;
                    }
                    block.fill_with(|| (rng.next_f32() * 128.0 + 128.0) as u8);
                }
            }
            t
        }
    }
}

/// A weight matrix on the GPU, in the file's format or in f16, and its values as the CPU
/// twins take them.
struct Mat {
    data: GpuMatrix,
    w32: Vec<f32>,
    n_in: usize,
    /// Greedy's bounded arg-max and the file's blocks, where it applies (q8_0, f16).
    bounded: Option<(BoundedArgmax, Vec<u8>)>,
}

impl Mat {
    /// The bytes `bytes` of a matrix with rows of `n_in` of type `ty`: uploaded in its format,
    /// or with `as_f16` dequantized to f16 (the `--weights f16` path).
    fn new(dev: &Device, ty: GgmlType, bytes: &[u8], n_in: usize, as_f16: bool) -> Mat {
        let mut w32 = quant::dequantize_to_vec(ty, bytes).unwrap();
        let data = if as_f16 {
            w32.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
            dev.upload_matrix_f16(ty, bytes, n_in).unwrap()
        } else {
            dev.upload_matrix(ty, bytes, n_in).unwrap()
        };
        let bounded = dev.bounded_argmax(&data).unwrap();
        Mat {
            data,
            w32,
            n_in,
            bounded: bounded.map(|b| (b, bytes.to_vec())),
        }
    }

    fn weight(&self) -> &GpuMatrix {
        &self.data
    }

    fn name(&self) -> &'static str {
        self.data.ty().name()
    }

    fn n_out(&self) -> usize {
        self.w32.len() / self.n_in
    }

    /// `w·x + bias` and the error scale `sum|w·x| + |bias|`, by `cpu::matmul`.
    fn cpu(&self, x: &[f32], bias: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
        let n = self.n_out();
        let (mut y, mut mag) = (vec![0.0; n], vec![0.0; n]);
        cpu::matmul(&mut y, x, &self.w32, self.n_in, bias);
        cpu::matmul(&mut mag, &abs(x), &abs(&self.w32), self.n_in, None);
        if let Some(b) = bias {
            for (m, b) in mag.iter_mut().zip(b) {
                *m += b.abs();
            }
        }
        (y, mag)
    }
}

fn rms_norm(x: &[f32], g: &[f32]) -> Vec<f32> {
    let mut xn = vec![0.0; x.len()];
    cpu::rms_norm(&mut xn, x, g, EPS);
    xn
}

/// The vector `v` as a GEMV that takes it in digits (FFN gate/up and down) multiplies `w` by:
/// `cpu::digits` of it for the quantized types, `v` for the float ones.
fn digits_for(w: &Mat, v: &[f32]) -> Vec<f32> {
    let mut v = v.to_vec();
    if w.data.ty().block_elems() > 1 {
        cpu::digits(&mut v);
    }
    v
}

/// `x ∘ g`, the vector a GEMV behind an RMSNorm stages, and the norm's scale.
fn norm_parts(x: &[f32], g: &[f32]) -> (Vec<f32>, f32) {
    let xg = x.iter().zip(g).map(|(x, g)| x * g).collect();
    (xg, cpu::rms_scale(x, EPS))
}

/// An attention block's input side: the norm and the (weights, bias) of q, k and v.
struct Attn {
    norm: Vec<f32>,
    qkv: [(Mat, Option<Vec<f32>>); 3],
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
}

/// `attn_qkv` for the token `x` at `pos` against the CPU: the worst error of q, k and v. The
/// caches have `pos + 3` rows of a sentinel, of which only row `pos` may change. Run twice,
/// with an attention between that fills the sums: the second run must zero them again.
fn check_attn_qkv(dev: &Device, a: &Attn, x: &[f32], pos: usize, what: &str) -> f32 {
    let hd = a.head_dim;
    let (q_dim, kv_dim) = (a.n_heads * hd, a.n_kv * hd);
    let max_pos = pos + 3;
    let sentinel = 7.5f32;
    let mut q = dev.zeros::<f32>(q_dim).unwrap();
    let mut kc = dev.upload(&vec![sentinel; max_pos * kv_dim]).unwrap();
    let mut vc = dev.upload(&vec![sentinel; max_pos * kv_dim]).unwrap();
    let (xd, nd) = (dev.upload(x).unwrap(), dev.upload(&a.norm).unwrap());
    let biases: Vec<Option<CudaSlice<f32>>> = a
        .qkv
        .iter()
        .map(|(_, b)| b.as_ref().map(|b| dev.upload(b).unwrap()))
        .collect();
    let rope = dev.rope_table(max_pos + 5, hd, THETA).unwrap();
    let posd = dev.upload(&[pos as u32]).unwrap();
    let qkv = [0, 1, 2].map(|i| (a.qkv[i].0.weight(), biases[i].as_ref()));
    let mut sums = dev.attention_sums(a.n_heads, hd).unwrap();
    for run in 0..2 {
        dev.attn_qkv(
            &mut q, &mut kc, &mut vc, &xd, &nd, EPS, qkv, &posd, &rope, &mut sums, a.n_heads,
            a.n_kv,
        )
        .unwrap();
        let raw = dev.download(sums.raw()).unwrap();
        assert!(
            raw.iter().all(|s| *s == 0.0),
            "attn_qkv {what}: sums not zeroed"
        );
        if run == 0 {
            // Over keys of ones (the projections' may be infinite: random scales).
            let ones = |n| dev.upload(&vec![1.0f32; n]).unwrap();
            let (q1, c1) = (ones(q_dim), ones(max_pos * kv_dim));
            dev.attention_decode(&mut sums, &q1, &c1, &c1, &posd, a.n_kv)
                .unwrap();
            let raw = dev.download(sums.raw()).unwrap();
            assert!(
                raw.iter().any(|s| *s != 0.0),
                "attn_qkv {what}: no sums to zero"
            );
        }
    }
    let q = dev.download(&q).unwrap();
    let (kc, vc) = (dev.download(&kc).unwrap(), dev.download(&vc).unwrap());
    let row = |c: &[f32]| c[pos * kv_dim..(pos + 1) * kv_dim].to_vec();
    let got = [q, row(&kc), row(&vc)];
    for (r, (k, v)) in kc.chunks(kv_dim).zip(vc.chunks(kv_dim)).enumerate() {
        if r != pos {
            assert!(
                k.iter().chain(v).all(|v| *v == sentinel),
                "attn_qkv {what}: cache row {r} changed (pos {pos})"
            );
        }
    }
    let xn = rms_norm(x, &a.norm);
    let mut err = 0.0f32;
    for (i, ((w, bias), got)) in a.qkv.iter().zip(&got).enumerate() {
        let (mut want, mag) = w.cpu(&xn, bias.as_deref());
        if i < 2 {
            let row_len = want.len();
            cpu::rope_neox(&mut want, row_len, pos, hd, THETA);
        }
        // RoPE mixes rows i and i + head_dim/2 of a head: their scales add.
        let half = hd / 2;
        let scale: Vec<f32> = (0..want.len())
            .map(|r| {
                let a = r / hd * hd + r % half;
                mag[a] + mag[a + half]
            })
            .collect();
        err = err.max(worst(got, &want, &scale));
    }
    err
}

/// `ffn_gate_up` for the token `x` against `cpu::silu_mul` of the two products (of `x ∘ norm`
/// in digits for quantized weights, `digits_for`).
fn check_gate_up(dev: &Device, norm: &[f32], gate: &Mat, up: &Mat, x: &[f32]) -> f32 {
    let n_out = gate.n_out();
    let mut h = dev.zeros::<f32>(n_out).unwrap();
    let (xd, nd) = (dev.upload(x).unwrap(), dev.upload(norm).unwrap());
    dev.ffn_gate_up(&mut h, &xd, &nd, EPS, gate.weight(), up.weight())
        .unwrap();
    let got = dev.download(&h).unwrap();
    // The norm's scale multiplies the products of `x ∘ norm` in digits.
    let (xg, s) = norm_parts(x, norm);
    let xn: Vec<f32> = digits_for(gate, &xg).iter().map(|v| v * s).collect();
    let ((g, mg), (u, mu)) = (gate.cpu(&xn, None), up.cpu(&xn, None));
    let mut want = g.clone();
    cpu::silu_mul(&mut want, &u);
    // silu(g)·u moves by at most 1.1·|u|·dg + (|g| + 0.3)·du (|silu'| <= 1.1, |silu(g)| <=
    // |g| + 0.28); e^-g by ex2.approx adds a relative (|g| + 16)·2^-24 (see silu_mul's test),
    // written here as a share of the scale.
    let scale: Vec<f32> = (0..n_out)
        .map(|r| {
            let s = 1.1 * u[r].abs() * mg[r] + (g[r].abs() + 0.3) * mu[r];
            s + (g[r].abs() + 16.0) * f32::EPSILON * want[r].abs() / TOL
        })
        .collect();
    worst(&got, &want, &scale)
}

/// `gemv_residual` of `v` onto a random residual `x0` against `cpu::add` of the product (of `v`
/// in digits for quantized weights, `digits_for`).
fn check_residual(dev: &Device, rng: &mut Rng, w: &Mat, bias: Option<&[f32]>, v: &[f32]) -> f32 {
    let bd = bias.map(|b| dev.upload(b).unwrap());
    let vd = dev.upload(v).unwrap();
    onto_residual(dev, rng, w, bias, &digits_for(w, v), |xd| {
        dev.gemv_residual(xd, w.weight(), bd.as_ref(), &vd).unwrap()
    })
}

/// `launch` (which adds `w·v + bias` into the residual it is given) on a random residual `x0`,
/// against `cpu::add` of `w.cpu(v, bias)`: the worst error over the scale of the terms.
fn onto_residual(
    dev: &Device,
    rng: &mut Rng,
    w: &Mat,
    bias: Option<&[f32]>,
    v: &[f32],
    launch: impl FnOnce(&mut CudaSlice<f32>),
) -> f32 {
    let x0 = rng.vec(w.n_out());
    let mut xd = dev.upload(&x0).unwrap();
    launch(&mut xd);
    let got = dev.download(&xd).unwrap();
    let (y, mag) = w.cpu(v, bias);
    let mut want = x0.clone();
    cpu::add(&mut want, &y);
    let scale: Vec<f32> = mag.iter().zip(&x0).map(|(m, x)| m + x.abs()).collect();
    worst(&got, &want, &scale)
}

/// `attn_output` onto a random residual `x0` against `cpu::add` of `wo` times the attention's
/// output: that of a random query over 40 random keys of `n_heads` kv heads of `head_dim`
/// (`wo.n_in = n_heads·head_dim`), as `AttentionSums::output` normalises it.
fn check_attn_output(dev: &Device, rng: &mut Rng, wo: &Mat, n_heads: usize) -> f32 {
    let (n_in, keys) = (wo.n_in, 40);
    let q = dev.upload(&rng.vec(n_in)).unwrap();
    let kc = dev.upload(&rng.vec(keys * n_in)).unwrap();
    let vc = dev.upload(&rng.vec(keys * n_in)).unwrap();
    let posd = dev.upload(&[keys as u32 - 1]).unwrap();
    let mut sums = dev.attention_sums(n_heads, n_in / n_heads).unwrap();
    dev.attention_decode(&mut sums, &q, &kc, &vc, &posd, n_heads)
        .unwrap();
    let att = sums.output(dev).unwrap();
    onto_residual(dev, rng, wo, None, &att, |xd| {
        dev.attn_output(xd, wo.weight(), &sums).unwrap()
    })
}

/// `logits` with its arg-max for the token `x`: returns the worst error and checks the
/// arg-max, which must be exactly `cpu::argmax` of the GPU's own logits, and that of the
/// CPU's logits unless the CPU's top two are closer than 1e-3 or than the two logits' error
/// bounds (`TOL·sum|w·xn|` each; random weights make large logits), printed. Runs twice on
/// one scratch, which must come back zero.
fn check_logits(dev: &Device, norm: &[f32], w: &mut Mat, x: &[f32], what: &str) -> f32 {
    let n_out = w.n_out();
    let mut logits = dev.zeros::<f32>(n_out).unwrap();
    let (xd, nd) = (dev.upload(x).unwrap(), dev.upload(norm).unwrap());
    let mut best = dev.upload(&[12345u32]).unwrap();
    let mut scratch = dev.logits_scratch().unwrap();
    let mut picks = vec![];
    for _ in 0..2 {
        dev.logits(
            &mut logits,
            &xd,
            &nd,
            EPS,
            w.weight(),
            Some((&mut best, &mut scratch, None)),
        )
        .unwrap();
        picks.push(dev.download(&best).unwrap()[0]);
        assert_eq!(
            dev.download(&scratch).unwrap(),
            [0, 0],
            "logits {what}: scratch"
        );
    }
    let got = dev.download(&logits).unwrap();
    let xn = rms_norm(x, norm);
    let (want, mag) = w.cpu(&xn, None);
    let gpu_best = cpu::argmax(&got);
    assert_eq!(
        picks, [gpu_best; 2],
        "logits {what}: arg-max of the GPU logits"
    );
    let cpu_best = cpu::argmax(&want) as usize;
    let mut others = want.clone();
    others[cpu_best] = f32::NAN;
    // Every other logit NaN: no second (the check is skipped).
    let second = (cpu::argmax(&others) as usize).min(n_out - 1);
    let margin = want[cpu_best] - want[second];
    let bound = (TOL * (mag[cpu_best] + mag[second])).max(1e-3);
    println!(
        "logits {what}: arg-max {gpu_best}, CPU's {cpu_best}, CPU top-2 margin {margin:.2e} \
         (checked above {bound:.2e})"
    );
    if margin >= bound {
        assert_eq!(gpu_best as usize, cpu_best, "logits {what}: arg-max");
    }
    // Without `best` the logits are the same.
    let mut plain = dev.zeros::<f32>(n_out).unwrap();
    dev.logits(&mut plain, &xd, &nd, EPS, w.weight(), None)
        .unwrap();
    assert_eq!(
        dev.download(&plain).unwrap(),
        got,
        "logits {what}: without arg-max"
    );
    if w.bounded.is_some() {
        check_bounded(dev, norm, w, x, &got, &want, &mag, what);
    }
    worst(&got, &want, &mag)
}

/// `argmax_bounded` on `w` (q8_0 or f16) for the token `x`: it picks `cpu::argmax` of `logits`'
/// own logits `got` (twice, on one scratch, which must come back zero), and its first pass
/// bounds them: every upper bound is at least the GPU's logit and matches its twin,
/// `cpu::logit_bounds_q8_0` or `_f16`, whose `e ± r` holds the CPU's logit `want` (error scale
/// `mag`).
#[allow(clippy::too_many_arguments)]
fn check_bounded(
    dev: &Device,
    norm: &[f32],
    w: &mut Mat,
    x: &[f32],
    got: &[f32],
    want: &[f32],
    mag: &[f32],
    what: &str,
) {
    let (xd, nd) = (dev.upload(x).unwrap(), dev.upload(norm).unwrap());
    let (b, bytes) = w.bounded.as_mut().unwrap();
    let mut best = dev.upload(&[12345u32]).unwrap();
    let mut scratch = dev.logits_scratch().unwrap();
    for _ in 0..2 {
        dev.argmax_bounded(b, &xd, &nd, EPS, &w.data, (&mut best, &mut scratch, None))
            .unwrap();
        let pick = dev.download(&best).unwrap()[0];
        assert_eq!(pick, cpu::argmax(got), "argmax_bounded {what}");
        assert_eq!(
            dev.download(&scratch).unwrap(),
            [0, 0],
            "argmax_bounded {what}: scratch"
        );
    }
    let upper = b.upper_bounds(dev).unwrap();
    let twin = match w.data.ty() {
        GgmlType::F16 => {
            let h: Vec<f16> = w.w32.iter().map(|v| f16::from_f32(*v)).collect();
            cpu::logit_bounds_f16(&h, &rms_norm(x, norm))
        }
        _ => {
            let (xg, s) = norm_parts(x, norm);
            cpu::logit_bounds_q8_0(bytes, &xg, s)
        }
    };
    // The kernels widen the radius by at most 1/32 (q8_0: 7.5 by 1/256; f16: 0.125 by 1/256);
    // their sums round at a few 2^-24 of what the radius is a share of.
    let wider = 1.0 + 1.0 / 32.0;
    // The threshold of the second pass, as the twin puts it.
    let t = twin
        .iter()
        .map(|(e, r)| e - wider * r)
        .fold(f64::NEG_INFINITY, f64::max);
    let (mut candidates, mut widest) = (0, f64::NEG_INFINITY);
    for (i, (&(e, r), &u)) in twin.iter().zip(&upper).enumerate() {
        assert!(
            u >= got[i],
            "argmax_bounded {what}: row {i}: bound {u} < logit {}",
            got[i]
        );
        let (lo, hi) = (e + r - 1e-3 * r, e + wider * r + 1e-3 * r);
        assert!(
            (lo..=hi).contains(&f64::from(u)),
            "argmax_bounded {what}: row {i}: bound {u}, twin's {lo}..{hi}"
        );
        let err = (f64::from(want[i]) - e).abs() - r;
        assert!(
            err <= f64::from(TOL * mag[i]),
            "cpu::logit_bounds {what}: row {i}: logit {} outside {e} ± {r}",
            want[i]
        );
        candidates += usize::from(f64::from(u) >= t);
        widest = widest.max((f64::from(u) - e) / r);
    }
    println!(
        "argmax_bounded {what}: {candidates} rows computed exactly; upper bounds at most \
         e + {widest:.4}·r"
    );
}

/// A token's input: random, in ±3 (RMSNorm rescales it anyway).
fn token(rng: &mut Rng, n: usize) -> Vec<f32> {
    rng.vec(n).iter().map(|v| v * 3.0).collect()
}

/// A random attention block with weights of types `tys`, biases or none.
#[allow(clippy::too_many_arguments)]
fn random_attn(
    dev: &Device,
    rng: &mut Rng,
    tys: [GgmlType; 3],
    n_in: usize,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
    bias: bool,
) -> Attn {
    let rows = [n_heads * head_dim, n_kv * head_dim, n_kv * head_dim];
    let qkv = [0, 1, 2].map(|i| {
        let w = random_weights(rng, tys[i], rows[i], n_in);
        let b = bias.then(|| rng.vec(rows[i]));
        (Mat::new(dev, tys[i], &w, n_in, false), b)
    });
    Attn {
        norm: rng.vec(n_in),
        qkv,
        n_heads,
        n_kv,
        head_dim,
    }
}

#[test]
fn attn_qkv_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(31);
    use GgmlType::*;
    // (types of q, k, v, n_in, heads, kv heads, head_dim): the model's, f16, K-quants
    // (rows of whole 256-blocks), both packed families in one layer (the kernel built for
    // all packed types), a row long enough to split over 4 warps, then every type at an odd
    // shape (head_dim 10: pairs that are no power of two).
    let mut cases = vec![
        ([Q5_0, Q5_0, Q8_0], 896, 14, 2, 64),
        ([F16, F16, F16], 896, 14, 2, 64),
        ([Q4K, Q6K, Q5K], 1024, 8, 2, 64),
        ([Q5_0, Q4K, Q8_0], 1024, 8, 2, 64),
        ([Q8_0, Q5_0, Q4_0], 3584, 4, 1, 128),
    ];
    cases.extend(TYPES.map(|ty| ([ty, ty, ty], 256, 3, 1, 10)));
    for (tys, n_in, n_heads, n_kv, hd) in cases {
        for bias in [true, false] {
            let a = random_attn(&dev, &mut rng, tys, n_in, n_heads, n_kv, hd, bias);
            for pos in [0, 5, 1000] {
                let what = format!(
                    "{:?} {n_in} {n_heads}/{n_kv}x{hd} bias {bias} pos {pos}",
                    tys.map(|t| t.name())
                );
                let err = check_attn_qkv(&dev, &a, &token(&mut rng, n_in), pos, &what);
                println!("attn_qkv {what}: max err / sum|w*xn| = {err:.2e}");
                assert!(err < TOL, "attn_qkv {what}: {err}");
            }
        }
    }
}

#[test]
fn ffn_gate_up_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(32);
    use GgmlType::*;
    // (type, n_in, n_out): the model's, f16, K-quants, a row split over 8 warps, then every
    // type at an odd shape.
    let mut cases = vec![
        (Q5_0, 896, 4864),
        (F16, 896, 4864),
        (Q4K, 1024, 300),
        (Q8_0, 7936, 40),
    ];
    cases.extend(TYPES.map(|ty| (ty, 256, 37)));
    for (ty, n_in, n_out) in cases {
        let [gate, up] = [0, 1].map(|_| {
            let w = random_weights(&mut rng, ty, n_out, n_in);
            Mat::new(&dev, ty, &w, n_in, false)
        });
        let norm = rng.vec(n_in);
        let err = check_gate_up(&dev, &norm, &gate, &up, &token(&mut rng, n_in));
        println!(
            "ffn_gate_up {} {n_out}x{n_in}: max err / scale = {err:.2e}",
            ty.name()
        );
        assert!(err < TOL, "ffn_gate_up {} {n_out}x{n_in}: {err}", ty.name());
    }
}

/// FFN down's vector in digits, read back exactly: through a q8_0 identity (each row one quant
/// 1 of scale 1), `gemv_residual` onto zeros gives `cpu::digits` of its input bit for bit,
/// chunks of every magnitude from 2^-140 to 2^100.
#[test]
fn gemv_residual_takes_digits_as_the_twin() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(36);
    let n = 1024;
    let blocks = n / 32;
    let mut bytes = vec![0u8; n * blocks * 34];
    for (r, row) in bytes.chunks_mut(blocks * 34).enumerate() {
        let b = &mut row[r / 32 * 34..][..34];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2 + r % 32] = 1;
    }
    let w = Mat::new(&dev, GgmlType::Q8_0, &bytes, n, false);
    let v: Vec<f32> = rng
        .vec(n)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi((i / 32) as i32 * 8 - 140))
        .collect();
    let mut y = dev.zeros::<f32>(n).unwrap();
    dev.gemv_residual(&mut y, w.weight(), None, &dev.upload(&v).unwrap())
        .unwrap();
    let got = dev.download(&y).unwrap();
    let mut want = v.clone();
    cpu::digits(&mut want);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "element {i}: {g} vs {w} (of {})",
            v[i]
        );
    }
}

#[test]
fn gemv_residual_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(33);
    use GgmlType::*;
    // (type, n_in, n_out): the model's down projections (q6_K and q4_K), in f16, then every
    // type at odd shapes, one row split over 8 warps.
    let mut cases = vec![(Q6K, 4864, 896), (Q4K, 4864, 896), (F16, 4864, 896)];
    cases.extend(TYPES.map(|ty| (ty, 256, 37)));
    cases.extend(TYPES.map(|ty| (ty, 4608, 9)));
    for (ty, n_in, n_out) in cases {
        let w = Mat::new(
            &dev,
            ty,
            &random_weights(&mut rng, ty, n_out, n_in),
            n_in,
            false,
        );
        for bias in [None, Some(rng.vec(n_out))] {
            let v = rng.vec(n_in);
            let err = check_residual(&dev, &mut rng, &w, bias.as_deref(), &v);
            let what = format!("{} {n_out}x{n_in} bias {}", ty.name(), bias.is_some());
            println!("gemv_residual {what}: max err / scale = {err:.2e}");
            assert!(err < TOL, "gemv_residual {what}: {err}");
        }
    }
}

#[test]
fn attn_output_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(36);
    use GgmlType::*;
    // (type, heads, head_dim, n_out): the model's (q5_0, 14 heads of 64), in f16, K-quants
    // (8 heads of 128), then every type at an odd shape (head_dim 8, 37 rows).
    let mut cases = vec![(Q5_0, 14, 64, 896), (F16, 14, 64, 896), (Q4K, 8, 128, 300)];
    cases.extend(TYPES.map(|ty| (ty, 32, 8, 37)));
    for (ty, n_heads, hd, n_out) in cases {
        let n_in = n_heads * hd;
        let w = random_weights(&mut rng, ty, n_out, n_in);
        let wo = Mat::new(&dev, ty, &w, n_in, false);
        let err = check_attn_output(&dev, &mut rng, &wo, n_heads);
        let what = format!("{} {n_out}x{n_in} ({n_heads} heads of {hd})", ty.name());
        println!("attn_output {what}: max err / scale = {err:.2e}");
        assert!(err < TOL, "attn_output {what}: {err}");
    }
}

#[test]
fn logits_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(34);
    use GgmlType::*;
    // (type, n_in, n_out): the model's vocabulary projection (q8_0, and f16), then every type
    // at an odd shape.
    let mut cases = vec![(Q8_0, 896, 151936), (F16, 896, 151936)];
    cases.extend(TYPES.map(|ty| (ty, 256, 1001)));
    for (ty, n_in, n_out) in cases {
        let mut w = Mat::new(
            &dev,
            ty,
            &random_weights(&mut rng, ty, n_out, n_in),
            n_in,
            false,
        );
        let what = format!("{} {n_out}x{n_in}", ty.name());
        let err = check_logits(&dev, &rng.vec(n_in), &mut w, &token(&mut rng, n_in), &what);
        println!("logits {what}: max err / sum|w*xn| = {err:.2e}");
        assert!(err < TOL, "logits {what}: {err}");
    }
}

/// The arg-max's rules on logits chosen through f32 weights: with `x = e_0` and a norm of
/// ones, `logits[r] = w[r, 0]·sqrt(32)`, so each row's first weight sets its logit; and the
/// greedy decode step's end that the arg-max may carry out.
#[test]
fn logits_argmax_ties_nan_and_infinities() {
    let Some(dev) = gpu() else { return };
    let n_in = 32;
    let mut x = vec![0.0f32; n_in];
    x[0] = 1.0;
    let norm = vec![1.0f32; n_in];
    let n = 3000;
    let with = |fill: f32, set: &[(usize, f32)]| {
        let mut v = vec![fill; n];
        for &(i, x) in set {
            v[i] = x;
        }
        v
    };
    // (first weights, the expected arg-max): all NaN gives u32::MAX; -inf can win; ties go
    // to the first index, across blocks too; -0 ties +0; NaN never wins.
    let cases = [
        (with(f32::NAN, &[]), u32::MAX),
        (with(f32::NEG_INFINITY, &[]), 0),
        (
            with(f32::NAN, &[(2999, -1.0), (1500, f32::NEG_INFINITY)]),
            2999,
        ),
        (
            with(1.0, &[(0, f32::NAN), (2990, 2.0), (1700, 2.0), (2500, 2.0)]),
            1700,
        ),
        (with(-0.0, &[(2000, 0.0)]), 0),
        (with(-1.0, &[(2998, f32::INFINITY), (5, f32::NAN)]), 2998),
    ];
    for (first, want) in cases {
        let mut w = vec![0.0f32; n * n_in];
        for (r, v) in first.iter().enumerate() {
            w[r * n_in] = *v;
        }
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = Mat::new(&dev, GgmlType::F32, &bytes, n_in, false);
        let mut logits = dev.zeros::<f32>(n).unwrap();
        let mut best = dev.zeros::<u32>(1).unwrap();
        let mut scratch = dev.logits_scratch().unwrap();
        let (xd, nd) = (dev.upload(&x).unwrap(), dev.upload(&norm).unwrap());
        dev.logits(
            &mut logits,
            &xd,
            &nd,
            EPS,
            m.weight(),
            Some((&mut best, &mut scratch, None)),
        )
        .unwrap();
        let got = dev.download(&best).unwrap()[0];
        assert_eq!(got, want, "arg-max of {:?}..", &first[..4]);
        assert_eq!(got, cpu::argmax(&dev.download(&logits).unwrap()));

        // Ending a decode step at position p0 of 8 tokens: the token (all-NaN: 0, as the CPU
        // sampler picks) goes to out and tokens[p0 + 1] (none past the end), pos and step
        // advance.
        let token = if want == u32::MAX { 0 } else { want };
        for p0 in [3u32, 7] {
            let what = format!("after {:?}..", &first[..4]);
            check_step_end(&dev, (&mut best, &mut scratch), (p0, token), &what, |a| {
                dev.logits(&mut logits, &xd, &nd, EPS, m.weight(), Some(a))
                    .unwrap()
            });
        }
    }
}

/// The end of a greedy decode step at position `p0` of 8 tokens, which `end_step` launches with
/// the arg-max's output `best`, `scratch` and the `StepEnd` it gets: `token` goes to `best` and
/// to `tokens[p0 + 1]` (none past the end), `pos` and `step` advance by one, the scratch is
/// zero again.
fn check_step_end(
    dev: &Device,
    (best, scratch): (&mut CudaSlice<u32>, &mut CudaSlice<u64>),
    (p0, token): (u32, u32),
    what: &str,
    end_step: impl FnOnce(Argmax<'_>),
) {
    let mut tokens = dev.upload(&[9u32; 8]).unwrap();
    let (mut pos, mut step) = (dev.upload(&[p0]).unwrap(), dev.upload(&[41u64]).unwrap());
    let end = StepEnd {
        tokens: &mut tokens,
        pos: &mut pos,
        step: &mut step,
    };
    end_step((best, scratch, Some(end)));
    let mut want_tokens = [9u32; 8];
    if p0 < 7 {
        want_tokens[p0 as usize + 1] = token;
    }
    let what = format!("{what}, step end at {p0}");
    assert_eq!(dev.download(best).unwrap(), [token], "{what}: out");
    assert_eq!(
        dev.download(&tokens).unwrap(),
        want_tokens,
        "{what}: tokens"
    );
    assert_eq!(dev.download(&pos).unwrap(), [p0 + 1], "{what}: pos");
    assert_eq!(dev.download(&step).unwrap(), [42], "{what}: step");
    assert_eq!(dev.download(scratch).unwrap(), [0, 0], "{what}: scratch");
}

/// `argmax_bounded`'s rules, as `logits`' fused arg-max has them, on q8_0 rows of one block
/// chosen through their scale `d` and first quant (`x = e_0`, a norm of ones: `logits[r] =
/// d·q·sqrt(32)`): ties go to the first index, across blocks too; NaN never wins, all NaN
/// gives `u32::MAX` (token 0 at a step's end); an infinite scale gives NaN (`inf·0` in the
/// chunk's other half) and does not win either. And the end of a greedy decode step.
#[test]
fn argmax_bounded_ties_nan_and_step_end() {
    let Some(dev) = gpu() else { return };
    let (n_in, n) = (32, 3000);
    let mut x = vec![0.0f32; n_in];
    x[0] = 1.0;
    let (xd, nd) = (
        dev.upload(&x).unwrap(),
        dev.upload(&vec![1.0f32; n_in]).unwrap(),
    );
    let rows = |fill: (f32, i8), set: &[(usize, (f32, i8))]| {
        let mut r = vec![fill; n];
        for &(i, v) in set {
            r[i] = v;
        }
        r.iter()
            .flat_map(|&(d, q)| {
                let mut b = [0u8; 34];
                b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                b[2] = q as u8;
                b
            })
            .collect::<Vec<u8>>()
    };
    let cases = [
        (
            rows(
                (1.0, 0),
                &[(2990, (1.0, 100)), (1700, (2.0, 50)), (2500, (1.0, 100))],
            ),
            1700,
        ),
        (rows((f32::NAN, 1), &[]), u32::MAX),
        (
            rows((1.0, -5), &[(0, (f32::NAN, 1)), (2998, (f32::INFINITY, 1))]),
            1,
        ),
        (rows((1.0, 0), &[(1500, (-1.0, 3))]), 0),
    ];
    for (bytes, want) in cases {
        let mut m = Mat::new(&dev, GgmlType::Q8_0, &bytes, n_in, false);
        let (b, _) = m.bounded.as_mut().unwrap();
        let mut scratch = dev.logits_scratch().unwrap();
        let token = if want == u32::MAX { 0 } else { want };
        let mut best = dev.zeros::<u32>(1).unwrap();
        dev.argmax_bounded(b, &xd, &nd, EPS, &m.data, (&mut best, &mut scratch, None))
            .unwrap();
        assert_eq!(dev.download(&best).unwrap(), [want], "arg-max, case {want}");
        let mut fused = dev.zeros::<u32>(1).unwrap();
        let mut logits = dev.zeros::<f32>(n).unwrap();
        let argmax = Some((&mut fused as &mut dyn DevicePtrMut<u32>, &mut scratch, None));
        dev.logits(&mut logits, &xd, &nd, EPS, &m.data, argmax)
            .unwrap();
        assert_eq!(
            dev.download(&fused).unwrap(),
            [want],
            "logits' arg-max, case {want}"
        );
        for p0 in [3u32, 7] {
            let what = format!("case {want}");
            check_step_end(&dev, (&mut best, &mut scratch), (p0, token), &what, |a| {
                dev.argmax_bounded(b, &xd, &nd, EPS, &m.data, a).unwrap()
            });
        }
    }
}

/// Row `id` of the real model's token embedding.
fn embedding(g: &orcd::gguf::Gguf, id: usize) -> Vec<f32> {
    let t = g.tensor("token_embd.weight").unwrap();
    let rb = t.ty.row_bytes(t.shape[0] as usize).unwrap();
    quant::dequantize_to_vec(t.ty, &g.tensor_data(t)[id * rb..(id + 1) * rb]).unwrap()
}

/// The real model's layers 0 and 11 (weights in the file's types and in f16), the token
/// embedding of a few ids as `x`.
#[test]
fn decode_kernels_on_real_layers() {
    let Some(dev) = gpu() else { return };
    let g = orcd_tests::gguf();
    let cfg = orcd::config::Config::from_gguf(g).unwrap();
    let mut rng = Rng::new(35);
    let tensor = |name: &str| {
        let t = g.tensor(name).unwrap();
        (t.ty, g.tensor_data(t), t.shape[0] as usize)
    };
    let f32s = |name: &str| {
        let (ty, bytes, _) = tensor(name);
        quant::dequantize_to_vec(ty, bytes).unwrap()
    };
    let x_of = |id: usize| embedding(g, id);
    for layer in [0, 11] {
        for as_f16 in [false, true] {
            let mat = |name: &str| {
                let (ty, bytes, n_in) = tensor(&format!("blk.{layer}.{name}.weight"));
                Mat::new(&dev, ty, bytes, n_in, as_f16)
            };
            let bias = |name: &str| Some(f32s(&format!("blk.{layer}.{name}.bias")));
            let a = Attn {
                norm: f32s(&format!("blk.{layer}.attn_norm.weight")),
                qkv: [
                    (mat("attn_q"), bias("attn_q")),
                    (mat("attn_k"), bias("attn_k")),
                    (mat("attn_v"), bias("attn_v")),
                ],
                n_heads: cfg.n_heads,
                n_kv: cfg.n_kv_heads,
                head_dim: cfg.head_dim,
            };
            let (wo, gate, up, down) = (
                mat("attn_output"),
                mat("ffn_gate"),
                mat("ffn_up"),
                mat("ffn_down"),
            );
            let ffn_norm = f32s(&format!("blk.{layer}.ffn_norm.weight"));
            for (id, pos) in [(9707, 0), (151644, 17), (1350, 4000)] {
                let x = x_of(id);
                let what = format!("layer {layer} {} token {id} pos {pos}", a.qkv[0].0.name());
                let err = check_attn_qkv(&dev, &a, &x, pos, &what);
                println!("attn_qkv {what}: max err / sum|w*xn| = {err:.2e}");
                assert!(err < TOL, "attn_qkv {what}: {err}");
                let err = check_gate_up(&dev, &ffn_norm, &gate, &up, &x);
                println!("ffn_gate_up {what}: max err / scale = {err:.2e}");
                assert!(err < TOL, "ffn_gate_up {what}: {err}");
                // The attention output (of random q, k, v) onto the residual, and the FFN's.
                let err = check_attn_output(&dev, &mut rng, &wo, cfg.n_heads);
                println!("attn_output {what}: max err / scale = {err:.2e}");
                assert!(err < TOL, "attn_output {what}: {err}");
                let h: Vec<f32> = rng.vec(down.n_in).iter().map(|v| v * 0.5).collect();
                let err = check_residual(&dev, &mut rng, &down, None, &h);
                println!(
                    "gemv_residual ffn_down ({}) {what}: max err / scale = {err:.2e}",
                    down.name()
                );
                assert!(err < TOL, "gemv_residual ffn_down {what}: {err}");
            }
        }
    }
}

/// The real output projection and norm, on token embeddings and on random states.
#[test]
fn logits_on_real_output() {
    let Some(dev) = gpu() else { return };
    let g = orcd_tests::gguf();
    let mut rng = Rng::new(36);
    let t = g.tensor("output.weight").unwrap();
    let n_in = t.shape[0] as usize;
    let nt = g.tensor("output_norm.weight").unwrap();
    let norm = quant::dequantize_to_vec(nt.ty, g.tensor_data(nt)).unwrap();
    for as_f16 in [false, true] {
        let mut w = Mat::new(&dev, t.ty, g.tensor_data(t), n_in, as_f16);
        let xs = [embedding(g, 9707), embedding(g, 198), token(&mut rng, n_in)];
        for (i, x) in xs.iter().enumerate() {
            let what = format!("output.weight {} x{i}", w.name());
            let err = check_logits(&dev, &norm, &mut w, x, &what);
            println!("logits {what}: max err / sum|w*xn| = {err:.2e}");
            assert!(err < TOL, "logits {what}: {err}");
        }
    }
}

#[test]
fn decode_kernels_refuse_bad_shapes() {
    let Some(dev) = gpu() else { return };
    let (n_in, n_out) = (64, 8);
    let zeros = |ty: GgmlType, rows: usize, n_in: usize| {
        let bytes = vec![0u8; ty.row_bytes(n_in).unwrap() * rows];
        dev.upload_matrix(ty, &bytes, n_in).unwrap()
    };
    let q8 = zeros(GgmlType::Q8_0, n_out, n_in);
    let x = dev.zeros::<f32>(n_in).unwrap();
    let mut y = dev.zeros::<f32>(n_out + 1).unwrap();
    let msg = |r: orcd::Result<()>| r.unwrap_err().to_string();
    // 9 rows of y, but w holds 8 rows.
    assert_eq!(
        msg(dev.gemv_residual(&mut y, &q8, None, &x)),
        "gemv_residual: shapes do not match"
    );
    let mut y = dev.zeros::<f32>(n_out).unwrap();
    dev.gemv_residual(&mut y, &q8, None, &x).unwrap();
    // Vectors that are not whole chunks of 32, vectors that do not start 16-byte aligned.
    let w60 = zeros(GgmlType::F32, n_out, 60);
    let x60 = dev.zeros::<f32>(60).unwrap();
    assert_eq!(
        msg(dev.gemv_residual(&mut y, &w60, None, &x60)),
        "gemv_residual: vectors of 60 are not a whole number of chunks of 32"
    );
    let x1 = dev.zeros::<f32>(n_in + 1).unwrap();
    assert_eq!(
        msg(dev.gemv_residual(&mut y, &q8, None, &x1.slice(1..))),
        "gemv_residual: vectors must start 16-byte aligned"
    );
    // Gate and up of two types; a norm of the wrong length.
    let w16 = zeros(GgmlType::F16, n_out, n_in);
    let norm = dev.zeros::<f32>(n_in).unwrap();
    assert_eq!(
        msg(dev.ffn_gate_up(&mut y, &x, &norm, EPS, &q8, &w16)),
        "ffn_gate_up: gate (q8_0) and up (f16) must have one type"
    );
    assert!(dev.ffn_gate_up(&mut y, &x, &x60, EPS, &w16, &w16).is_err());
    // A row too long for one lane per chunk.
    let long = dev.zeros::<f32>(32800).unwrap();
    let wl = zeros(GgmlType::F16, 1, 32800);
    let mut one = dev.zeros::<f32>(1).unwrap();
    assert_eq!(
        msg(dev.logits(&mut one, &long, &long, EPS, &wl, None)),
        "logits: rows of 32800 are longer than the kernel's 32768"
    );
    // The bounded arg-max: for q8_0 and f16 rows of at most 1,024 only, and on the matrix it
    // was made for.
    let f32s = zeros(GgmlType::F32, n_out, n_in);
    assert!(dev.bounded_argmax(&f32s).unwrap().is_none());
    let wide = zeros(GgmlType::F16, 1, 1056);
    assert!(dev.bounded_argmax(&wide).unwrap().is_none());
    let mut b = dev.bounded_argmax(&q8).unwrap().unwrap();
    let (mut best, mut scratch) = (dev.zeros::<u32>(1).unwrap(), dev.logits_scratch().unwrap());
    let q8_6 = zeros(GgmlType::Q8_0, 6, n_in);
    assert_eq!(
        msg(dev.argmax_bounded(
            &mut b,
            &x,
            &norm,
            EPS,
            &q8_6,
            (&mut best, &mut scratch, None)
        )),
        "argmax_bounded: matrix, bounds, best, scratch and step do not match"
    );
    assert!(
        dev.argmax_bounded(
            &mut b,
            &x60,
            &norm,
            EPS,
            &q8,
            (&mut best, &mut scratch, None)
        )
        .is_err()
    );
    dev.argmax_bounded(&mut b, &x, &norm, EPS, &q8, (&mut best, &mut scratch, None))
        .unwrap();
    // attn_qkv: an odd head_dim, caches that are not whole rows.
    let (mut q, mut kc, mut vc) = (
        dev.zeros::<f32>(2 * 6).unwrap(),
        dev.zeros::<f32>(3 * 6).unwrap(),
        dev.zeros::<f32>(3 * 6).unwrap(),
    );
    let pos = dev.zeros::<u32>(1).unwrap();
    let rope = dev.rope_table(4, 6, THETA).unwrap();
    let mut sums = dev.attention_sums(2, 6).unwrap();
    let wq = zeros(GgmlType::F16, 12, n_in);
    let wkv = zeros(GgmlType::F16, 6, n_in);
    // Quantized and float matrices in one call: one kernel build serves one family.
    let wkv8 = zeros(GgmlType::Q8_0, 6, n_in);
    let mixed = [&wq, &wkv, &wkv8].map(|w| (w, None));
    assert_eq!(
        msg(dev.attn_qkv(
            &mut q, &mut kc, &mut vc, &x, &norm, EPS, mixed, &pos, &rope, &mut sums, 2, 1
        )),
        "attn_qkv: q, k and v (f16, f16, q8_0) must be all quantized or all of one float type"
    );
    let qkv = [&wq, &wkv, &wkv].map(|w| (w, None));
    dev.attn_qkv(
        &mut q, &mut kc, &mut vc, &x, &norm, EPS, qkv, &pos, &rope, &mut sums, 2, 1,
    )
    .unwrap();
    assert_eq!(
        msg(dev.attn_qkv(
            &mut q, &mut kc, &mut vc, &x, &norm, EPS, qkv, &pos, &rope, &mut sums, 4, 1
        )),
        "attn_qkv: n_heads, n_kv_heads and q (an even head_dim) do not match"
    );
    let mut kc5 = dev.zeros::<f32>(17).unwrap();
    let mut vc5 = dev.zeros::<f32>(17).unwrap();
    assert!(
        dev.attn_qkv(
            &mut q, &mut kc5, &mut vc5, &x, &norm, EPS, qkv, &pos, &rope, &mut sums, 2, 1
        )
        .is_err()
    );
    // Sums of other heads; attn_output of a head_dim that is no multiple of 4.
    let mut sums3 = dev.attention_sums(3, 6).unwrap();
    assert_eq!(
        msg(dev.attn_qkv(
            &mut q, &mut kc, &mut vc, &x, &norm, EPS, qkv, &pos, &rope, &mut sums3, 2, 1
        )),
        "attn_qkv: the sums' heads and head_dim do not match"
    );
    let mut y = dev.zeros::<f32>(5).unwrap();
    let wo = zeros(GgmlType::F16, 5, 96);
    let sums6 = dev.attention_sums(16, 6).unwrap();
    assert_eq!(
        msg(dev.attn_output(&mut y, &wo, &sums6)),
        "attn_output: head_dim 6 is not a multiple of 4"
    );
    dev.synchronize().unwrap();
}
