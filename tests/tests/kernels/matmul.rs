//! matmul (GEMV and tiled GEMM) of plain and quantized weights, embed, silu_mul and add
//! against their CPU twins.
use half::f16;
use orcd::cpu;
use orcd::cuda::Device;
use orcd::gguf::{Gguf, TensorInfo};
use orcd::quant::{self, GgmlType};
use orcd_tests::{Rng, gpu};
use std::collections::HashSet;

/// Token counts: the GEMV (1), GEMM tiles cut short (2, 7, 100, 513) and one whole tile (64).
const ROWS: [usize; 6] = [1, 2, 7, 64, 100, 513];

/// Both sides sum the same f32 products, the GPU by FMA and in another order, so the
/// difference is rounding: at most ~n_in·eps·sum|x·w| and in practice a few eps of it
/// (the same bound as basic.rs's gemv test). Scaled by sum|x·w| + |bias| per output.
const MATMUL_TOL: f32 = 1e-5;

fn to_f16(v: &[f32]) -> Vec<f16> {
    v.iter().copied().map(f16::from_f32).collect()
}

pub(super) fn abs(v: &[f32]) -> Vec<f32> {
    v.iter().map(|v| v.abs()).collect()
}

/// A matmul on the GPU for fixed weights: `(x, bias, rows)` to `y`.
type GpuMatmul<'a> = Box<dyn Fn(&[f32], Option<&[f32]>, usize) -> Vec<f32> + 'a>;

/// The GPU's matmul against `cpu::matmul` on the same weights `w32` (f32 `[n_out, n_in]`)
/// for `rows` random tokens, with and without `bias`; returns the worst error over both.
fn matmul_err(
    rng: &mut Rng,
    gpu: &GpuMatmul,
    w32: &[f32],
    bias: &[f32],
    n_in: usize,
    rows: usize,
) -> f32 {
    let n_out = bias.len();
    let x = rng.vec(rows * n_in);
    // The error scale: sum_i |x[t, i]·w[o, i]|.
    let mut mag = vec![0.0; rows * n_out];
    cpu::matmul(&mut mag, &abs(&x), &abs(w32), n_in, None);
    let mut want = vec![0.0; rows * n_out];
    cpu::matmul(&mut want, &x, w32, n_in, None);
    let mut worst = 0.0f32;
    for with_bias in [false, true] {
        let got = gpu(&x, with_bias.then_some(bias), rows);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // `cpu::matmul` adds the bias to each finished dot product, as here.
            let (w, scale) = match with_bias {
                true => (w + bias[i % n_out], mag[i] + bias[i % n_out].abs()),
                false => (*w, mag[i]),
            };
            let err = (g - w).abs() / scale.max(1e-30);
            // NaN (an output never written or read out of bounds) must fail too.
            worst = if err.is_nan() {
                f32::INFINITY
            } else {
                worst.max(err)
            };
        }
    }
    worst
}

/// `Device::matmul` with the f16 weights `w` `[n_out, n_in]`.
fn f16_matmul<'a>(dev: &'a Device, w: &[f16], n_in: usize, n_out: usize) -> GpuMatmul<'a> {
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    q_matmul(dev, &bytes, GgmlType::F16, n_in, n_out, 0)
}

/// `Device::matmul` with the weights `w`, the file bytes of a `[n_out, n_in]` tensor of type
/// `ty`; `x` starts `x_off` floats into its device buffer.
fn q_matmul<'a>(
    dev: &'a Device,
    w: &[u8],
    ty: GgmlType,
    n_in: usize,
    n_out: usize,
    x_off: usize,
) -> GpuMatmul<'a> {
    let wd = dev.upload_matrix(ty, w, n_in).unwrap();
    Box::new(move |x, bias, rows| {
        let mut xp = vec![0.0; x_off];
        xp.extend_from_slice(x);
        let (xd, bd) = (
            dev.upload(&xp).unwrap(),
            bias.map(|b| dev.upload(b).unwrap()),
        );
        let mut y = dev.zeros::<f32>(rows * n_out).unwrap();
        // The shape in the message: which launch (GEMV or GEMM, and its split) failed.
        let what = format!("matmul {} rows={rows} {n_out}x{n_in}", ty.name());
        dev.matmul(&mut y, &xd.slice(x_off..), &wd, bd.as_ref(), rows)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        dev.download(&y)
            .unwrap_or_else(|e| panic!("{what}, reading y back: {e}"))
    })
}

#[test]
fn matmul_f16_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(11);
    // (n_out, n_in): the model's projections, then odd sizes for every bounds check and
    // the narrower load paths (n_in % 8 != 0: 65 odd, 34 even).
    let shapes = [
        (896, 896),
        (128, 896),
        (4864, 896),
        (896, 4864),
        (151936, 896),
        (33, 65),
        (9, 34),
        (5, 7),
    ];
    for (n_out, n_in) in shapes {
        let w = to_f16(&rng.vec(n_out * n_in));
        let w32: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let bias = rng.vec(n_out);
        let gpu = f16_matmul(&dev, &w, n_in, n_out);
        for rows in ROWS {
            // The vocabulary projection only for decode and a short prompt: its CPU twin is slow.
            if n_out == 151936 && !matches!(rows, 1 | 7) {
                continue;
            }
            let err = matmul_err(&mut rng, &gpu, &w32, &bias, n_in, rows);
            println!("matmul_f16 rows={rows} {n_out}x{n_in}: max err / sum|x*w| = {err:.2e}");
            assert!(
                err < MATMUL_TOL,
                "matmul_f16 rows={rows} {n_out}x{n_in}: {err}"
            );
        }
    }
}

#[test]
fn matmul_f16_on_real_weights() {
    let Some(dev) = gpu() else { return };
    let g = Gguf::open(&orcd_tests::model_path()).unwrap();
    let mut rng = Rng::new(12);
    let f32_tensor = |name: &str| {
        let t = g.tensor(name).unwrap();
        quant::dequantize_to_vec(t.ty, g.tensor_data(t)).unwrap()
    };
    // (weight, bias, token counts)
    let cases = [
        (
            "blk.0.attn_q.weight",
            Some("blk.0.attn_q.bias"),
            &[1, 100][..],
        ),
        ("blk.0.ffn_down.weight", None, &[1, 100][..]),
        ("output.weight", None, &[1][..]),
    ];
    for (name, bias, rows_list) in cases {
        let t = g.tensor(name).unwrap();
        // ggml order: shape[0] is the row length.
        let (n_in, n_out) = (t.shape[0] as usize, t.shape[1] as usize);
        let mut w = vec![f16::ZERO; n_in * n_out];
        quant::dequantize_f16(t.ty, g.tensor_data(t), &mut w).unwrap();
        let w32: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        // Without a bias tensor, a random one (matmul_err runs with and without it anyway).
        let bias = bias.map_or_else(|| rng.vec(n_out), f32_tensor);
        let gpu = f16_matmul(&dev, &w, n_in, n_out);
        for &rows in rows_list {
            let err = matmul_err(&mut rng, &gpu, &w32, &bias, n_in, rows);
            println!(
                "matmul_f16 {name} rows={rows} ({n_out}x{n_in}): max err / sum|x*w| = {err:.2e}"
            );
            assert!(err < MATMUL_TOL, "matmul_f16 {name} rows={rows}: {err}");
        }
    }
}

#[test]
fn matmul_f16_unaligned_x_and_bad_shapes() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(13);
    let (n_out, n_in) = (40, 896);
    let w = to_f16(&rng.vec(n_out * n_in));
    let w32: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    let bias = rng.vec(n_out);
    // x one float into its buffer (4-byte aligned: every narrow path, the GEMM's f32 loop),
    // then aligned.
    for x_off in [1, 0] {
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let gpu = q_matmul(&dev, &bytes, GgmlType::F16, n_in, n_out, x_off);
        for rows in [1, 2, 70] {
            let err = matmul_err(&mut rng, &gpu, &w32, &bias, n_in, rows);
            println!("matmul_f16 x+{x_off} rows={rows}: max err / sum|x*w| = {err:.2e}");
            assert!(err < MATMUL_TOL, "matmul_f16 x+{x_off} rows={rows}: {err}");
        }
    }
    // Shapes that do not fit are errors, not launches.
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let wd = dev.upload_matrix(GgmlType::F16, &bytes, n_in).unwrap();
    let x = dev.zeros::<f32>(n_in).unwrap();
    let mut y = dev.zeros::<f32>(n_out).unwrap();
    let mut short_y = dev.zeros::<f32>(n_out - 1).unwrap();
    let err = dev.matmul(&mut short_y, &x, &wd, None, 1).unwrap_err();
    assert_eq!(err.to_string(), "matmul: shapes do not match");
    let short_bias = dev.upload(&[0.0f32; 3]).unwrap();
    assert!(dev.matmul(&mut y, &x, &wd, Some(&short_bias), 1).is_err());
    // Two tokens need 2·n_in of x and 2·n_out of y.
    assert!(dev.matmul(&mut y, &x, &wd, None, 2).is_err());
}

/// Every weight type the engine reads.
pub(super) const TYPES: [GgmlType; 9] = GgmlType::ALL;

/// `matmul_q` dequantizes exactly as `quant::dequantize` does, so against `cpu::matmul` on
/// the dequantized weights the only difference is the order of the f32 sums and FMA: the
/// same `MATMUL_TOL` as the f16 products.
#[test]
fn matmul_q_matches_cpu_on_random_blocks() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(17);
    for ty in TYPES {
        // (n_out, n_in): the model's projections (ffn_down's for the K-quants, whose rows are
        // whole blocks of 256), the vocabulary projection for the quantized types
        // (`matmul_f16_matches_cpu` runs it through the plain floats' kernels), then odd n_out
        // with rows that the GEMV splits over 1, 2 or 4 warps (8 for n_in = 4864), and odd
        // n_in for the plain floats, whose rows need not be whole groups of 8.
        let shapes: &[(usize, usize)] = match ty.block_elems() {
            1 => &[
                (896, 896),
                (128, 896),
                (4864, 896),
                (896, 4864),
                (33, 65),
                (33, 2050),
            ],
            32 => &[
                (896, 896),
                (128, 896),
                (4864, 896),
                (896, 4864),
                (151936, 896),
                (33, 96),
                (33, 2080),
            ],
            _ => &[
                (896, 4864),
                (300, 512),
                (151936, 512),
                (33, 256),
                (33, 2048),
            ],
        };
        for &(n_out, n_in) in shapes {
            let w = random_table(ty, n_out, n_in, &mut rng);
            let w32 = quant::dequantize_to_vec(ty, &w).unwrap();
            let bias = rng.vec(n_out);
            let gpu = q_matmul(&dev, &w, ty, n_in, n_out, 0);
            // Decode, a few tokens, one whole GEMM tile, and tiles cut short.
            for rows in [1, 3, 64, 130] {
                // The vocabulary projection only for decode: its CPU twin is slow.
                if n_out == 151936 && rows > 1 {
                    continue;
                }
                let err = matmul_err(&mut rng, &gpu, &w32, &bias, n_in, rows);
                let what = format!("matmul_q {} rows={rows} {n_out}x{n_in}", ty.name());
                println!("{what}: max err / sum|x*w| = {err:.2e}");
                assert!(err < MATMUL_TOL, "{what}: {err}");
            }
        }
    }
}

/// With one-hot tokens `x = e_k` every product but one is `w·0 = 0`, so `y[o]` is the
/// dequantized weight `w[o, k]` itself: the kernels' dequantization must equal
/// `quant::dequantize` exactly (compared as floats: a weight of -0 may come out +0). Exactly
/// in the GEMV; in the tensor-core GEMM up to its f16 split of the weight, `hi + lo / 2^11`,
/// within max(2^-22·|w|, 2^-36) of it, and the final rounding of that sum (2^-24·|w|).
#[test]
fn matmul_q_one_hot_tokens_give_the_exact_weights() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(20);
    let n_out = 33;
    for ty in TYPES {
        // One GEMV warp per output, and split over 4 (32-element blocks) or 2 (K-quants).
        let n_ins: &[usize] = match ty.block_elems() {
            1 => &[65, 2050],
            32 => &[96, 2080],
            _ => &[256, 2048],
        };
        for &n_in in n_ins {
            let w = random_table(ty, n_out, n_in, &mut rng);
            let w32 = quant::dequantize_to_vec(ty, &w).unwrap();
            let wd = dev.upload_matrix(ty, &w, n_in).unwrap();
            // The GEMM with all n_in one-hot tokens (x the identity): y = w transposed.
            let mut x = vec![0.0f32; n_in * n_in];
            for k in 0..n_in {
                x[k * n_in + k] = 1.0;
            }
            let mut y = dev.zeros::<f32>(n_in * n_out).unwrap();
            let xd = dev.upload(&x).unwrap();
            dev.matmul(&mut y, &xd, &wd, None, n_in).unwrap();
            let got = dev.download(&y).unwrap();
            for (k, o) in (0..n_in).flat_map(|k| (0..n_out).map(move |o| (k, o))) {
                let (g, want) = (got[k * n_out + o], w32[o * n_in + k]);
                let tol = want.abs() * 2f32.powi(-21) + 2f32.powi(-36);
                assert!(
                    (g - want).abs() <= tol,
                    "gemm {} [{o}, {k}]: {g} vs {want}",
                    ty.name()
                );
            }
            // The GEMV for a few tokens: the first and last element of groups and blocks.
            for k in [0, 1, 7, 8, 31, 32, 95, n_in - 1]
                .into_iter()
                .filter(|&k| k < n_in)
            {
                let xd = dev.upload(&x[k * n_in..(k + 1) * n_in]).unwrap();
                let mut y = dev.zeros::<f32>(n_out).unwrap();
                dev.matmul(&mut y, &xd, &wd, None, 1).unwrap();
                let got = dev.download(&y).unwrap();
                for (o, g) in got.iter().enumerate() {
                    let want = w32[o * n_in + k];
                    assert!(*g == want, "gemv {} [{o}, {k}]: {g} vs {want}", ty.name());
                }
            }
            println!(
                "matmul_q {} 33x{n_in}: one-hot tokens give the weights (exactly in the GEMV)",
                ty.name()
            );
        }
    }
}

/// Calls `f` on the first matrix of every distinct (type, shape) in the model's file (the
/// 0.5B's are q5_0, q8_0, q4_K and q6_K; the 1.5B's q4_K and q6_K), one at a time: the tensor,
/// `n_in`, `n_out`, its f32 weights, and its own bias (attn_q/k/v) or a random one. Returns
/// the types seen.
pub(super) fn each_distinct_matrix(
    g: &Gguf,
    rng: &mut Rng,
    mut f: impl FnMut(&TensorInfo, &mut Rng, usize, usize, &[f32], &[f32]),
) -> HashSet<GgmlType> {
    let mut seen = HashSet::new();
    for t in g.tensors().iter().filter(|t| t.shape.len() == 2) {
        if !seen.insert((t.ty, t.shape.clone())) {
            continue;
        }
        // ggml order: shape[0] is the row length.
        let (n_in, n_out) = (t.shape[0] as usize, t.shape[1] as usize);
        let w32 = quant::dequantize_to_vec(t.ty, g.tensor_data(t)).unwrap();
        let bias = match g.tensor(&t.name.replace(".weight", ".bias")) {
            Ok(b) => quant::dequantize_to_vec(b.ty, g.tensor_data(b)).unwrap(),
            Err(_) => rng.vec(n_out),
        };
        f(t, rng, n_in, n_out, &w32, &bias);
    }
    seen.iter().map(|(ty, _)| *ty).collect()
}

#[test]
fn matmul_q_on_real_weights() {
    let Some(dev) = gpu() else { return };
    let g = Gguf::open(&orcd_tests::model_path()).unwrap();
    let mut rng = Rng::new(18);
    let types = each_distinct_matrix(&g, &mut rng, |t, rng, n_in, n_out, w32, bias| {
        let data = g.tensor_data(t);
        let gpu = q_matmul(&dev, data, t.ty, n_in, n_out, 0);
        for rows in [1, 47] {
            // The vocabulary-sized ones only for decode: their CPU twin is slow.
            if n_out > 100_000 && rows > 1 {
                continue;
            }
            let err = matmul_err(rng, &gpu, w32, bias, n_in, rows);
            let what = format!(
                "matmul_q {} ({}) rows={rows} {n_out}x{n_in}",
                t.name,
                t.ty.name()
            );
            println!("{what}: max err / sum|x*w| = {err:.2e}");
            assert!(err < MATMUL_TOL, "{what}: {err}");
        }
    });
    // Every type among the model's matrices ran; `matmul_q_matches_cpu_on_random_blocks`
    // covers the types a model may lack.
    let mut names: Vec<_> = types.iter().map(|t| t.name()).collect();
    names.sort();
    println!("matmul_q on real weights: the model's matrix types {names:?}");
    assert!(!types.is_empty(), "no matrix in the model");
}

#[test]
fn matmul_q_unaligned_x_and_bad_input() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(19);
    // x one float into its buffer: the kernels' scalar loads of x (and of f16 weights).
    let (n_out, n_in) = (40, 512);
    for ty in TYPES {
        let w = random_table(ty, n_out, n_in, &mut rng);
        let w32 = quant::dequantize_to_vec(ty, &w).unwrap();
        let bias = rng.vec(n_out);
        let gpu = q_matmul(&dev, &w, ty, n_in, n_out, 1);
        for rows in [1, 3] {
            let err = matmul_err(&mut rng, &gpu, &w32, &bias, n_in, rows);
            let what = format!("matmul_q {} x+1 rows={rows}", ty.name());
            println!("{what}: max err / sum|x*w| = {err:.2e}");
            assert!(err < MATMUL_TOL, "{what}: {err}");
        }
    }
    // Rows that are not whole blocks.
    let Err(err) = dev.upload_matrix(GgmlType::Q4K, &[0u8; 144], 100) else {
        panic!("q4_K rows of 100 elements");
    };
    assert_eq!(
        err.to_string(),
        "pack q4_K: 144 bytes are not whole rows of 100"
    );
    // A bias that is not n_out long, too few rows of x or y.
    let ty = GgmlType::Q8_0;
    let w = random_table(ty, n_out, n_in, &mut rng);
    let wd = dev.upload_matrix(ty, &w, n_in).unwrap();
    let x = dev.zeros::<f32>(2 * n_in).unwrap();
    let mut y = dev.zeros::<f32>(n_out).unwrap();
    let short_bias = dev.upload(&[0.0f32; 3]).unwrap();
    assert!(dev.matmul(&mut y, &x, &wd, Some(&short_bias), 1).is_err());
    assert!(dev.matmul(&mut y, &x, &wd, None, 3).is_err());
    assert!(
        dev.matmul(&mut y, &x, &wd, None, 2).is_err(),
        "2 tokens need 2·n_out of y"
    );
}

/// A table of `n_rows` rows of `hidden` elements of `ty`: random bytes, with every block's
/// f16 scales (d, and dmin for the K types) replaced by sane random values in ±0.1, and the
/// plain float types filled with random finite values.
pub(super) fn random_table(ty: GgmlType, n_rows: usize, hidden: usize, rng: &mut Rng) -> Vec<u8> {
    let n = n_rows * hidden;
    match ty {
        GgmlType::F32 => rng
            .vec(n)
            .iter()
            .flat_map(|v| (v * 4.0).to_le_bytes())
            .collect(),
        GgmlType::F16 => rng
            .vec(n)
            .iter()
            .flat_map(|v| f16::from_f32(v * 4.0).to_le_bytes())
            .collect(),
        // bf16 is the top half of an f32.
        GgmlType::BF16 => rng
            .vec(n)
            .iter()
            .flat_map(|v| (((v * 4.0).to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        _ => {
            let bytes = ty.row_bytes(hidden).unwrap() * n_rows;
            let mut t: Vec<u8> = (0..bytes)
                .map(|_| ((rng.next_f32() + 1.0) * 128.0) as u8)
                .collect();
            let scales: &[usize] = match ty {
                GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                GgmlType::Q6K => &[208],
                _ => &[0],
            };
            for block in t.chunks_exact_mut(ty.block_bytes()) {
                for &at in scales {
                    let d = f16::from_f32(rng.next_f32() * 0.1);
                    block[at..at + 2].copy_from_slice(&d.to_le_bytes());
                }
            }
            t
        }
    }
}

/// `embed` of `tokens` against `quant::dequantize` of the same rows: bit-identical (the
/// kernels do the CPU's arithmetic in its order, and the PTX has no FMA that could round
/// differently); likewise `embed_at` of each position, its id read at `tokens[pos[0]]` on
/// the device. Returns how many elements were compared.
fn check_embed(
    dev: &Device,
    table: &[u8],
    ty: GgmlType,
    hidden: usize,
    tokens: &[u32],
    what: &str,
) -> usize {
    let rb = ty.row_bytes(hidden).unwrap();
    let mut want = vec![0.0f32; tokens.len() * hidden];
    for (out, &t) in want.chunks_exact_mut(hidden).zip(tokens) {
        let t = t as usize;
        quant::dequantize(ty, &table[t * rb..(t + 1) * rb], out).unwrap();
    }
    let mut out = dev.zeros::<f32>(tokens.len() * hidden).unwrap();
    let td = dev.upload_matrix(ty, table, hidden).unwrap();
    let kd = dev.upload(tokens).unwrap();
    dev.embed(&mut out, &td, &kd, tokens.len()).unwrap();
    let got = dev.download(&out).unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "embed {what} {}: token {} element {}: {g} vs {w}",
            ty.name(),
            tokens[i / hidden],
            i % hidden
        );
    }
    let mut row = dev.zeros::<f32>(hidden).unwrap();
    for (t, want) in want.chunks_exact(hidden).enumerate() {
        let posd = dev.upload(&[t as u32]).unwrap();
        dev.embed_at(&mut row, &td, &kd, &posd).unwrap();
        let got = dev.download(&row).unwrap();
        assert!(
            got.iter()
                .zip(want)
                .all(|(g, w)| g.to_bits() == w.to_bits()),
            "embed_at {what} {}: position {t} (token {})",
            ty.name(),
            tokens[t]
        );
    }
    got.len()
}

#[test]
fn embed_matches_dequantize_for_every_type() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(14);
    let n_rows = 37;
    // First, last, repeated and middle rows.
    let tokens = [0u32, 36, 5, 5, 17, 36, 1, 30, 0];
    for ty in TYPES {
        // The model's width, the smallest row, and a width of several blocks.
        let hiddens = match ty.block_elems() {
            1 => vec![896, 1, 7],
            32 => vec![896, 32, 96],
            _ => vec![768, 256, 512],
        };
        for hidden in hiddens {
            let table = random_table(ty, n_rows, hidden, &mut rng);
            let n = check_embed(&dev, &table, ty, hidden, &tokens, "random");
            println!(
                "embed {} hidden={hidden}: {n} elements bit-identical",
                ty.name()
            );
        }
    }
}

/// `upload_matrix_f16` (quantized types: uploaded packed, converted on the GPU by
/// `dequantize_f16`) holds exactly `quant::dequantize_f16`'s bits: for every type on random
/// blocks, and for the first matrix of each quantized type in the real model.
#[test]
fn upload_matrix_f16_matches_dequantize_f16() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(41);
    let check = |ty: GgmlType, bytes: &[u8], n_in: usize, what: &str| {
        let mut want = vec![f16::ZERO; bytes.len() / ty.block_bytes() * ty.block_elems()];
        quant::dequantize_f16(ty, bytes, &mut want).unwrap();
        let m = dev.upload_matrix_f16(ty, bytes, n_in).unwrap();
        assert_eq!(m.ty(), GgmlType::F16, "{what}");
        let got = m.download(&dev).unwrap();
        assert_eq!(got.len(), 2 * want.len(), "{what}: bytes");
        for (i, (g, w)) in got.chunks_exact(2).zip(&want).enumerate() {
            let g = u16::from_le_bytes([g[0], g[1]]);
            assert_eq!(
                g,
                w.to_bits(),
                "{what}: element {i}: {g:#06x}, the CPU's {w}"
            );
        }
        println!(
            "upload_matrix_f16 {what}: {} weights bit-identical",
            want.len()
        );
    };
    for ty in TYPES {
        let n_in = if ty.block_elems() == 256 { 512 } else { 96 };
        for n_rows in [1, 37] {
            let bytes = random_table(ty, n_rows, n_in, &mut rng);
            check(
                ty,
                &bytes,
                n_in,
                &format!("{} random {n_rows}x{n_in}", ty.name()),
            );
        }
    }
    // The first matrix of each quantized type in the model's file; the random tables above
    // cover the types it lacks.
    let g = Gguf::open(&orcd_tests::model_path()).unwrap();
    let mut seen = HashSet::new();
    for t in g.tensors() {
        if t.shape.len() == 2 && t.ty.block_elems() > 1 && seen.insert(t.ty) {
            check(t.ty, g.tensor_data(t), t.shape[0] as usize, &t.name);
        }
    }
    assert!(!seen.is_empty(), "no quantized matrix in the model");
}

#[test]
fn embed_real_token_embd_on_reference_prompts() {
    let Some(dev) = gpu() else { return };
    let g = Gguf::open(&orcd_tests::model_path()).unwrap();
    let t = g.tensor("token_embd.weight").unwrap();
    let hidden = t.shape[0] as usize;
    for p in orcd_tests::ref_prompts() {
        let n = check_embed(&dev, g.tensor_data(t), t.ty, hidden, &p.ids, "token_embd");
        println!(
            "embed token_embd ({}) {} prompt: {n} elements bit-identical",
            t.ty.name(),
            p.kind
        );
    }
}

#[test]
fn embed_bad_rows_and_tokens() {
    let Some(dev) = gpu() else { return };
    // 100 elements are not whole q4_K blocks of 256; 575 bytes are not whole rows.
    let Err(err) = dev.upload_matrix(GgmlType::Q4K, &[0u8; 144 * 4], 100) else {
        panic!("q4_K rows of 100 elements");
    };
    assert_eq!(
        err.to_string(),
        "pack q4_K: 576 bytes are not whole rows of 100"
    );
    assert!(
        dev.upload_matrix(GgmlType::Q4K, &[0u8; 144 * 4 - 1], 256)
            .is_err()
    );
    // Ids beyond the table's 4 rows give NaN rows; the valid ones zeros (an all-zero block).
    let table = dev
        .upload_matrix(GgmlType::Q4K, &[0u8; 144 * 4], 256)
        .unwrap();
    let tokens = dev.upload(&[0u32, 3, 4, u32::MAX]).unwrap();
    let mut out = dev.zeros::<f32>(4 * 256).unwrap();
    dev.embed(&mut out, &table, &tokens, 4).unwrap();
    let got = dev.download(&out).unwrap();
    assert!(
        got[..512].iter().all(|v| *v == 0.0),
        "rows 0 and 3 are zeros"
    );
    assert!(
        got[512..].iter().all(|v| v.is_nan()),
        "ids 4 and u32::MAX give NaN"
    );
}

/// Elementwise sizes: FFN and hidden width, prefill-sized, and odd ones.
const ELEMS: [usize; 6] = [4864, 896, 4864 * 513, 1, 33, 100_003];

#[test]
fn silu_mul_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(15);
    for n in ELEMS {
        let mut gate: Vec<f32> = rng.vec(n).iter().map(|v| v * 16.0).collect();
        // Zero, signed zero, and near exp's overflow (e^88 is finite, e^100 is not).
        for (i, v) in [0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e-30]
            .into_iter()
            .enumerate()
        {
            if i < n {
                gate[n - 1 - i] = v;
            }
        }
        let up = rng.vec(n);
        let mut want = gate.clone();
        cpu::silu_mul(&mut want, &up);
        let mut gd = dev.upload(&gate).unwrap();
        dev.silu_mul(&mut gd, &dev.upload(&up).unwrap()).unwrap();
        let got = dev.download(&gd).unwrap();
        // e^-g by ex2.approx: its 2 ulp plus the rounding of -g·log2(e), which moves the
        // exponent by |g|·2^-24 (relative error |g|·2^-24 of e^-g); then 3 roundings on
        // each side and the CPU's own exp: within (|g| + 16)·2^-24 of the result.
        let mut worst = 0.0f32;
        for i in 0..n {
            let tol = (gate[i].abs() + 16.0) * f32::EPSILON / 2.0;
            let err = (got[i] - want[i]).abs() / want[i].abs().max(f32::MIN_POSITIVE);
            assert!(
                err <= tol,
                "silu_mul n={n} i={i}: gate {} up {}: {} vs {}",
                gate[i],
                up[i],
                got[i],
                want[i]
            );
            worst = worst.max(err / tol);
        }
        println!("silu_mul n={n}: max err = {worst:.2} of the tolerance");
    }
}

#[test]
fn add_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(16);
    for n in ELEMS {
        let (x, y) = (rng.vec(n), rng.vec(n));
        let mut want = x.clone();
        cpu::add(&mut want, &y);
        let mut xd = dev.upload(&x).unwrap();
        dev.add(&mut xd, &dev.upload(&y).unwrap()).unwrap();
        // One IEEE addition on each side: bit-identical.
        let got = dev.download(&xd).unwrap();
        assert!(
            got.iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()),
            "add n={n}"
        );
    }
    let mut short = dev.zeros::<f32>(3).unwrap();
    let err = dev
        .add(&mut short, &dev.zeros::<f32>(4).unwrap())
        .unwrap_err();
    assert_eq!(err.to_string(), "add: lengths do not match");
}

/// The GEMM on tensor cores splits every f32 operand `v` into f16 halves `hi + lo / 2^11`,
/// which carry `v` to within max(2^-22·|v|, 2^-36), and leaves out the `lo·lo` product
/// (< 2^-22 of `|x·w|`): each product is off by at most ~3·2^-22 of `|x·w|`, with random signs
/// (round to nearest), plus the f32 sums of both sides. On such data (the tests' random
/// activations) the error stays well below `MMA_TOL` of sum|x·w| (measured figures are
/// printed; the CPU emulation below gives ~5e-8, ~2e-7 with truncating MMA sums).
pub(super) const MMA_TOL: f32 = 2e-6;

/// An error bound of a product: `rel·(sum|x·w| + |bias|) + abs·(sum|x| + sum|w|)`.
#[derive(Clone, Copy)]
pub(super) struct Bound {
    pub rel: f32,
    pub abs: f32,
}

/// The tensor-core GEMM's bound (`MMA_TOL`, and 2^-35 for operands below f16's normal range).
pub(super) const MMA_BOUND: Bound = Bound {
    rel: MMA_TOL,
    abs: 1.0 / 34_359_738_368.0,
};

/// The worst error of the tensor-core GEMM's output `y = [tokens, n_out]` at the outputs `cols` (all
/// of them, or a sample of a vocabulary-sized matrix, whose full CPU product is slow) against
/// `cpu::matmul` of `x` and the weights `w32` (with `bias`): over sum|x·w| + |bias| (printed),
/// and over `bound` (the GEMM's `MMA_BOUND`: `MMA_TOL·(sum|x·w| + |bias|) + 2^-35·(sum|x| +
/// sum|w|)`, whose second term is the split's absolute error, 2^-36 per product doubled, where
/// an operand is below f16's normal range, |v| < 2^-14); it holds where the second is <= 1.
pub(super) fn mma_err(
    y: &[f32],
    x: &[f32],
    w32: &[f32],
    bias: &[f32],
    n_in: usize,
    cols: &[usize],
    bound: Bound,
) -> (f32, f32) {
    let rows = x.len() / n_in;
    let n_out = y.len() / rows;
    let w_cols: Vec<f32> = cols
        .iter()
        .flat_map(|&o| &w32[o * n_in..(o + 1) * n_in])
        .copied()
        .collect();
    let b_cols: Vec<f32> = cols.iter().map(|&o| bias[o]).collect();
    let mut want = vec![0.0; rows * cols.len()];
    cpu::matmul(&mut want, x, &w_cols, n_in, Some(&b_cols));
    let mut mag = vec![0.0; rows * cols.len()];
    cpu::matmul(&mut mag, &abs(x), &abs(&w_cols), n_in, Some(&abs(&b_cols)));
    let l1 = |v: &[f32]| -> Vec<f32> {
        v.chunks_exact(n_in)
            .map(|r| r.iter().map(|v| v.abs()).sum())
            .collect()
    };
    let (x_l1, w_l1) = (l1(x), l1(&w_cols));
    let (mut rel, mut of_bound) = (0.0f32, 0.0f32);
    for (t, x_l1) in x_l1.iter().enumerate() {
        for (j, &o) in cols.iter().enumerate() {
            let i = t * cols.len() + j;
            let err = (y[t * n_out + o] - want[i]).abs();
            let bound = bound.rel * mag[i] + bound.abs * (x_l1 + w_l1[j]);
            // NaN (an output never written or read out of bounds) must fail too.
            for (worst, e) in [
                (&mut rel, err / mag[i].max(1e-30)),
                (&mut of_bound, err / bound.max(1e-38)),
            ] {
                *worst = if e.is_nan() {
                    f32::INFINITY
                } else {
                    worst.max(e)
                };
            }
        }
    }
    (rel, of_bound)
}

/// Prefill-sized products (512 and 513 tokens: whole and cut-short 64-row tiles) on every
/// distinct (type, shape) of the model's matrices, with the matrix's own bias where it has one.
#[test]
fn matmul_q_prefill_on_real_weights() {
    let Some(dev) = gpu() else { return };
    let g = Gguf::open(&orcd_tests::model_path()).unwrap();
    let mut rng = Rng::new(21);
    each_distinct_matrix(&g, &mut rng, |t, rng, n_in, n_out, w32, bias| {
        let data = g.tensor_data(t);
        // Every output, or for the vocabulary every 61st and the last (the CPU's share).
        let cols: Vec<usize> = if n_out > 100_000 {
            (0..n_out).step_by(61).chain([n_out - 1]).collect()
        } else {
            (0..n_out).collect()
        };
        let gpu = q_matmul(&dev, data, t.ty, n_in, n_out, 0);
        for rows in [512, 513] {
            let x = rng.vec(rows * n_in);
            let y = gpu(&x, Some(bias), rows);
            let (err, of_bound) = mma_err(&y, &x, w32, bias, n_in, &cols, MMA_BOUND);
            let what = format!(
                "matmul_q {} ({}) rows={rows} {n_out}x{n_in}",
                t.name,
                t.ty.name()
            );
            println!("{what}: max err / sum|x*w| = {err:.2e} ({of_bound:.2} of the bound)");
            assert!(of_bound <= 1.0, "{what}: {err}");
        }
    });
}

/// The tensor-core GEMM at every count of K steps around its handover of steps between its
/// producer teams (up to 3, 2 shared slots each): 1 to 7 steps of 32 (n_in 8 and 40 end in a
/// part-step, whose x is zeros past n_in), then 65, for f16 and q8_0 weights, with tiles cut
/// short in tokens and outputs (1, 63, 65, 130 outputs; 2, 65, 130 tokens), against
/// `cpu::matmul` within the split's bound.
#[test]
fn matmul_tensor_core_step_counts_and_ragged_tiles() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(25);
    for (ty, n_ins) in [
        (
            GgmlType::F16,
            &[8, 32, 40, 64, 96, 128, 160, 192, 224, 2080][..],
        ),
        (GgmlType::Q8_0, &[32, 64, 96, 128, 160, 192, 224, 2080][..]),
    ] {
        for &n_in in n_ins {
            for n_out in [1, 63, 65, 130] {
                let w = random_table(ty, n_out, n_in, &mut rng);
                let w32 = quant::dequantize_to_vec(ty, &w).unwrap();
                let bias = rng.vec(n_out);
                let cols: Vec<usize> = (0..n_out).collect();
                let gpu = q_matmul(&dev, &w, ty, n_in, n_out, 0);
                for rows in [2, 65, 130] {
                    let x = rng.vec(rows * n_in);
                    let y = gpu(&x, Some(&bias), rows);
                    let (err, of_bound) = mma_err(&y, &x, &w32, &bias, n_in, &cols, MMA_BOUND);
                    let what = format!("matmul {} rows={rows} {n_out}x{n_in}", ty.name());
                    assert!(
                        of_bound <= 1.0,
                        "{what}: {err:.2e} ({of_bound:.2} of the bound)"
                    );
                }
            }
            println!("matmul {} n_in={n_in}: within the bound", ty.name());
        }
    }
}

/// Activations far from 1: large ones (|x| up to 1e3, as after some of the model's layers),
/// tiny ones (1e-6: `hi` is then an f16 subnormal, and `lo`, scaled by 2^11, carries the
/// rest), rows of each kind side by side, and values beyond f16's range (65504), which send
/// their 64×64 tiles to the f32 loop. The weights: the model's attn_q (q5_0) and the same
/// rounded to f16 (no `lo` half).
#[test]
fn matmul_large_tiny_and_out_of_range_activations() {
    let Some(dev) = gpu() else { return };
    let g = Gguf::open(&orcd_tests::model_path()).unwrap();
    let t = g.tensor("blk.0.attn_q.weight").unwrap();
    let (n_in, n_out) = (t.shape[0] as usize, t.shape[1] as usize);
    let data = g.tensor_data(t);
    let w32 = quant::dequantize_to_vec(t.ty, data).unwrap();
    let w16 = to_f16(&w32);
    let w16_32: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
    let mut rng = Rng::new(22);
    // No bias, which would hide the errors of the tiny products.
    let bias = vec![0.0; n_out];
    let cols: Vec<usize> = (0..n_out).collect();
    let rows = 200;
    let scaled =
        |rng: &mut Rng, s: f32| -> Vec<f32> { rng.vec(n_in).iter().map(|v| v * s).collect() };
    let mut cases: Vec<(&str, Vec<f32>)> = Vec::new();
    for (what, s) in [("|x| ~ 1e3", 1e3f32), ("|x| ~ 1e-6", 1e-6)] {
        cases.push((what, (0..rows).flat_map(|_| scaled(&mut rng, s)).collect()));
    }
    let mixed = (0..rows)
        .flat_map(|r| scaled(&mut rng, [1e3, 1e-6, 1.0, 3e4][r % 4]))
        .collect();
    cases.push(("rows of 1e3, 1e-6, 1, 3e4", mixed));
    // One element per row beyond f16 (rows 0-63 only, so the other tiles stay on tensor
    // cores), one far beyond.
    let mut big = rng.vec(rows * n_in);
    for r in 0..64 {
        big[r * n_in + (r * 37) % n_in] = if r == 5 { 3e30 } else { 7e4 };
    }
    cases.push(("beyond f16 in rows 0-63", big));
    let gpus = [
        ("q5_0", q_matmul(&dev, data, t.ty, n_in, n_out, 0), &w32),
        ("f16", f16_matmul(&dev, &w16, n_in, n_out), &w16_32),
    ];
    for (wname, gpu, w) in &gpus {
        for (what, x) in &cases {
            let y = gpu(x, Some(&bias), rows);
            let (err, of_bound) = mma_err(&y, x, w, &bias, n_in, &cols, MMA_BOUND);
            println!(
                "matmul {wname} attn_q rows={rows}, {what}: max err / sum|x*w| = {err:.2e} \
                 ({of_bound:.2} of the bound)"
            );
            if what.starts_with("beyond f16") {
                // Those tiles run the f32 loop, held to the f32 GEMM's tolerance: one product
                // 1e3 times the others makes every later addition round at the big sum's ulp,
                // so the error grows to ~n_in·eps of sum|x*w| (measured 3.3e-6), in the CPU
                // twin's sum too.
                assert!(err <= 1e-5, "matmul {wname}, {what}: {err}");
            } else {
                assert!(of_bound <= 1.0, "matmul {wname}, {what}: {err}");
            }
        }
    }
}

/// A CPU emulation of the tensor-core GEMM tile (`gemm_mma`, gpu-kernels/src/matmul.rs), lane
/// by lane: the staging threads' split halves stored at the kernel's swizzled offsets,
/// `ldmatrix` fed each lane's row address, and `mma.sync` taking its fragments as the PTX ISA
/// lays them out (section "Matrix Fragments for mma.m16n8k16 with floating point type"), which
/// is written here independently of the kernel's address math. A layout mistake in that math
/// makes the products garbage.
mod emulation {
    use half::f16;
    use std::array;

    const TILE: usize = 64;
    const STEP: usize = 32;
    const LO_SCALE: f32 = 2048.0;
    const TILE_BYTES: usize = 64 * 64;
    const STAGE_BYTES: usize = 4 * TILE_BYTES;

    /// How an emulated `mma.sync` rounds `c + sum of 16 exact products` to f32.
    #[derive(Clone, Copy, Debug)]
    pub enum Rounding {
        /// Exactly, then to nearest.
        Nearest,
        /// Each term cut toward zero to 24 bits below the largest term's leading bit, the
        /// sum toward zero: coarser than what has been measured on NVIDIA's tensor cores,
        /// as a worst case.
        Truncating,
    }

    fn chunk_at(r: usize, c: usize) -> usize {
        64 * r + 16 * (c ^ (r / 2 % 4))
    }

    fn split(v: f32) -> (u16, u16) {
        let hi = f16::from_f32(v);
        let lo = f16::from_f32((v - hi.to_f32()) * LO_SCALE);
        (hi.to_bits(), lo.to_bits())
    }

    fn put(smem: &mut [u8], at: usize, h: u16) {
        smem[at..at + 2].copy_from_slice(&h.to_le_bytes());
    }

    /// `ldmatrix .x4`: lane `l` gives the row address `at[l]`; word `i` of lane `l` is bytes
    /// `4·(l % 4)..+4` of the row that lane `8i + l / 4` gave.
    fn ldmatrix4(smem: &[u8], at: [usize; 32]) -> [[u32; 4]; 32] {
        array::from_fn(|l| {
            array::from_fn(|i| {
                let a = at[8 * i + l / 4] + 4 * (l % 4);
                u32::from_le_bytes(smem[a..a + 4].try_into().unwrap())
            })
        })
    }

    fn round(terms: &[f64], rounding: Rounding) -> f32 {
        let exact: f64 = terms.iter().sum();
        if !exact.is_finite() {
            return exact as f32;
        }
        match rounding {
            Rounding::Nearest => exact as f32,
            Rounding::Truncating => {
                let lead = |t: f64| ((t.to_bits() >> 52) & 0x7ff) as i32 - 1023;
                let Some(top) = terms.iter().filter(|t| **t != 0.0).map(|t| lead(*t)).max() else {
                    return 0.0;
                };
                let q = 2f64.powi(top - 23);
                let s: f64 = terms.iter().map(|t| (t / q).trunc() * q).sum();
                let f = s as f32;
                if (f as f64).abs() > s.abs() {
                    f32::from_bits(f.to_bits() - 1)
                } else {
                    f
                }
            }
        }
    }

    /// `d += a·b` on one m16n8k16 tile, the fragments as the PTX ISA lays them out: with
    /// `g = lane / 4`, `c = lane % 4`, a's words 0-3 hold A[g][2c..], A[g+8][2c..],
    /// A[g][2c+8..], A[g+8][2c+8..]; b's words B[2c..][g], B[2c+8..][g]; d's elements
    /// D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1] (the lower index in the low half).
    fn mma(d: &mut [[f32; 4]; 32], a: &[[u32; 4]; 32], b: &[[u32; 2]; 32], rounding: Rounding) {
        let h = |w: u32, i: usize| f16::from_bits((w >> (16 * i)) as u16).to_f64();
        let (mut am, mut bm, mut cm) = ([[0f64; 16]; 16], [[0f64; 8]; 16], [[0f32; 8]; 16]);
        for l in 0..32 {
            let (g, c) = (l / 4, l % 4);
            for i in 0..2 {
                am[g][2 * c + i] = h(a[l][0], i);
                am[g + 8][2 * c + i] = h(a[l][1], i);
                am[g][2 * c + 8 + i] = h(a[l][2], i);
                am[g + 8][2 * c + 8 + i] = h(a[l][3], i);
                bm[2 * c + i][g] = h(b[l][0], i);
                bm[2 * c + 8 + i][g] = h(b[l][1], i);
                cm[g][2 * c + i] = d[l][i];
                cm[g + 8][2 * c + i] = d[l][2 + i];
            }
        }
        let dm: [[f32; 8]; 16] = array::from_fn(|m| {
            array::from_fn(|n| {
                let mut terms = [0f64; 17];
                terms[0] = cm[m][n] as f64;
                for k in 0..16 {
                    terms[1 + k] = am[m][k] * bm[k][n];
                }
                round(&terms, rounding)
            })
        });
        for (l, d) in d.iter_mut().enumerate() {
            let (g, c) = (l / 4, l % 4);
            *d = [
                dm[g][2 * c],
                dm[g][2 * c + 1],
                dm[g + 8][2 * c],
                dm[g + 8][2 * c + 1],
            ];
        }
    }

    /// One warp's sums: `[m16 tile i][n8 tile j]`, fragments of the 32 lanes.
    type Sums = [[[[f32; 4]; 32]; 4]; 2];

    /// `y = x·wᵀ + bias` (`rows × n_out`) by `gemm_mma`'s algorithm on the weights `w` as
    /// `load8` gives them (f32; `w_f16`: f16 values, stored without `lo`), and whether some
    /// tile voted non-finite (the kernel then redoes it in f32; here it stays as computed).
    /// The ring of slots and the producers' order do not change what a step's slot holds, so
    /// each step is staged into one slot here, by the 128 threads of a producer team, and then
    /// multiplied by the 4 consumer warps.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_mma(
        x: &[f32],
        w: &[f32],
        w_f16: bool,
        bias: &[f32],
        rows: usize,
        n_in: usize,
        rounding: Rounding,
    ) -> (Vec<f32>, bool) {
        let n_out = bias.len();
        let mut y = vec![0.0; rows * n_out];
        let mut fallback = false;
        for (row0, col0) in (0..rows.div_ceil(TILE))
            .flat_map(|rt| (0..n_out.div_ceil(TILE)).map(move |ct| (TILE * rt, TILE * ct)))
        {
            let mut slot = vec![0u8; STAGE_BYTES];
            let zero: Sums = [[[[0.0; 4]; 32]; 4]; 2];
            let (mut main, mut cross) = (vec![zero; 4], vec![zero; 4]);
            for s in 0..n_in.div_ceil(STEP) {
                let k0 = s * STEP;
                // The 128 threads of a producer team. Past n_in, x is zeros and w the row's
                // last 8 weights again (their products vanish).
                for t in 0..128 {
                    for p in 0..4 {
                        let r = (row0 + t / 8 + 16 * p).min(rows - 1);
                        let (k, kl) = (k0 + 4 * (t % 8), 4 * (t % 8));
                        let at = chunk_at(t / 8 + 16 * p, kl / 8) + 2 * (kl % 8);
                        for j in 0..4 {
                            let v = if k < n_in { x[r * n_in + k + j] } else { 0.0 };
                            let (hi, lo) = split(v);
                            put(&mut slot, at + 2 * j, hi);
                            put(&mut slot, at + TILE_BYTES + 2 * j, lo);
                        }
                    }
                    for p in 0..2 {
                        let n = (col0 + t / 4 + 32 * p).min(n_out - 1);
                        let k = (k0 + 8 * (t % 4)).min(n_in - 8);
                        let at = 2 * TILE_BYTES + chunk_at(t / 4 + 32 * p, t % 4);
                        for j in 0..8 {
                            let (hi, lo) = split(w[n * n_in + k + j]);
                            put(&mut slot, at + 2 * j, hi);
                            if !w_f16 {
                                put(&mut slot, at + TILE_BYTES + 2 * j, lo);
                            }
                        }
                    }
                }
                // The 4 consumer warps' products, over both k16 halves of the step.
                for (warp, half) in (0..4).flat_map(|warp| (0..2).map(move |h| (warp, h))) {
                    let (qm, qn) = (32 * (warp / 2), 32 * (warp % 2));
                    let frags = |tile: usize, at: &dyn Fn(usize) -> usize| {
                        ldmatrix4(&slot, array::from_fn(|l| tile * TILE_BYTES + at(l)))
                    };
                    let x_at = |i: usize| {
                        move |l: usize| chunk_at(qm + 16 * i + l % 16, 2 * half + l / 16)
                    };
                    let w_at = |j: usize| {
                        move |l: usize| {
                            chunk_at(qn + 16 * j + l % 8 + 8 * (l / 16), 2 * half + l / 8 % 2)
                        }
                    };
                    let x_hi = [0, 1].map(|i| frags(0, &x_at(i)));
                    let x_lo = [0, 1].map(|i| frags(1, &x_at(i)));
                    let w_hi = [0, 1].map(|j| frags(2, &w_at(j)));
                    let w_lo = [0, 1].map(|j| frags(3, &w_at(j)));
                    let b = |f: &[[u32; 4]; 32], j: usize| -> [[u32; 2]; 32] {
                        array::from_fn(|l| [f[l][2 * (j % 2)], f[l][2 * (j % 2) + 1]])
                    };
                    for i in 0..2 {
                        for j in 0..4 {
                            mma(
                                &mut main[warp][i][j],
                                &x_hi[i],
                                &b(&w_hi[j / 2], j),
                                rounding,
                            );
                            mma(
                                &mut cross[warp][i][j],
                                &x_lo[i],
                                &b(&w_hi[j / 2], j),
                                rounding,
                            );
                        }
                    }
                    if !w_f16 {
                        for i in 0..2 {
                            for j in 0..4 {
                                mma(
                                    &mut cross[warp][i][j],
                                    &x_hi[i],
                                    &b(&w_lo[j / 2], j),
                                    rounding,
                                );
                            }
                        }
                    }
                }
            }
            // The consumer writes its fragments out.
            for warp in 0..4 {
                let (qm, qn) = (32 * (warp / 2), 32 * (warp % 2));
                for (l, i, j, e) in (0..32).flat_map(|l| {
                    (0..2).flat_map(move |i| {
                        (0..4).flat_map(move |j| (0..4).map(move |e| (l, i, j, e)))
                    })
                }) {
                    let v = cross[warp][i][j][l][e].mul_add(1.0 / LO_SCALE, main[warp][i][j][l][e]);
                    fallback |= !v.is_finite();
                    let (r, c) = (
                        row0 + qm + 16 * i + l / 4 + 8 * (e / 2),
                        col0 + qn + 8 * j + 2 * (l % 4) + e % 2,
                    );
                    if r < rows && c < n_out {
                        y[r * n_out + c] = v + bias[c];
                    }
                }
            }
        }
        (y, fallback)
    }
}

/// The emulated tensor-core tile against `cpu::matmul`: random shapes with tiles cut short
/// in rows, outputs and k (n_in = 104: three K steps and a quarter), f32 and f16 weights,
/// activations of 1, 1e3 and 1e-6; then the first 64 outputs of each distinct (type, shape) of
/// the model's matrices, with both rounding models of the MMA. An operand beyond f16 must
/// make its tile vote non-finite. Runs on the CPU (no GPU needed).
#[test]
fn mma_tile_emulation_matches_cpu() {
    use emulation::Rounding::{Nearest, Truncating};
    let mut rng = Rng::new(23);
    let (rows, n_in, n_out) = (70, 104, 72);
    let bias = rng.vec(n_out);
    let cols: Vec<usize> = (0..n_out).collect();
    for (w_f16, scale) in [
        (false, 1.0f32),
        (true, 1.0),
        (false, 1e3),
        (false, 1e-6),
        (false, 1e-4),
        (false, 1e-5),
        (true, 1e-6),
    ] {
        let w: Vec<f32> = rng.vec(n_out * n_in);
        let w = if w_f16 {
            to_f16(&w).iter().map(|v| v.to_f32()).collect()
        } else {
            w
        };
        let x: Vec<f32> = rng.vec(rows * n_in).iter().map(|v| v * scale).collect();
        // A bias of the products' size, so that it does not hide their error.
        let bias: Vec<f32> = bias.iter().map(|b| b * scale).collect();
        let (y, fallback) = emulation::gemm_mma(&x, &w, w_f16, &bias, rows, n_in, Nearest);
        let (err, of_bound) = mma_err(&y, &x, &w, &bias, n_in, &cols, MMA_BOUND);
        println!(
            "emulated mma {rows}x{n_out}x{n_in} f16 weights {w_f16}, |x| ~ {scale:e}: \
             max err / sum|x*w| = {err:.2e} ({of_bound:.2} of the bound)"
        );
        assert!(!fallback && of_bound <= 1.0, "emulated mma: {err}");
    }
    // Beyond f16's range: the tile votes for the f32 loop.
    let mut x = rng.vec(rows * n_in);
    x[3 * n_in + 5] = 7e4;
    let w = rng.vec(n_out * n_in);
    assert!(emulation::gemm_mma(&x, &w, false, &bias, rows, n_in, Nearest).1);

    let g = Gguf::open(&orcd_tests::model_path()).unwrap();
    let mut seen = HashSet::new();
    for t in g.tensors().iter().filter(|t| t.shape.len() == 2) {
        if !seen.insert((t.ty, t.shape.clone())) {
            continue;
        }
        let n_in = t.shape[0] as usize;
        let n_out = 64;
        let w = quant::dequantize_to_vec(
            t.ty,
            &g.tensor_data(t)[..n_out * t.ty.row_bytes(n_in).unwrap()],
        )
        .unwrap();
        let bias = rng.vec(n_out);
        let x = rng.vec(64 * n_in);
        let cols: Vec<usize> = (0..n_out).collect();
        for rounding in [Nearest, Truncating] {
            let (y, _) = emulation::gemm_mma(&x, &w, false, &bias, 64, n_in, rounding);
            let (err, of_bound) = mma_err(&y, &x, &w, &bias, n_in, &cols, MMA_BOUND);
            println!(
                "emulated mma {} ({}) 64 rows x 64 outputs x {n_in}, {rounding:?}: \
                 max err / sum|x*w| = {err:.2e} ({of_bound:.2} of the bound)",
                t.name,
                t.ty.name()
            );
            assert!(
                of_bound <= 1.0,
                "emulated mma {} {rounding:?}: {err}",
                t.name
            );
        }
    }
}

/// The tensor-core GEMM's handover of K steps between its producer teams and its consumer
/// (`gemm_mma`, gpu-kernels/src/matmul.rs), as a model: team `p` of `T` stages steps
/// `p, p + T, ...` into its own 2 slots in turn, each slot with a FULL and an EMPTY named
/// barrier that completes when both sides (the team's 128 threads and the consumer's 128) have
/// come, `bar.arrive` marking the arrival and `bar.sync` also waiting for completion. The team
/// waits on EMPTY from its third step on and arrives on FULL; the consumer waits on FULL, reads
/// the step and arrives on EMPTY only when the team will wait for it (step + 2T < steps). Run
/// under random interleavings for 1 to 3 teams and 1 to 13 steps: nothing may deadlock, the
/// consumer must read every step in order from its slot, no slot may be overwritten before it
/// was read, and every barrier must end complete (a kernel must not exit with threads counted
/// on a barrier). Runs on the CPU.
#[test]
fn mma_slot_handover_never_deadlocks_or_races() {
    const TEAM_SLOTS: usize = 2;
    #[derive(Clone, Copy)]
    enum Op {
        Arrive(usize),
        Sync(usize),
        Write(usize, usize),
        Read(usize, usize),
    }
    let mut rng = Rng::new(24);
    for teams in 1..=3 {
        let slots = TEAM_SLOTS * teams;
        let slot = |s: usize| TEAM_SLOTS * (s % teams) + s / teams % TEAM_SLOTS;
        // Barrier ids: FULL then EMPTY of each slot.
        let (full, empty) = (|s: usize| slot(s), |s: usize| slots + slot(s));
        for steps in 1..=13 {
            // Each side's program, as the kernel runs it.
            let mut programs = vec![];
            let mut consumer = vec![];
            for s in 0..steps {
                consumer.push(Op::Sync(full(s)));
                consumer.push(Op::Read(slot(s), s));
                if s + slots < steps {
                    consumer.push(Op::Arrive(empty(s)));
                }
            }
            programs.push(consumer);
            for p in 0..teams {
                let mut team = vec![];
                for (j, s) in (p..steps).step_by(teams).enumerate() {
                    if j >= TEAM_SLOTS {
                        team.push(Op::Sync(empty(s)));
                    }
                    team.push(Op::Write(slot(s), s));
                    team.push(Op::Arrive(full(s)));
                }
                programs.push(team);
            }
            for _ in 0..50 {
                // Per barrier: the sides counted in the current generation, and the
                // generations completed. Per side: next op, and the generation it waits for.
                let (mut count, mut done) = (vec![0; 2 * slots], vec![0; 2 * slots]);
                let mut at = vec![0; programs.len()];
                let mut waits: Vec<Option<(usize, usize)>> = vec![None; programs.len()];
                // Per slot: the step it holds and whether it was read.
                let mut held: Vec<(Option<usize>, bool)> = vec![(None, true); slots];
                loop {
                    let runnable: Vec<usize> = (0..programs.len())
                        .filter(|&u| at[u] < programs[u].len())
                        .filter(|&u| waits[u].is_none_or(|(b, g)| done[b] > g))
                        .collect();
                    if runnable.is_empty() {
                        break;
                    }
                    let pick = (rng.next_f32() + 1.0) / 2.0 * runnable.len() as f32;
                    let u = runnable[pick as usize % runnable.len()];
                    if waits[u].take().is_some() {
                        at[u] += 1;
                        continue;
                    }
                    match programs[u][at[u]] {
                        Op::Arrive(b) | Op::Sync(b) => {
                            let generation = done[b];
                            count[b] += 1;
                            if count[b] == 2 {
                                (count[b], done[b]) = (0, done[b] + 1);
                            }
                            if matches!(programs[u][at[u]], Op::Sync(_)) {
                                waits[u] = Some((b, generation));
                                continue;
                            }
                        }
                        Op::Write(k, s) => {
                            assert!(held[k].1, "T={teams} steps={steps}: slot {k} overwritten");
                            held[k] = (Some(s), false);
                        }
                        Op::Read(k, s) => {
                            assert_eq!(held[k].0, Some(s), "T={teams} steps={steps}: slot {k}");
                            held[k].1 = true;
                        }
                    }
                    at[u] += 1;
                }
                assert!(
                    (0..programs.len()).all(|u| at[u] == programs[u].len()),
                    "T={teams} steps={steps}: deadlock at {at:?}"
                );
                assert!(count.iter().all(|&c| c == 0), "T={teams} steps={steps}");
            }
        }
    }
}
