//! rope_neox, kv_append and attention (decode and prefill) against their CPU twins, plus CPU
//! runs of the kernels' algorithms (table rotation, tiled online softmax) against the twins.
use cudarc::driver::CudaSlice;
use orcd::cpu;
use orcd::gguf::Gguf;
use orcd::quant::dequantize_to_vec;
use orcd_tests::{Rng, gpu, model_path, ref_prompts};

/// The random cases' attention shape, the 0.5B model's: 14 query heads, 2 kv heads, head dim
/// 64, rope theta 1e6. The real-model cases take the shape of the model under test.
const N_HEADS: usize = 14;
const N_KV: usize = 2;
const HEAD_DIM: usize = 64;
const THETA: f32 = 1e6;
/// The random cases' `(n_heads, n_kv, head_dim)`.
const SHAPE: Shape = (N_HEADS, N_KV, HEAD_DIM);

/// `(n_heads, n_kv, head_dim)` of an attention.
type Shape = (usize, usize, usize);

/// Attention's tolerance: max |gpu - cpu| <= TOL * (1 + |cpu|). The two differ in the order
/// of the 64-term dot products (~1e-5 absolute on scores of spread ~4: ~2e-6 relative on the
/// weights), in ex2.approx (2^-22 relative, plus the rounding of x*log2(e), ~|x|*6e-8 for
/// |x| <= ~40) and in the order of the softmax sums over up to 8192 keys (~sqrt(n)*6e-8);
/// the prefill kernel's tensor-core products of f16 halves (`split16`) add ~2^-22 relative per
/// product term. The output is a convex combination of v (|v| <= 2), so each is well below
/// 2e-5; the kernels' algorithms run on the CPU (`online_softmax_algorithms_match_cpu`)
/// measure 1e-6..9e-6 (the most at 8192 keys), also on the 0.5B model's layer 0 with scores
/// up to ~1500.
const TOL: f32 = 2e-5;

/// The largest |score| for which `TOL` holds (the 0.5B's layer 0 reaches it). A score's
/// rounding grows with its magnitude, in the kernels and in any f32 reference alike (the CPU
/// twin too: against exact attention it needs more than `TOL` on the 1.5B's layer 0), and it
/// is what moves the output; so over larger scores the tolerance grows in proportion
/// (`real_tol`), and the real-model cases hold the kernels to exact (f64) attention.
const TOL_SCORE: f32 = 1500.0;

/// The tolerance of an attention over scores up to `max_score` (see `TOL_SCORE`).
fn real_tol(max_score: f32) -> f32 {
    TOL * (max_score / TOL_SCORE).max(1.0)
}

/// Uniform in [-scale, scale): scale 3.5 has the standard deviation of N(0,1)*2.
fn rand(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    rng.vec(n).into_iter().map(|v| v * scale).collect()
}

/// max |got - want| / (1 + |want|).
fn max_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0.0, |a: f32, e| {
            if a.is_nan() || e.is_nan() {
                f32::NAN
            } else {
                a.max(e)
            }
        })
}

#[test]
fn rope_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(11);
    for head_dim in [HEAD_DIM, 128] {
        let table = dev.rope_table(4096, head_dim, THETA).unwrap();
        for n_heads in [N_HEADS, N_KV] {
            for rows in [1, 37] {
                for pos in [0, 5, 4000] {
                    let row_len = n_heads * head_dim;
                    let x = rand(&mut rng, rows * row_len, 3.5);
                    let mut want = x.clone();
                    cpu::rope_neox(&mut want, row_len, pos, head_dim, THETA);
                    let mut xd = dev.upload(&x).unwrap();
                    let posd = dev.upload(&[pos as u32]).unwrap();
                    dev.rope_neox(&mut xd, &posd, &table, n_heads, head_dim)
                        .unwrap();
                    let got = dev.download(&xd).unwrap();
                    // Same table values, same f32 products and difference (mul.rn/sub.rn: no
                    // FMA contraction), so exactly equal is expected; 1e-6 would still admit
                    // an FMA's different rounding.
                    let err = max_err(&got, &want);
                    let exact = got
                        .iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits());
                    println!(
                        "rope hd={head_dim} heads={n_heads} rows={rows} pos={pos}: \
                         err {err:.2e} bit-exact {exact}"
                    );
                    assert!(
                        err <= 1e-6,
                        "rope hd={head_dim} heads={n_heads} rows={rows} pos={pos}: {err}"
                    );
                }
            }
        }
    }
    // Odd head_dim and rows past the table's end are errors, not launches.
    assert!(dev.rope_table(16, 63, THETA).is_err());
    let table = dev.rope_table(4, HEAD_DIM, THETA).unwrap();
    let mut x = dev.zeros::<f32>(5 * HEAD_DIM).unwrap();
    let posd = dev.upload(&[0u32]).unwrap();
    assert!(dev.rope_neox(&mut x, &posd, &table, 1, HEAD_DIM).is_err());
}

/// The GPU's rotation, done on the CPU: read (cos, sin) from the table; must equal
/// `cpu::rope_neox` bit for bit, which is what makes the GPU exact.
#[test]
fn rope_table_rotation_is_rope_neox() {
    let mut rng = Rng::new(12);
    let (max_pos, head_dim, half) = (4100, HEAD_DIM, HEAD_DIM / 2);
    let table = cpu::rope_table(max_pos, head_dim, THETA);
    assert_eq!(table.len(), max_pos * head_dim);
    for pos in [0, 1, 5, 4000, 4099] {
        let x = rand(&mut rng, N_KV * head_dim, 3.5);
        let mut want = x.clone();
        cpu::rope_neox(&mut want, x.len(), pos, head_dim, THETA);
        let mut got = x;
        for head in got.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (cos, sin) = (table[2 * (pos * half + i)], table[2 * (pos * half + i) + 1]);
                let (a, b) = (head[i], head[i + half]);
                (head[i], head[i + half]) = (a * cos - b * sin, a * sin + b * cos);
            }
        }
        assert!(
            got.iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()),
            "pos {pos}"
        );
    }
    // Position 0 is the identity rotation.
    assert!(table[..head_dim].chunks(2).all(|cs| cs == [1.0, 0.0]));
}

#[test]
fn kv_append_is_exact() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(13);
    let (max_pos, kv_dim) = (64, N_KV * HEAD_DIM);
    let mut kc = rng.vec(max_pos * kv_dim);
    let mut vc = rng.vec(max_pos * kv_dim);
    let (mut kd, mut vd) = (dev.upload(&kc).unwrap(), dev.upload(&vc).unwrap());
    // A prefill of 37 rows at 0, one of 5 at 37, decodes at 42 and at the last row.
    for (pos, rows) in [(0, 37), (37, 5), (42, 1), (63, 1)] {
        let (k, v) = (rng.vec(rows * kv_dim), rng.vec(rows * kv_dim));
        kc[pos * kv_dim..][..k.len()].copy_from_slice(&k);
        vc[pos * kv_dim..][..v.len()].copy_from_slice(&v);
        let posd = dev.upload(&[pos as u32]).unwrap();
        let (kn, vn) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
        dev.kv_append(&mut kd, &mut vd, &kn, &vn, &posd, kv_dim)
            .unwrap();
        assert_eq!(
            dev.download(&kd).unwrap(),
            kc,
            "k cache after pos {pos} rows {rows}"
        );
        assert_eq!(
            dev.download(&vd).unwrap(),
            vc,
            "v cache after pos {pos} rows {rows}"
        );
    }
    // More rows than the cache holds is an error, not a launch.
    let big = dev.zeros::<f32>((max_pos + 1) * kv_dim).unwrap();
    let posd = dev.upload(&[0u32]).unwrap();
    assert!(
        dev.kv_append(&mut kd, &mut vd, &big, &big, &posd, kv_dim)
            .is_err()
    );
}

/// The caches as the forward pass leaves them for one attention call: `pos` earlier rows of
/// `k, v = [pos + rows, kv_dim]`, then this call's rows appended with `kv_append`. Rows past
/// `pos + rows` are NaN, so reading one shows up in the output. (k cache, v cache, pos.)
fn caches(
    dev: &orcd::cuda::Device,
    k: &[f32],
    v: &[f32],
    pos: usize,
    rows: usize,
    kv_dim: usize,
) -> (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<u32>) {
    let max_pos = pos + rows + 3;
    let prefix = |c: &[f32]| {
        let mut cache = vec![f32::NAN; max_pos * kv_dim];
        cache[..pos * kv_dim].copy_from_slice(&c[..pos * kv_dim]);
        dev.upload(&cache).unwrap()
    };
    let (mut kc, mut vc) = (prefix(k), prefix(v));
    let posd = dev.upload(&[pos as u32]).unwrap();
    let (kn, vn) = (
        dev.upload(&k[pos * kv_dim..]).unwrap(),
        dev.upload(&v[pos * kv_dim..]).unwrap(),
    );
    dev.kv_append(&mut kc, &mut vc, &kn, &vn, &posd, kv_dim)
        .unwrap();
    (kc, vc, posd)
}

/// Attention of q's rows over `caches` for `(n_heads, n_kv, head_dim)`: by `attention`, or
/// with `decode` (one row) by `attention_decode` into fresh sums, normalised.
fn gpu_attention(
    dev: &orcd::cuda::Device,
    (q, k, v): (&[f32], &[f32], &[f32]),
    pos: usize,
    (n_heads, n_kv, head_dim): (usize, usize, usize),
    decode: bool,
) -> Vec<f32> {
    let rows = q.len() / (n_heads * head_dim);
    let (kc, vc, posd) = caches(dev, k, v, pos, rows, n_kv * head_dim);
    let qd = dev.upload(q).unwrap();
    if decode {
        let mut sums = dev.attention_sums(n_heads, head_dim).unwrap();
        dev.attention_decode(&mut sums, &qd, &kc, &vc, &posd, n_kv)
            .unwrap();
        return sums.output(dev).unwrap();
    }
    let mut out = dev.zeros::<f32>(q.len()).unwrap();
    dev.attention(
        &mut out, &qd, &kc, &vc, &posd, rows, n_heads, n_kv, head_dim,
    )
    .unwrap();
    dev.download(&out).unwrap()
}

/// Random q, k, v for `rows` queries at `pos` and the CPU twin's output.
fn case(rng: &mut Rng, pos: usize, rows: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let kv_dim = N_KV * HEAD_DIM;
    let q = rand(rng, rows * N_HEADS * HEAD_DIM, 3.5);
    let k = rand(rng, (pos + rows) * kv_dim, 3.5);
    let v = rand(rng, (pos + rows) * kv_dim, 2.0);
    let mut want = vec![0.0; q.len()];
    cpu::attention(&mut want, &q, &k, &v, pos, N_HEADS, N_KV, HEAD_DIM);
    (q, k, v, want)
}

/// The decode kernel splits the keys into slices of whole 32-key tiles, at most 64 of them
/// (1 key: one slice; 257: nine; 2048: 64 of 32; 2049: 33 of 64; 8192: 64 of 128, four
/// tiles; 10240: 64 of 160, five tiles, the last key in the fifth), each slice adding its
/// share into the sums, which `AttentionSums::output` normalises. Shapes: the
/// model's; 20 q heads on 2 kv heads with head_dim 64 (groups of 10: two blocks of the fast
/// path per kv head, the second with 2 heads); 40 on 2 with head_dim 128 (groups of 20: three
/// blocks of 8 warps per kv head, the last with 4 heads); and head_dim 41 (odd: the generic
/// path's scalar loads).
#[test]
fn attention_decode_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(14);
    let shapes = [
        (N_HEADS, N_KV, HEAD_DIM),
        (20, 2, 64),
        (40, 2, 128),
        (6, 2, 41),
    ];
    for (n_heads, n_kv, head_dim) in shapes {
        for n_keys in [1, 2, 17, 257, 1000, 2048, 2049, 4097, 8192, 10240] {
            let (q, k, v, want) = decode_case(&mut rng, n_keys, n_heads, n_kv, head_dim);
            let shape = (n_heads, n_kv, head_dim);
            let got = gpu_attention(&dev, (&q, &k, &v), n_keys - 1, shape, true);
            let err = max_err(&got, &want);
            println!(
                "attention decode {n_heads}/{n_kv}/{head_dim} keys={n_keys}: max err {err:.2e}"
            );
            assert!(
                err <= TOL,
                "attention decode {n_heads}/{n_kv}/{head_dim} keys={n_keys}: {err}"
            );
        }
    }
}

/// Random q, k, v for one query after `n_keys - 1` cached rows and the CPU twin's output.
fn decode_case(
    rng: &mut Rng,
    n_keys: usize,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let kv_dim = n_kv * head_dim;
    let q = rand(rng, n_heads * head_dim, 3.5);
    let k = rand(rng, n_keys * kv_dim, 3.5);
    let v = rand(rng, n_keys * kv_dim, 2.0);
    let mut want = vec![0.0; q.len()];
    cpu::attention(&mut want, &q, &k, &v, n_keys - 1, n_heads, n_kv, head_dim);
    (q, k, v, want)
}

/// One set of sums through many decode calls, zeroed between them as `attn_qkv` zeroes them
/// in a decode step, whatever the lengths before (sums left over from a call would add its
/// keys into the next). The cache is filled past every position with other keys, so reading
/// a key past `pos` shows. A repeat may add in another order, so it agrees to f64's rounding,
/// not bit for bit. Calling again without zeroing adds the same terms twice: the sums
/// double, to f64's rounding of their terms (a head's terms `p·v` add up to at most its
/// softmax sum times `max|v|` = 2, however much they cancel), and their quotient, the output,
/// stays.
#[test]
fn attention_decode_adds_into_zeroed_sums() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(18);
    let (max_pos, kv_dim) = (8200, N_KV * HEAD_DIM);
    let k = rand(&mut rng, max_pos * kv_dim, 3.5);
    let v = rand(&mut rng, max_pos * kv_dim, 2.0);
    let (kc, vc) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    let mut sums = dev.attention_sums(N_HEADS, HEAD_DIM).unwrap();
    let mut previous = Vec::new();
    for n_keys in [
        8192, 1, 300, 4097, 33, 8192, 2, 2, 1000, 1000, 2048, 2049, 2048,
    ] {
        let q = rand(&mut rng, N_HEADS * HEAD_DIM, 3.5);
        let mut want = vec![0.0; q.len()];
        let (kn, vn) = (&k[..n_keys * kv_dim], &v[..n_keys * kv_dim]);
        cpu::attention(&mut want, &q, kn, vn, n_keys - 1, N_HEADS, N_KV, HEAD_DIM);
        let posd = dev.upload(&[n_keys as u32 - 1]).unwrap();
        let qd = dev.upload(&q).unwrap();
        let mut runs = Vec::new();
        for _ in 0..2 {
            dev.zero_sums(&mut sums).unwrap();
            dev.attention_decode(&mut sums, &qd, &kc, &vc, &posd, N_KV)
                .unwrap();
            runs.push(sums.output(&dev).unwrap());
        }
        let once = dev.download(sums.raw()).unwrap();
        dev.attention_decode(&mut sums, &qd, &kc, &vc, &posd, N_KV)
            .unwrap();
        let twice = dev.download(sums.raw()).unwrap();
        let err = max_err(&runs[0], &want);
        let repeat = max_err(&runs[1], &runs[0]);
        let n = N_HEADS * HEAD_DIM;
        let doubled = once
            .iter()
            .zip(&twice)
            .enumerate()
            .map(|(i, (a, b))| {
                let terms = if i < n {
                    2.0 * once[n + i / HEAD_DIM]
                } else {
                    *a
                };
                ((b - 2.0 * a) / (1.0 + terms)).abs()
            })
            .fold(0.0f64, f64::max);
        println!(
            "attention decode, reused sums, keys={n_keys}: max err {err:.2e}, repeat {repeat:.1e}"
        );
        assert!(err <= TOL, "reused sums keys={n_keys}: {err}");
        assert!(
            repeat <= 1e-6,
            "keys={n_keys}: a repeat differs by {repeat}"
        );
        assert!(
            doubled <= 1e-12,
            "keys={n_keys}: a second call added {doubled} off"
        );
        assert!(
            max_err(&sums.output(&dev).unwrap(), &runs[0]) <= 1e-6,
            "keys={n_keys}: doubled sums, another output"
        );
        assert_ne!(runs[0], previous, "keys={n_keys}: sums not written");
        previous = runs.pop().unwrap();
    }
    // A q for other heads is refused.
    let posd = dev.upload(&[0u32]).unwrap();
    let z = dev.zeros::<f32>(4 * HEAD_DIM).unwrap();
    let err = dev
        .attention_decode(&mut sums, &z, &z, &z, &posd, N_KV)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "attention: shapes of pos, q and the caches do not match"
    );
}

#[test]
fn attention_prefill_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(15);
    // 512 rows at 0: the model's prompt (8 blocks of 64 rows); at 300: a later chunk of a long
    // prompt. Rows not a multiple of 64, a block's worth plus one, and 2.
    for pos in [0, 37, 300] {
        for rows in [2, 7, 64, 65, 100, 500, 512] {
            let (q, k, v, want) = case(&mut rng, pos, rows);
            let shape = (N_HEADS, N_KV, HEAD_DIM);
            let got = gpu_attention(&dev, (&q, &k, &v), pos, shape, false);
            let err = max_err(&got, &want);
            println!("attention prefill pos={pos} rows={rows}: max err {err:.2e}");
            assert!(err <= TOL, "attention prefill pos={pos} rows={rows}: {err}");
        }
    }
}

/// Other shapes, on the kernels' generic path (head dims padded to 128): head_dim 128, 40
/// (not a multiple of 32), 41 and 17 (odd: unaligned rows), MHA (n_kv = n_heads), one head,
/// 32; and 64 with 3 heads. One row runs both the prefill and the decode kernel.
#[test]
fn attention_other_shapes_match_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(16);
    let shapes = [
        (4, 2, 128),
        (6, 3, 40),
        (2, 1, 41),
        (5, 5, 17),
        (3, 3, 64),
        (1, 1, 32),
    ];
    for (n_heads, n_kv, head_dim) in shapes {
        for (pos, rows) in [(0, 1), (70, 1), (0, 45), (19, 33), (5, 130)] {
            let kv_dim = n_kv * head_dim;
            let q = rand(&mut rng, rows * n_heads * head_dim, 3.5);
            let k = rand(&mut rng, (pos + rows) * kv_dim, 3.5);
            let v = rand(&mut rng, (pos + rows) * kv_dim, 2.0);
            let mut want = vec![0.0; q.len()];
            cpu::attention(&mut want, &q, &k, &v, pos, n_heads, n_kv, head_dim);
            // One row: the prefill kernel and the decode kernel.
            let kernels: &[bool] = if rows == 1 { &[false, true] } else { &[false] };
            for &decode in kernels {
                let shape = (n_heads, n_kv, head_dim);
                let got = gpu_attention(&dev, (&q, &k, &v), pos, shape, decode);
                let err = max_err(&got, &want);
                println!(
                    "attention {n_heads}/{n_kv} heads hd={head_dim} pos={pos} rows={rows} \
                     decode {decode}: {err:.2e}"
                );
                assert!(
                    err <= TOL,
                    "attention {n_heads}/{n_kv}/{head_dim} pos={pos} rows={rows} {decode}: {err}"
                );
            }
        }
    }
    // head_dim > 128 is refused with an error, for the sums and for the call.
    assert!(dev.attention_sums(1, 256).is_err());
    let z = dev.zeros::<f32>(256).unwrap();
    let posd = dev.upload(&[0u32]).unwrap();
    let mut out = dev.zeros::<f32>(256).unwrap();
    let err = dev
        .attention(&mut out, &z, &z, &z, &posd, 1, 1, 1, 256)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "attention: head_dim 256 is not supported (1..=128)"
    );
}

/// Layer 0's q, k, v (before RoPE) of the real model for the first chat prompt's tokens:
/// Qwen2's large q/k biases give real score spreads.
struct Layer0 {
    cfg: orcd::config::Config,
    n: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

fn layer0() -> Layer0 {
    let g = Gguf::open(&model_path()).unwrap();
    let cfg = orcd::config::Config::from_gguf(&g).unwrap();
    let (hidden, kv_dim) = (cfg.hidden, cfg.kv_dim());
    let load = |name: &str| {
        let t = g.tensor(name).unwrap();
        dequantize_to_vec(t.ty, g.tensor_data(t)).unwrap()
    };
    let prompt = ref_prompts()
        .into_iter()
        .find(|p| p.kind == "chat")
        .unwrap();
    let n = prompt.ids.len();
    let embd = g.tensor("token_embd.weight").unwrap();
    let row_bytes = embd.ty.row_bytes(hidden).unwrap();
    let x: Vec<f32> = prompt
        .ids
        .iter()
        .flat_map(|&id| {
            let row = &g.tensor_data(embd)[id as usize * row_bytes..][..row_bytes];
            dequantize_to_vec(embd.ty, row).unwrap()
        })
        .collect();
    let mut xn = vec![0.0; x.len()];
    cpu::rms_norm(&mut xn, &x, &load("blk.0.attn_norm.weight"), cfg.rms_eps);
    let project = |w: &str, n_out: usize| {
        let mut y = vec![0.0; n * n_out];
        let bias = load(&format!("blk.0.{w}.bias"));
        cpu::matmul(
            &mut y,
            &xn,
            &load(&format!("blk.0.{w}.weight")),
            hidden,
            Some(&bias),
        );
        y
    };
    Layer0 {
        q: project("attn_q", hidden),
        k: project("attn_k", kv_dim),
        v: project("attn_v", kv_dim),
        n,
        cfg,
    }
}

impl Layer0 {
    fn shape(&self) -> Shape {
        (self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim)
    }

    /// q and k after cpu::rope_neox, and cpu::attention's output.
    fn cpu(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.cfg;
        let (mut q, mut k) = (self.q.clone(), self.k.clone());
        cpu::rope_neox(&mut q, c.hidden, 0, c.head_dim, c.rope_theta);
        cpu::rope_neox(&mut k, c.kv_dim(), 0, c.head_dim, c.rope_theta);
        let mut out = vec![0.0; q.len()];
        cpu::attention(
            &mut out,
            &q,
            &k,
            &self.v,
            0,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
        );
        (q, k, out)
    }
}

/// Layer 0 on the GPU as the forward pass runs it: RoPE, kv_append and attention, as a
/// prefill of all tokens but the last and then a decode of the last: RoPE against its CPU
/// twin, attention against exact attention within `real_tol` of the layer's scores.
#[test]
fn attention_layer0_real_model_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let l0 = layer0();
    let (c, n) = (&l0.cfg, l0.n);
    let (hidden, kv_dim, hd) = (c.hidden, c.kv_dim(), c.head_dim);
    let (qr, kr, cpu_out) = l0.cpu();
    let (want, max_score) = exact_attention(&qr, &kr, &l0.v, l0.shape());
    let tol = real_tol(max_score);

    let max_pos = 256;
    let table = dev.rope_table(max_pos, hd, c.rope_theta).unwrap();
    let mut kc = dev.zeros::<f32>(max_pos * kv_dim).unwrap();
    let mut vc = dev.zeros::<f32>(max_pos * kv_dim).unwrap();
    let mut sums = dev.attention_sums(c.n_heads, hd).unwrap();
    let (mut got, mut got_q, mut got_k) = (Vec::new(), Vec::new(), Vec::new());
    for (start, end) in [(0, n - 1), (n - 1, n)] {
        let rows = end - start;
        let posd = dev.upload(&[start as u32]).unwrap();
        let mut qd = dev.upload(&l0.q[start * hidden..end * hidden]).unwrap();
        let mut kd = dev.upload(&l0.k[start * kv_dim..end * kv_dim]).unwrap();
        let vd = dev.upload(&l0.v[start * kv_dim..end * kv_dim]).unwrap();
        dev.rope_neox(&mut qd, &posd, &table, c.n_heads, hd)
            .unwrap();
        dev.rope_neox(&mut kd, &posd, &table, c.n_kv_heads, hd)
            .unwrap();
        dev.kv_append(&mut kc, &mut vc, &kd, &vd, &posd, kv_dim)
            .unwrap();
        if rows == 1 {
            dev.attention_decode(&mut sums, &qd, &kc, &vc, &posd, c.n_kv_heads)
                .unwrap();
            got.extend(sums.output(&dev).unwrap());
        } else {
            let mut out = dev.zeros::<f32>(rows * hidden).unwrap();
            dev.attention(
                &mut out,
                &qd,
                &kc,
                &vc,
                &posd,
                rows,
                c.n_heads,
                c.n_kv_heads,
                hd,
            )
            .unwrap();
            got.extend(dev.download(&out).unwrap());
        }
        got_q.extend(dev.download(&qd).unwrap());
        got_k.extend(dev.download(&kd).unwrap());
    }
    let (err_q, err_k) = (max_err(&got_q, &qr), max_err(&got_k, &kr));
    let (err, err_cpu) = (max_err(&got, &want), max_err(&cpu_out, &want));
    println!(
        "layer 0 ({} heads, {} kv, head dim {hd}), {n} tokens: rope err q {err_q:.2e} \
         k {err_k:.2e}; against exact attention (max |score| {max_score:.1}, tolerance \
         {tol:.2e}): GPU err {err:.2e}, CPU twin err {err_cpu:.2e}",
        c.n_heads, c.n_kv_heads
    );
    assert!(
        err_q <= 1e-6 && err_k <= 1e-6,
        "layer 0 rope: q {err_q} k {err_k}"
    );
    assert!(err <= tol, "layer 0 attention: {err} > {tol}");
}

/// The prefill kernel's algorithm on the CPU, with its tile and row arithmetic: blocks of 64
/// rows, their keys (head dim 64) in rounds of 64, each round's first 32 keys to part 0 and
/// the rest to part 1, or (any other head dim) in rounds of 32 to one part, each part an
/// online softmax over its tiles (tiles after a row's position skipped), the parts met at the
/// end, and every product of q·k and p·v taken from f16 halves as the tensor cores take them.
/// The decode kernel's algorithm likewise: the keys in up to 64 slices of whole tiles, each
/// slice's partial softmax scaled to the reference of the query's score of its own key and
/// summed in f64, the sums divided at the end. Both against cpu::attention on random cases,
/// and with the CPU twin against exact attention on the real model's layer 0 (`real_tol`),
/// which checks the algorithm and the tolerance apart from ex2.approx (here the CPU's exp),
/// the tensor cores' sums and the warp sums' order.
#[test]
fn online_softmax_algorithms_match_cpu() {
    let mut rng = Rng::new(17);
    for (pos, rows) in [
        (0, 100),
        (37, 45),
        (0, 200),
        (4096, 1),
        (8191, 1),
        (40, 1),
        (0, 1),
    ] {
        let (q, k, v, want) = case(&mut rng, pos, rows);
        let got = if rows == 1 {
            simulate_decode(&q, &k, &v, pos, SHAPE)
        } else {
            simulate_prefill(&q, &k, &v, pos, rows, SHAPE)
        };
        let err = max_err(&got, &want);
        println!("simulated pos={pos} rows={rows}: max err {err:.2e}");
        assert!(err <= TOL, "simulated pos={pos} rows={rows}: {err}");
    }
    // Layer 0 of the real model (needs the model file, not a GPU), in its own shape: its
    // scores reach far higher (attention sinks) than the random cases', which stay below ~20.
    let l0 = layer0();
    let (q, k, cpu_out) = l0.cpu();
    let (c, shape) = (&l0.cfg, l0.shape());
    let (want, max_score) = exact_attention(&q, &k, &l0.v, shape);
    let tol = real_tol(max_score);
    let last = (l0.n - 1) * c.hidden;
    let cases = [
        (cpu_out, "CPU twin"),
        (simulate_prefill(&q, &k, &l0.v, 0, l0.n, shape), "prefill"),
        (
            simulate_decode(&q[last..], &k, &l0.v, l0.n - 1, shape),
            "decode",
        ),
    ];
    for (got, what) in &cases {
        let want = &want[want.len() - got.len()..];
        let err = max_err(got, want);
        println!(
            "layer 0 {what} ({} heads, {} kv, head dim {}, {} tokens) against exact attention: \
             max |score| {max_score:.1}, max err {err:.2e}, tolerance {tol:.2e}",
            c.n_heads, c.n_kv_heads, c.head_dim, l0.n
        );
    }
    for (got, what) in &cases {
        let err = max_err(got, &want[want.len() - got.len()..]);
        assert!(err <= tol, "layer 0 {what}: {err} > {tol}");
    }
}

/// Exact causal attention (f64 scores and sums, rounded to f32 at the end) of `q`'s rows at
/// positions `0..` over `k` and `v`, as `cpu::attention` defines it, and the largest |score|.
fn exact_attention(q: &[f32], k: &[f32], v: &[f32], (n_heads, n_kv, hd): Shape) -> (Vec<f32>, f32) {
    let (q_dim, kv_dim) = (n_heads * hd, n_kv * hd);
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0.0; q.len()];
    let mut max_score = 0.0f64;
    for (i, out) in out.chunks_exact_mut(hd).enumerate() {
        let (t, h) = (i / n_heads, i % n_heads);
        let qr = &q[t * q_dim + h * hd..][..hd];
        let kv_off = h / (n_heads / n_kv) * hd;
        let s: Vec<f64> = (0..=t)
            .map(|j| {
                let kr = &k[j * kv_dim + kv_off..][..hd];
                qr.iter()
                    .zip(kr)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        max_score = s.iter().fold(max_score, |a, s| a.max(s.abs()));
        let p: Vec<f64> = s.iter().map(|s| (s - m).exp()).collect();
        let l: f64 = p.iter().sum();
        for (d, o) in out.iter_mut().enumerate() {
            let sum: f64 = p
                .iter()
                .enumerate()
                .map(|(j, p)| p * v[j * kv_dim + kv_off + d] as f64)
                .sum();
            *o = (sum / l) as f32;
        }
    }
    (out, max_score as f32)
}

const TILE: usize = 32;
/// The decode kernel's slices: `DECODE_SPLITS` of host/src/cuda/attention.rs.
const SPLITS: usize = 64;

/// `Running::add_tile` over the tiles of keys `first..=last` (`first` a tile's start) for the
/// query `qr` and kv head `kv_off`: (max, sum, unnormalised acc).
fn simulate_tiles(
    qr: &[f32],
    (k, v, kv_dim): (&[f32], &[f32], usize),
    kv_off: usize,
    first: usize,
    last: usize,
) -> (f32, f32, Vec<f32>) {
    let hd = qr.len();
    let scale = 1.0 / (hd as f32).sqrt();
    let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0.0f32, vec![0.0f32; hd]);
    for k0 in (first..=last).step_by(TILE) {
        let s: Vec<f32> = (k0..k0 + TILE)
            .map(|j| {
                if j > last {
                    return f32::NEG_INFINITY;
                }
                let kr = &k[j * kv_dim + kv_off..][..hd];
                qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale
            })
            .collect();
        let m_new = s.iter().copied().fold(m, f32::max);
        let c = (m - m_new).exp();
        let p: Vec<f32> = s.iter().map(|s| (s - m_new).exp()).collect();
        l = l * c + p.iter().sum::<f32>();
        m = m_new;
        acc.iter_mut().for_each(|a| *a *= c);
        for (i, p) in p.iter().enumerate().take(TILE.min(last - k0 + 1)) {
            let vr = &v[(k0 + i) * kv_dim + kv_off..][..hd];
            acc.iter_mut().zip(vr).for_each(|(a, v)| *a += p * v);
        }
    }
    (m, l, acc)
}

/// `x ≈ hi + lo / 2048` in f16 halves, as the prefill kernel splits its tensor-core operands.
fn split16(x: f32) -> (f32, f32) {
    let hi = half::f16::from_f32(x).to_f32();
    (hi, half::f16::from_f32((x - hi) * 2048.0).to_f32())
}

/// `a·b` from split halves: hi·hi + (lo·hi + hi·lo) / 2048 in two sums, lo·lo left out.
fn split_dot(a: &[(f32, f32)], b: &[(f32, f32)]) -> f32 {
    let (mut main, mut cross) = (0.0f32, 0.0f32);
    for (a, b) in a.iter().zip(b) {
        main += a.0 * b.0;
        cross += a.1 * b.0 + a.0 * b.1;
    }
    main + cross / 2048.0
}

fn simulate_prefill(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos: usize,
    rows: usize,
    (n_heads, n_kv, hd): Shape,
) -> Vec<f32> {
    let (q_dim, kv_dim) = (n_heads * hd, n_kv * hd);
    // Head dim 64 runs the kernel's D = 64 path: two key parts, each every other tile of 32
    // keys. Any other runs D = 128: one part over every tile (its two warps' halves of the
    // dims run the same softmax).
    let parts = if hd == 64 { 2 } else { 1 };
    let scale = 1.0 / (hd as f32).sqrt();
    let ks: Vec<(f32, f32)> = k.iter().map(|&x| split16(x)).collect();
    let vs: Vec<(f32, f32)> = v.iter().map(|&x| split16(x)).collect();
    let mut out = vec![0.0; q.len()];
    for row in 0..rows {
        // The keys of the row's block: up to its last row's position.
        let n_keys = pos + rows.min(row / 64 * 64 + 64);
        let last = pos + row;
        for h in 0..n_heads {
            let kv_off = h / (n_heads / n_kv) * hd;
            let qs: Vec<(f32, f32)> = q[row * q_dim + h * hd..][..hd]
                .iter()
                .map(|&x| split16(x))
                .collect();
            // Each part's (max, sum, unnormalised output).
            let parts: Vec<_> = (0..parts)
                .map(|part| {
                    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
                    let (mut main, mut cross) = (vec![0.0f32; hd], vec![0.0f32; hd]);
                    for k0 in (32 * part..n_keys).step_by(32 * parts) {
                        if k0 > last {
                            continue;
                        }
                        let s: Vec<f32> = (k0..k0 + 32)
                            .map(|j| {
                                if j > last {
                                    return f32::NEG_INFINITY;
                                }
                                split_dot(&qs, &ks[j * kv_dim + kv_off..][..hd]) * scale
                            })
                            .collect();
                        // A part with no live key yet keeps max -inf and weighs its keys 0.
                        let mt = s.iter().copied().fold(m, f32::max);
                        let m_use = if mt == f32::NEG_INFINITY { 0.0 } else { mt };
                        let corr = (m - m_use).exp();
                        m = mt;
                        let p: Vec<f32> = s.iter().map(|s| (s - m_use).exp()).collect();
                        l = l * corr + p.iter().sum::<f32>();
                        main.iter_mut().for_each(|a| *a *= corr);
                        cross.iter_mut().for_each(|a| *a *= corr);
                        for (j, p) in (k0..=last.min(k0 + 31)).zip(&p) {
                            let (ph, pl) = split16(*p);
                            for (d, (vh, vl)) in vs[j * kv_dim + kv_off..][..hd].iter().enumerate()
                            {
                                main[d] += ph * vh;
                                cross[d] += pl * vh + ph * vl;
                            }
                        }
                    }
                    let o: Vec<f32> = main
                        .iter()
                        .zip(&cross)
                        .map(|(a, c)| a + c / 2048.0)
                        .collect();
                    (m, l, o)
                })
                .collect();
            // Part 0 has key 0, so its max is finite; part 1's may be -inf and weigh 0.
            let mx = parts.iter().map(|p| p.0).fold(f32::NEG_INFINITY, f32::max);
            let f: Vec<f32> = parts.iter().map(|p| (p.0 - mx).exp()).collect();
            let l: f32 = parts.iter().zip(&f).map(|(p, f)| p.1 * f).sum();
            let o = &mut out[row * q_dim + h * hd..][..hd];
            for (d, o) in o.iter_mut().enumerate() {
                *o = parts.iter().zip(&f).map(|(p, f)| p.2[d] * f).sum::<f32>() / l;
            }
        }
    }
    out
}

/// The prefill kernel's shared-memory layout and ldmatrix addressing, on the CPU, for both
/// padded head dims: the 256 threads' staged units of 4 floats fill the round's `[keys][D]`
/// tile of halves exactly once, 16-byte chunk `j` of row `r` at chunk `j ^ (r % 8)`; each
/// ldmatrix that the lanes' row addresses describe yields, as PTX defines ldmatrix (lane `l`
/// gets row `l / 4`, halves `2 (l % 4)` and `+1` of each matrix; with .trans, column `l / 4`,
/// rows `2 (l % 4)` and `+1`), exactly the B fragments of mma.m16n8k16 (k `2c, 2c + 1` and
/// `+8` of column `g`): K's (key, dim) for Q·Kᵀ and V's (key, dim) for P·V. And no bank
/// conflicts: each 8-row ldmatrix phase and each half-warp's 8-byte stores hit distinct banks.
#[test]
fn prefill_fragments_address_the_right_elements() {
    for d in [64usize, 128] {
        let parts = 128 / d;
        let round_keys = 32 * parts;
        let chunk_at = |r: usize, j: usize| r * 2 * d + 16 * (j ^ (r % 8));
        // The (key, dim) staged at each half of the tile.
        let mut tile = vec![None; round_keys * d];
        for warp in 0..8 {
            for i in 0..4 {
                let mut banks = [vec![], vec![]];
                for lane in 0..32 {
                    let u = 32 * warp + lane + 256 * i;
                    let (r, dd) = (u / (d / 4), 4 * (u % (d / 4)));
                    let at = chunk_at(r, dd / 8) + 2 * (dd % 8);
                    banks[lane / 16].extend([at / 4 % 32, at / 4 % 32 + 1]);
                    for e in 0..4 {
                        assert_eq!(tile[at / 2 + e], None, "d={d} unit {u}");
                        tile[at / 2 + e] = Some((r, dd + e));
                    }
                }
                for b in &mut banks {
                    b.sort();
                    b.dedup();
                    assert_eq!(b.len(), 32, "d={d}: a half-warp's stores share banks");
                }
            }
        }
        assert!(tile.iter().all(Option::is_some), "d={d}: tile not filled");
        // ldmatrix .x4: `addr(l)` is lane l's row address (row l % 8 of matrix l / 8); the
        // result is lane l's four words of two (key, dim) halves.
        let ldmatrix = |addr: &dyn Fn(usize) -> usize, trans: bool| {
            for i in 0..4 {
                let mut groups: Vec<usize> = (0..8).map(|r| addr(8 * i + r) / 16 % 8).collect();
                groups.sort();
                groups.dedup();
                assert_eq!(
                    groups.len(),
                    8,
                    "d={d}: an ldmatrix phase has a bank conflict"
                );
            }
            (0..32)
                .map(|l| {
                    [0, 1, 2, 3].map(|i| {
                        [0, 1].map(|e| {
                            let (row, col) = if trans {
                                (2 * (l % 4) + e, l / 4)
                            } else {
                                (l / 4, 2 * (l % 4) + e)
                            };
                            tile[addr(8 * i + row) / 2 + col].unwrap()
                        })
                    })
                })
                .collect::<Vec<_>>()
        };
        for part in 0..2 {
            let (kp, dp) = if parts == 2 { (part, 0) } else { (0, part) };
            // The kernel's k_row, k_chunk, v_row, v_chunk.
            let k_row = |l: usize| kp * 32 + l % 8 + 8 * (l / 16);
            let v_row = |l: usize| kp * 32 + l % 8 + 8 * (l / 8 % 2);
            let v_chunk = |l: usize| 8 * dp + l / 16;
            for kk in 0..d / 16 {
                for jp in 0..2 {
                    let got =
                        ldmatrix(&|l| chunk_at(k_row(l) + 16 * jp, 2 * kk + l / 8 % 2), false);
                    for (l, words) in got.iter().enumerate() {
                        let (g, c) = (l / 4, l % 4);
                        for (w, word) in words.iter().enumerate() {
                            let (j, b) = (2 * jp + w / 2, w % 2);
                            let want =
                                [0, 1].map(|e| (kp * 32 + 8 * j + g, 16 * kk + 8 * b + 2 * c + e));
                            assert_eq!(*word, want, "d={d} K kk={kk} jp={jp} lane {l} word {w}");
                        }
                    }
                }
            }
            for ks in 0..2 {
                for np in 0..4 {
                    let got =
                        ldmatrix(&|l| chunk_at(v_row(l) + 16 * ks, v_chunk(l) + 2 * np), true);
                    for (l, words) in got.iter().enumerate() {
                        let (g, c) = (l / 4, l % 4);
                        for (w, word) in words.iter().enumerate() {
                            let (n, b) = (2 * np + w / 2, w % 2);
                            let want = [0, 1].map(|e| {
                                (kp * 32 + 16 * ks + 8 * b + 2 * c + e, 64 * dp + 8 * n + g)
                            });
                            assert_eq!(*word, want, "d={d} V ks={ks} np={np} lane {l} word {w}");
                        }
                    }
                }
            }
        }
    }
}

fn simulate_decode(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos: usize,
    (n_heads, n_kv, hd): Shape,
) -> Vec<f32> {
    let kv_dim = n_kv * hd;
    let n_keys = pos + 1;
    let chunk = n_keys.div_ceil(SPLITS).next_multiple_of(TILE);
    let used = n_keys.div_ceil(chunk);
    assert!(
        used <= SPLITS && (used - 1) * chunk < n_keys,
        "every slice has keys"
    );
    let mut out = vec![0.0; n_heads * hd];
    for h in 0..n_heads {
        let qr = &q[h * hd..][..hd];
        let kv_off = h / (n_heads / n_kv) * hd;
        let parts: Vec<(f32, f32, Vec<f32>)> = (0..used)
            .map(|s| {
                let last = n_keys.min(s * chunk + chunk) - 1;
                simulate_tiles(qr, (k, v, kv_dim), kv_off, s * chunk, last)
            })
            .collect();
        let own = &k[pos * kv_dim + kv_off..][..hd];
        let s_own = qr.iter().zip(own).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt();
        let (mut sum, mut o) = (0.0f64, vec![0.0f64; hd]);
        for (m, l, acc) in &parts {
            let w = ((m - s_own) as f64).exp();
            sum += *l as f64 * w;
            o.iter_mut().zip(acc).for_each(|(o, a)| *o += *a as f64 * w);
        }
        let out = &mut out[h * hd..][..hd];
        out.iter_mut()
            .zip(&o)
            .for_each(|(out, o)| *out = (o / sum) as f32);
    }
    out
}
