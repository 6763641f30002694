//! matmul_f16 and matmul_q (GEMV and tiled GEMM), embed, silu_mul and add against their CPU
//! twins.
use half::f16;
use orcd::cpu;
use orcd::cuda::Device;
use orcd::gguf::Gguf;
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

fn abs(v: &[f32]) -> Vec<f32> {
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

/// `matmul_f16` with the f16 weights `w` `[n_out, n_in]`.
fn f16_matmul<'a>(dev: &'a Device, w: &[f16], n_in: usize, n_out: usize) -> GpuMatmul<'a> {
    let wd = dev.upload(w).unwrap();
    Box::new(move |x, bias, rows| {
        let (xd, bd) = (dev.upload(x).unwrap(), bias.map(|b| dev.upload(b).unwrap()));
        let mut y = dev.zeros::<f32>(rows * n_out).unwrap();
        dev.matmul_f16(&mut y, &xd, &wd, bd.as_ref(), rows, n_in, n_out)
            .unwrap();
        dev.download(&y).unwrap()
    })
}

/// `matmul_q` with the weights `w`, the file bytes of a `[n_out, n_in]` tensor of type `ty`;
/// `x` starts `x_off` floats into its device buffer.
fn q_matmul<'a>(
    dev: &'a Device,
    w: &[u8],
    ty: GgmlType,
    n_in: usize,
    n_out: usize,
    x_off: usize,
) -> GpuMatmul<'a> {
    let wd = dev.upload(w).unwrap();
    Box::new(move |x, bias, rows| {
        let mut xp = vec![0.0; x_off];
        xp.extend_from_slice(x);
        let (xd, bd) = (
            dev.upload(&xp).unwrap(),
            bias.map(|b| dev.upload(b).unwrap()),
        );
        let mut y = dev.zeros::<f32>(rows * n_out).unwrap();
        dev.matmul_q(
            &mut y,
            &xd.slice(x_off..),
            &wd,
            ty,
            bd.as_ref(),
            rows,
            n_in,
            n_out,
        )
        .unwrap();
        dev.download(&y).unwrap()
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
fn matmul_f16_unaligned_views_and_bad_shapes() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(13);
    let (n_out, n_in) = (40, 896);
    // Views that start `x_off` floats and `w_off` halves into their buffers: x 4-byte
    // aligned and w 2-byte aligned (every narrow path), then x aligned and w 4-byte aligned
    // (the GEMV's pairs of halves).
    for (x_off, w_off) in [(1, 1), (0, 2)] {
        let w = to_f16(&rng.vec(w_off + n_out * n_in));
        let wd = dev.upload(&w).unwrap();
        let wv = wd.slice(w_off..);
        let w32: Vec<f32> = w[w_off..].iter().map(|v| v.to_f32()).collect();
        for rows in [1, 2] {
            let x = rng.vec(x_off + rows * n_in);
            let xd = dev.upload(&x).unwrap();
            let x = &x[x_off..];
            let mut want = vec![0.0; rows * n_out];
            cpu::matmul(&mut want, x, &w32, n_in, None);
            let mut mag = vec![0.0; rows * n_out];
            cpu::matmul(&mut mag, &abs(x), &abs(&w32), n_in, None);
            let mut y = dev.zeros::<f32>(rows * n_out).unwrap();
            dev.matmul_f16(&mut y, &xd.slice(x_off..), &wv, None, rows, n_in, n_out)
                .unwrap();
            let got = dev.download(&y).unwrap();
            let mut worst = 0.0f32;
            for i in 0..got.len() {
                let err = (got[i] - want[i]).abs() / mag[i].max(1e-30);
                worst = if err.is_nan() {
                    f32::INFINITY
                } else {
                    worst.max(err)
                };
            }
            println!(
                "matmul_f16 x+{x_off} w+{w_off} rows={rows}: max err / sum|x*w| = {worst:.2e}"
            );
            assert!(
                worst < MATMUL_TOL,
                "matmul_f16 x+{x_off} w+{w_off} rows={rows}: {worst}"
            );
        }
    }
    // Shapes that do not fit are errors, not launches.
    let (x, w) = (
        dev.zeros::<f32>(n_in).unwrap(),
        dev.zeros::<f16>(n_out * n_in).unwrap(),
    );
    let mut y = dev.zeros::<f32>(n_out).unwrap();
    let err = dev
        .matmul_f16(&mut y, &x, &w, None, 1, n_in + 1, n_out)
        .unwrap_err();
    assert_eq!(err.to_string(), "matmul_f16: shapes do not match");
    let short_bias = dev.upload(&[0.0f32; 3]).unwrap();
    assert!(
        dev.matmul_f16(&mut y, &x, &w, Some(&short_bias), 1, n_in, n_out)
            .is_err()
    );
    // Two tokens need 2·n_in of x and 2·n_out of y.
    assert!(
        dev.matmul_f16(&mut y, &x, &w, None, 2, n_in, n_out)
            .is_err()
    );
}

/// Every weight type the engine reads.
const TYPES: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

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
/// `quant::dequantize` exactly (compared as floats: a weight of -0 may come out +0).
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
            let wd = dev.upload(&w).unwrap();
            // The GEMM with all n_in one-hot tokens (x the identity): y = w transposed.
            let mut x = vec![0.0f32; n_in * n_in];
            for k in 0..n_in {
                x[k * n_in + k] = 1.0;
            }
            let mut y = dev.zeros::<f32>(n_in * n_out).unwrap();
            let xd = dev.upload(&x).unwrap();
            dev.matmul_q(&mut y, &xd, &wd, ty, None, n_in, n_in, n_out)
                .unwrap();
            let got = dev.download(&y).unwrap();
            for (k, o) in (0..n_in).flat_map(|k| (0..n_out).map(move |o| (k, o))) {
                let (g, want) = (got[k * n_out + o], w32[o * n_in + k]);
                assert!(g == want, "gemm {} [{o}, {k}]: {g} vs {want}", ty.name());
            }
            // The GEMV for a few tokens: the first and last element of groups and blocks.
            for k in [0, 1, 7, 8, 31, 32, 95, n_in - 1]
                .into_iter()
                .filter(|&k| k < n_in)
            {
                let xd = dev.upload(&x[k * n_in..(k + 1) * n_in]).unwrap();
                let mut y = dev.zeros::<f32>(n_out).unwrap();
                dev.matmul_q(&mut y, &xd, &wd, ty, None, 1, n_in, n_out)
                    .unwrap();
                let got = dev.download(&y).unwrap();
                for (o, g) in got.iter().enumerate() {
                    let want = w32[o * n_in + k];
                    assert!(*g == want, "gemv {} [{o}, {k}]: {g} vs {want}", ty.name());
                }
            }
            println!(
                "matmul_q {} 33x{n_in}: one-hot tokens give the exact weights",
                ty.name()
            );
        }
    }
}

#[test]
fn matmul_q_on_real_weights() {
    let Some(dev) = gpu() else { return };
    let g = Gguf::open(&orcd_tests::model_path()).unwrap();
    let mut rng = Rng::new(18);
    let mut seen = HashSet::new();
    // The first matrix of every distinct (type, shape) in the file: attn_q/k/output, ffn_gate/up
    // and token_embd (q5_0), attn_v and output (q8_0), ffn_down (q4_K or q6_K by layer).
    for t in g.tensors().iter().filter(|t| t.shape.len() == 2) {
        if !seen.insert((t.ty, t.shape.clone())) {
            continue;
        }
        // ggml order: shape[0] is the row length.
        let (n_in, n_out) = (t.shape[0] as usize, t.shape[1] as usize);
        let data = g.tensor_data(t);
        let w32 = quant::dequantize_to_vec(t.ty, data).unwrap();
        // The matrix's own bias (attn_q/k/v), else a random one.
        let bias = match g.tensor(&t.name.replace(".weight", ".bias")) {
            Ok(b) => quant::dequantize_to_vec(b.ty, g.tensor_data(b)).unwrap(),
            Err(_) => rng.vec(n_out),
        };
        let gpu = q_matmul(&dev, data, t.ty, n_in, n_out, 0);
        for rows in [1, 47] {
            // The vocabulary-sized ones only for decode: their CPU twin is slow.
            if n_out > 100_000 && rows > 1 {
                continue;
            }
            let err = matmul_err(&mut rng, &gpu, &w32, &bias, n_in, rows);
            let what = format!(
                "matmul_q {} ({}) rows={rows} {n_out}x{n_in}",
                t.name,
                t.ty.name()
            );
            println!("{what}: max err / sum|x*w| = {err:.2e}");
            assert!(err < MATMUL_TOL, "{what}: {err}");
        }
    }
    let types: HashSet<GgmlType> = seen.iter().map(|(ty, _)| *ty).collect();
    assert!(
        [GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K]
            .iter()
            .all(|ty| types.contains(ty)),
        "the model's matrices are q5_0, q8_0, q4_K and q6_K: {types:?}"
    );
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
    let ty = GgmlType::Q8_0;
    let row_bytes = ty.row_bytes(n_in).unwrap();
    let (x, w) = (
        dev.zeros::<f32>(2 * n_in).unwrap(),
        dev.zeros::<u8>(16 + n_out * row_bytes).unwrap(),
    );
    let wv = w.slice(..n_out * row_bytes);
    let mut y = dev.zeros::<f32>(n_out).unwrap();
    // Rows that are not whole blocks.
    let err = dev
        .matmul_q(&mut y, &x, &wv, GgmlType::Q4K, None, 1, 100, n_out)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "matmul_q: rows of 100 are not a whole number of 256-element q4_K blocks"
    );
    // Weights that are not n_out rows, a bias that is not n_out long, too few rows of x or y.
    let err = dev
        .matmul_q(&mut y, &x, &wv, ty, None, 1, n_in, n_out + 1)
        .unwrap_err();
    assert_eq!(err.to_string(), "matmul_q: shapes do not match");
    let short_bias = dev.upload(&[0.0f32; 3]).unwrap();
    assert!(
        dev.matmul_q(&mut y, &x, &wv, ty, Some(&short_bias), 1, n_in, n_out)
            .is_err()
    );
    assert!(
        dev.matmul_q(&mut y, &x, &wv, ty, None, 3, n_in, n_out)
            .is_err()
    );
    assert!(
        dev.matmul_q(&mut y, &x, &wv, ty, None, 2, n_in, n_out)
            .is_err(),
        "2 tokens need 2·n_out of y"
    );
    // Weights that do not start 16-byte aligned: q8_0 blocks are 34 bytes.
    let err = dev
        .matmul_q(
            &mut y,
            &x,
            &w.slice(2..2 + n_out * row_bytes),
            ty,
            None,
            1,
            n_in,
            n_out,
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "matmul_q: the weights must start 16-byte aligned"
    );
    // The same for embed's table: 10 rows of one q8_0 block from byte 34 on.
    let tokens = dev.upload(&[0u32]).unwrap();
    let err = dev
        .embed(&mut y, &w.slice(34..34 * 11), ty, &tokens, 1, 32)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "embed: the table must start 16-byte aligned"
    );
}

/// A table of `n_rows` rows of `hidden` elements of `ty`: random bytes, with every block's
/// f16 scales (d, and dmin for the K types) replaced by sane random values in ±0.1, and the
/// plain float types filled with random finite values.
fn random_table(ty: GgmlType, n_rows: usize, hidden: usize, rng: &mut Rng) -> Vec<u8> {
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
/// differently). Returns how many elements were compared.
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
    let (td, kd) = (dev.upload(table).unwrap(), dev.upload(tokens).unwrap());
    dev.embed(&mut out, &td, ty, &kd, tokens.len(), hidden)
        .unwrap();
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
    let table = dev.zeros::<u8>(144 * 4).unwrap();
    let tokens = dev.upload(&[0u32, 3, 4, u32::MAX]).unwrap();
    let mut out = dev.zeros::<f32>(4 * 256).unwrap();
    // 100 elements are not whole q4_K blocks of 256.
    let err = dev
        .embed(&mut out, &table, GgmlType::Q4K, &tokens, 4, 100)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "embed: rows of 100 are not a whole number of 256-element q4_K blocks"
    );
    // A table that is not whole rows.
    assert!(
        dev.embed(&mut out, &table.slice(1..), GgmlType::Q4K, &tokens, 4, 256)
            .is_err()
    );
    // Ids beyond the table's 4 rows give NaN rows; the valid ones zeros (an all-zero block).
    dev.embed(&mut out, &table, GgmlType::Q4K, &tokens, 4, 256)
        .unwrap();
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
