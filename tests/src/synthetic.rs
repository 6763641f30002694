//! Qwen2 models of random weights in the shapes of the family's larger sizes, written as GGUF
//! files: what checks that no kernel assumes the default model's shape.
//!
//! The weights are scaled as a trained model's roughly are: each matrix's values have an rms of
//! `1/sqrt(n_in)`, so a product of unit-rms activations is unit-rms too; the attention's scores
//! come out with a spread of about 1, and the logits with one of a few units, as the real
//! model's, so that the GPU paths' tolerances mean here what they mean there.
use std::path::{Path, PathBuf};

use half::f16;
use orcd::gguf::Value;
use orcd::quant::{GgmlType, dequantize_to_vec};

use crate::Rng;
use crate::gguf_writer::{GgufFile, str};

/// The sizes of a Qwen2 model (its layers aside).
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub name: &'static str,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub ffn: usize,
    pub vocab: usize,
    /// No `output.weight`: the output projection is `token_embd.weight`.
    pub tied: bool,
}

// The vocabularies are cut to about a thousand: the real ones (151,936 for 3B, 152,064 for 7B
// and 14B) would add several hundred MB to each file and make the CPU's output projection the
// slowest step. Each keeps its real size's remainder mod 256, so that any tiling of the
// vocabulary by up to 256 ends as it does on the real model.

/// Qwen2.5-3B: head dim 128, 8 query heads per kv head, tied embeddings.
pub const QWEN2_5_3B: Shape = Shape {
    name: "3b",
    hidden: 2048,
    n_heads: 16,
    n_kv_heads: 2,
    ffn: 11008,
    vocab: 1152,
    tied: true,
};

/// Qwen2.5-7B: head dim 128, 7 query heads per kv head.
pub const QWEN2_5_7B: Shape = Shape {
    name: "7b",
    hidden: 3584,
    n_heads: 28,
    n_kv_heads: 4,
    ffn: 18944,
    vocab: 1280,
    tied: false,
};

/// Qwen2.5-14B: head dim 128, 5 query heads per kv head.
pub const QWEN2_5_14B: Shape = Shape {
    name: "14b",
    hidden: 5120,
    n_heads: 40,
    n_kv_heads: 8,
    ffn: 13824,
    vocab: 1280,
    tied: false,
};

/// The weight types of a model's matrices (norms and biases are always f32).
#[derive(Clone, Copy, Debug)]
pub struct Types {
    pub name: &'static str,
    /// `token_embd.weight`, when the output projection is separate.
    pub embd: GgmlType,
    /// `output.weight`, or `token_embd.weight` when tied (quantizers give a tied table the
    /// output's type).
    pub output: GgmlType,
    /// attn_q, attn_k, attn_output, ffn_gate and ffn_up.
    pub main: GgmlType,
    pub attn_v: GgmlType,
    pub ffn_down: GgmlType,
}

/// The types of llama.cpp's Q4_K_M files of these sizes.
pub const Q4_K_M: Types = Types {
    name: "q4_k_m",
    embd: GgmlType::Q4K,
    output: GgmlType::Q6K,
    main: GgmlType::Q4K,
    attn_v: GgmlType::Q6K,
    ffn_down: GgmlType::Q6K,
};

/// The types of the default model's file (whose rows of 896 fit no K-quant block).
pub const Q5_0_Q8_0: Types = Types {
    name: "q5_0_q8_0",
    embd: GgmlType::Q5_0,
    output: GgmlType::Q8_0,
    main: GgmlType::Q5_0,
    attn_v: GgmlType::Q8_0,
    ffn_down: GgmlType::Q6K,
};

/// The bytes of each block's f16 scales: d, and dmin for the K types with one.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[0],
    }
}

/// `rows` rows of `n_in` random weights of type `ty` whose values have an rms of about `rms`.
/// Block types: random bytes, each block's f16 scales drawn uniformly in ±k, with k found on
/// a sample (the values are linear in the scales).
pub fn random_matrix(ty: GgmlType, rows: usize, n_in: usize, rms: f32, rng: &mut Rng) -> Vec<u8> {
    let floats = |rng: &mut Rng, n: usize| -> Vec<f32> {
        // Uniform in ±a has an rms of a/sqrt(3).
        (0..n).map(|_| rng.next_f32() * rms * 3f32.sqrt()).collect()
    };
    match ty {
        GgmlType::F32 => return f32_bytes(&floats(rng, rows * n_in)),
        GgmlType::F16 => return f16_bytes(&floats(rng, rows * n_in)),
        _ => {}
    }
    let blocks = |rng: &mut Rng, n: usize, k: f32| -> Vec<u8> {
        let mut t = rng.bytes(n * ty.block_bytes());
        for block in t.chunks_exact_mut(ty.block_bytes()) {
            for &at in scale_offsets(ty) {
                let d = f16::from_f32(rng.next_f32() * k);
                block[at..at + 2].copy_from_slice(&d.to_le_bytes());
            }
        }
        t
    };
    let sample = dequantize_to_vec(ty, &blocks(rng, 256, 1.0)).unwrap();
    let unit = (sample.iter().map(|v| v * v).sum::<f32>() / sample.len() as f32).sqrt();
    let bytes = ty.row_bytes(n_in).expect("rows of whole blocks") * rows;
    blocks(rng, bytes / ty.block_bytes(), rms / unit)
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect()
}

/// A Qwen2 model of `shape` with `n_layers` layers of random weights of `types`, drawn from
/// `seed`.
pub fn random_qwen2(shape: &Shape, types: &Types, n_layers: usize, seed: u64) -> GgufFile {
    let mut rng = Rng::new(seed);
    let (h, ffn, vocab) = (shape.hidden, shape.ffn, shape.vocab);
    let kv = shape.n_kv_heads * (h / shape.n_heads);
    let u32_of = |n: usize| Value::U32(n as u32);
    let mut f = GgufFile::default()
        .meta("general.architecture", str("qwen2"))
        .meta("general.name", str(&format!("random {}", shape.name)))
        .meta("qwen2.block_count", u32_of(n_layers))
        .meta("qwen2.context_length", Value::U32(4096))
        .meta("qwen2.embedding_length", u32_of(h))
        .meta("qwen2.feed_forward_length", u32_of(ffn))
        .meta("qwen2.attention.head_count", u32_of(shape.n_heads))
        .meta("qwen2.attention.head_count_kv", u32_of(shape.n_kv_heads))
        .meta("qwen2.rope.freq_base", Value::F32(1e6))
        .meta("qwen2.attention.layer_norm_rms_epsilon", Value::F32(1e-6));
    let matrix = |f: GgufFile, rng: &mut Rng, name: &str, ty: GgmlType, n_in, n_out| {
        let data = random_matrix(ty, n_out, n_in, 1.0 / (n_in as f32).sqrt(), rng);
        f.tensor_with(name, ty as u32, &[n_in as u64, n_out as u64], data)
    };
    // A norm's weights near `scale`, a bias's values within ±scale.
    let vector = |f: GgufFile, rng: &mut Rng, name: &str, n: usize, around: f32, scale: f32| {
        let v: Vec<f32> = (0..n).map(|_| around + rng.next_f32() * scale).collect();
        f.tensor_with(name, GgmlType::F32 as u32, &[n as u64], f32_bytes(&v))
    };
    let embd = if shape.tied { types.output } else { types.embd };
    f = matrix(f, &mut rng, "token_embd.weight", embd, h, vocab);
    // The final norm sets the logits' spread (the output rows are unit-rms products).
    f = vector(f, &mut rng, "output_norm.weight", h, 3.0, 0.5);
    if !shape.tied {
        f = matrix(f, &mut rng, "output.weight", types.output, h, vocab);
    }
    for l in 0..n_layers {
        let b = |s: &str| format!("blk.{l}.{s}");
        f = vector(f, &mut rng, &b("attn_norm.weight"), h, 1.0, 0.2);
        f = matrix(f, &mut rng, &b("attn_q.weight"), types.main, h, h);
        f = vector(f, &mut rng, &b("attn_q.bias"), h, 0.0, 0.5);
        f = matrix(f, &mut rng, &b("attn_k.weight"), types.main, h, kv);
        f = vector(f, &mut rng, &b("attn_k.bias"), kv, 0.0, 0.5);
        f = matrix(f, &mut rng, &b("attn_v.weight"), types.attn_v, h, kv);
        f = vector(f, &mut rng, &b("attn_v.bias"), kv, 0.0, 0.5);
        f = matrix(f, &mut rng, &b("attn_output.weight"), types.main, h, h);
        f = vector(f, &mut rng, &b("ffn_norm.weight"), h, 1.0, 0.2);
        f = matrix(f, &mut rng, &b("ffn_gate.weight"), types.main, h, ffn);
        f = matrix(f, &mut rng, &b("ffn_up.weight"), types.main, h, ffn);
        f = matrix(f, &mut rng, &b("ffn_down.weight"), types.ffn_down, ffn, h);
    }
    f
}

/// `f` with every quantized matrix dequantized and rounded to f16: what `WeightFormat::F16`
/// puts on the GPU, for the CPU to measure what that rounding does to the logits.
pub fn rounded_to_f16(mut f: GgufFile) -> GgufFile {
    for t in &mut f.tensors {
        let ty = GgmlType::from_id(t.ty).expect("a type orcd reads");
        if let (Some(data), true) = (&t.data, ty.block_elems() > 1) {
            t.data = Some(f16_bytes(&dequantize_to_vec(ty, data).unwrap()));
            t.ty = GgmlType::F16 as u32;
        }
    }
    f
}

/// A model file in the temporary folder, removed on drop.
pub struct TempFile(PathBuf);

impl TempFile {
    /// Writes `f` as `<temp>/orcd-<pid>-<name>.gguf` (tests of one process run in parallel;
    /// they name their files apart).
    pub fn write(f: &GgufFile, name: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!("orcd-{}-{name}.gguf", std::process::id()));
        std::fs::write(&path, f.bytes()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        TempFile(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
