//! Dequantization of every tensor of the real default model: all values finite, the first
//! element of each tensor's last block equal to a hand decode of its bytes, and the time taken.
//! `cargo test --release -p orcd-tests --test quant_real -- --nocapture` prints the timings.
use std::time::{Duration, Instant};

use half::f16;
use half::slice::HalfFloatSliceExt;
use orcd::config::Config;
use orcd::gguf::{Gguf, TensorInfo};
use orcd::quant::{GgmlType, dequantize, dequantize_f16};

/// The default model (fetched on first use).
fn default_model() -> Gguf {
    Gguf::open(&orcd_tests::model_path()).expect("opening the model")
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Element 0 of the block `b`, decoded straight from the format's definition.
fn first_element(ty: GgmlType, b: &[u8]) -> f32 {
    match ty {
        GgmlType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        // d · (low nibble of qs[0] - 8), qs at 2
        GgmlType::Q4_0 => f16_at(b, 0) * ((b[2] & 15) as f32 - 8.0),
        // d · (low nibble of qs[0] | bit 0 of qh << 4, minus 16); qh at 2, qs at 6
        GgmlType::Q5_0 => f16_at(b, 0) * (((b[6] & 15) | (b[2] & 1) << 4) as f32 - 16.0),
        // d · qs[0], qs at 2
        GgmlType::Q8_0 => f16_at(b, 0) * b[2] as i8 as f32,
        // d · (scales[0] & 63) · (low nibble of qs[0]) - dmin · (scales[4] & 63); scales at 4, qs at 16
        GgmlType::Q4K => {
            f16_at(b, 0) * (b[4] & 63) as f32 * (b[16] & 15) as f32
                - f16_at(b, 2) * (b[8] & 63) as f32
        }
        // d · scales[0] · (low nibble of ql[0] | (qh[0] & 3) << 4, minus 32); qh at 128,
        // scales at 192, d at 208
        GgmlType::Q6K => {
            f16_at(b, 208) * b[192] as i8 as f32 * (((b[0] & 15) | (b[128] & 3) << 4) as f32 - 32.0)
        }
        ty => panic!("no hand decode for {} (not in this model)", ty.name()),
    }
}

#[test]
fn every_tensor_dequantizes() {
    let g = default_model();
    let largest = g.tensors().iter().map(TensorInfo::n_elems).max().unwrap() as usize;
    let mut out = vec![0f32; largest];
    let mut out16 = vec![f16::ZERO; largest];
    let mut rounded = vec![f16::ZERO; largest];
    // Touch the buffers once so that page faults are not timed.
    out.fill(1.0);
    out16.fill(f16::ONE);
    let (mut t32, mut t16, mut elems) = (Duration::ZERO, Duration::ZERO, 0usize);
    let mut max_abs = 0f32;
    for t in g.tensors() {
        let data = g.tensor_data(t);
        let n = t.n_elems() as usize;
        let (out, out16) = (&mut out[..n], &mut out16[..n]);

        let start = Instant::now();
        dequantize(t.ty, data, out).unwrap();
        t32 += start.elapsed();
        let start = Instant::now();
        dequantize_f16(t.ty, data, out16).unwrap();
        t16 += start.elapsed();
        elems += n;

        // One pass: the max of |x|, or None at the first value that is not finite.
        max_abs = match out
            .iter()
            .try_fold(max_abs, |m, &x| x.is_finite().then(|| m.max(x.abs())))
        {
            Some(m) => m,
            None => panic!("{}: a value is not finite", t.name),
        };
        rounded[..n].convert_from_f32_slice(out);
        assert!(
            rounded[..n].reinterpret_cast() == out16.reinterpret_cast(),
            "{}: f16 is not f32 rounded",
            t.name
        );
        let last = data.len() - t.ty.block_bytes();
        let first_of_last = n - t.ty.block_elems();
        assert_eq!(
            out[first_of_last],
            first_element(t.ty, &data[last..]),
            "{}",
            t.name
        );
    }
    // Per layer: q and o, k and v with their biases, gate, up and down, 2 norms; then
    // token_embd, output (unless tied) and output_norm.
    let c = Config::from_gguf(&g).unwrap();
    let (h, q, kv) = (c.hidden, c.n_heads * c.head_dim, c.kv_dim());
    let layer = 2 * h * q + q + 2 * (h * kv + kv) + 3 * h * c.ffn + 2 * h;
    let outputs = if c.tied_output { 1 } else { 2 };
    assert_eq!(
        elems,
        c.n_layers * layer + outputs * c.vocab * h + h,
        "weights in the model"
    );
    println!(
        "dequantized {} tensors, {elems} weights (max |x| {max_abs}): f32 {:.2} s, f16 {:.2} s, {} threads",
        g.tensors().len(),
        t32.as_secs_f64(),
        t16.as_secs_f64(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
}

#[test]
fn f32_norm_round_trips() {
    let g = default_model();
    let hidden = Config::from_gguf(&g).unwrap().hidden as u64;
    let t = g.tensor("blk.0.attn_norm.weight").unwrap();
    assert_eq!((t.ty, t.shape.as_slice()), (GgmlType::F32, &[hidden][..]));
    let data = g.tensor_data(t);
    let y = orcd::quant::dequantize_to_vec(t.ty, data).unwrap();
    let bytes: Vec<u8> = y.iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(bytes, data);
}
