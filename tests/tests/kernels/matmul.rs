//! matmul_f16 (GEMV and tiled GEMM), embed, silu_mul and add against their CPU twins.
use half::f16;
use orcd::cpu;
use orcd::cuda::Device;
use orcd::gguf::Gguf;
use orcd::quant::{self, GgmlType};
use orcd_tests::{Rng, gpu};

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

/// `matmul_f16` against `cpu::matmul` (on the weights widened to f32) for `rows` random
/// tokens, with and without `bias`; returns the worst error over both.
fn matmul_err(
    dev: &Device,
    rng: &mut Rng,
    w: &[f16],
    bias: &[f32],
    n_in: usize,
    rows: usize,
) -> f32 {
    let n_out = bias.len();
    let w32: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    let x = rng.vec(rows * n_in);
    // The error scale: sum_i |x[t, i]·w[o, i]|.
    let mut mag = vec![0.0; rows * n_out];
    cpu::matmul(&mut mag, &abs(&x), &abs(&w32), n_in, None);
    let (xd, wd, bd) = (
        dev.upload(&x).unwrap(),
        dev.upload(w).unwrap(),
        dev.upload(bias).unwrap(),
    );
    let mut worst = 0.0f32;
    for with_bias in [false, true] {
        let b = with_bias.then_some(bias);
        let mut want = vec![0.0; rows * n_out];
        cpu::matmul(&mut want, &x, &w32, n_in, b);
        let mut y = dev.zeros::<f32>(rows * n_out).unwrap();
        let bd = with_bias.then_some(&bd);
        dev.matmul_f16(&mut y, &xd, &wd, bd, rows, n_in, n_out)
            .unwrap();
        let got = dev.download(&y).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let scale = mag[i]
                + if with_bias {
                    bias[i % n_out].abs()
                } else {
                    0.0
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
        let bias = rng.vec(n_out);
        for rows in ROWS {
            // The vocabulary projection only for decode and a short prompt: its CPU twin is slow.
            if n_out == 151936 && !matches!(rows, 1 | 7) {
                continue;
            }
            let err = matmul_err(&dev, &mut rng, &w, &bias, n_in, rows);
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
        // Without a bias tensor, a random one (matmul_err runs with and without it anyway).
        let bias = bias.map_or_else(|| rng.vec(n_out), f32_tensor);
        for &rows in rows_list {
            let err = matmul_err(&dev, &mut rng, &w, &bias, n_in, rows);
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
    let types = [
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
    let n_rows = 37;
    // First, last, repeated and middle rows.
    let tokens = [0u32, 36, 5, 5, 17, 36, 1, 30, 0];
    for ty in types {
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
