//! A tiny GGUF writer, for crafting valid and malformed test files, and the small models the
//! tests build with it.
use orcd::gguf::Value;

pub const F32: u32 = 0;
pub const F16: u32 = 1;
pub const Q8_0: u32 = 8;

pub struct TensorSpec {
    pub name: String,
    pub ty: u32,
    pub shape: Vec<u64>,
    /// Data offset to write instead of the laid-out one.
    pub offset: Option<u64>,
    /// The tensor's bytes, instead of the pattern `bytes()` writes.
    pub data: Option<Vec<u8>>,
}

pub struct GgufFile {
    pub version: u32,
    /// Layout alignment; the `general.alignment` key is set separately, as a test needs.
    pub alignment: u64,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorSpec>,
}

/// Data bytes written for a tensor: its own, or for the pattern, from the ggml block layouts:
/// f32 4 bytes, f16 2, q8_0 34 per 32. Huge shapes (which the reader must refuse from the
/// header alone) get no pattern.
fn data_bytes(t: &TensorSpec) -> u64 {
    if let Some(data) = &t.data {
        return data.len() as u64;
    }
    let (ty, shape) = (t.ty, &t.shape);
    let n = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .unwrap_or(u64::MAX);
    let bytes = match ty {
        F32 => n.saturating_mul(4),
        F16 => n.saturating_mul(2),
        Q8_0 => n / 32 * 34,
        _ => 0,
    };
    if bytes > 1 << 20 { 0 } else { bytes }
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_payload(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            out.extend(items.first().map_or(0, value_type).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_payload(out, item);
            }
        }
    }
}

/// An empty version 3 file, aligned to 32 bytes.
impl Default for GgufFile {
    fn default() -> Self {
        GgufFile {
            version: 3,
            alignment: 32,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }
}

impl GgufFile {
    pub fn meta(mut self, key: &str, value: Value) -> Self {
        self.metadata.push((key.into(), value));
        self
    }

    pub fn tensor(mut self, name: &str, ty: u32, shape: &[u64]) -> Self {
        self.tensors.push(TensorSpec {
            name: name.into(),
            ty,
            shape: shape.to_vec(),
            offset: None,
            data: None,
        });
        self
    }

    /// A tensor with the bytes `data` (of any size; a model's weights, say).
    pub fn tensor_with(mut self, name: &str, ty: u32, shape: &[u64], data: Vec<u8>) -> Self {
        self = self.tensor(name, ty, shape);
        self.tensors.last_mut().unwrap().data = Some(data);
        self
    }

    /// Sets the data offset written for the last tensor added.
    pub fn at(mut self, offset: u64) -> Self {
        self.tensors.last_mut().unwrap().offset = Some(offset);
        self
    }

    /// The file. Tensor data is laid out in order, each aligned; byte `i` of tensor `t`'s data
    /// is `(t + i) as u8`, so slices can be told apart.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            out.extend(value_type(value).to_le_bytes());
            put_payload(&mut out, value);
        }
        let mut next = 0;
        let mut layout = Vec::new();
        for t in &self.tensors {
            let offset = next;
            next = (offset + data_bytes(t)).next_multiple_of(self.alignment);
            layout.push(offset);
            put_str(&mut out, &t.name);
            out.extend((t.shape.len() as u32).to_le_bytes());
            for d in &t.shape {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.to_le_bytes());
            out.extend(t.offset.unwrap_or(offset).to_le_bytes());
        }
        if self.tensors.is_empty() {
            return out;
        }
        let data_start = (out.len() as u64).next_multiple_of(self.alignment) as usize;
        out.resize(data_start, 0);
        for (i, (t, offset)) in self.tensors.iter().zip(layout).enumerate() {
            out.resize(data_start + offset as usize, 0);
            match &t.data {
                Some(data) => out.extend(data),
                None => out.extend((0..data_bytes(t)).map(|j| (i as u64 + j) as u8)),
            }
        }
        out
    }
}

/// Overwrites the first occurrence of `from` in `bytes` with `to` (no longer than `from`).
pub fn replace(bytes: &mut [u8], from: &[u8], to: &[u8]) {
    let at = bytes
        .windows(from.len())
        .position(|w| w == from)
        .expect("pattern in file");
    bytes[at..at + to.len()].copy_from_slice(to);
}

/// A string metadata value.
pub fn str(s: &str) -> Value {
    Value::String(s.into())
}

/// One small valid file: an f32 vector and a q8_0 matrix.
pub fn small() -> GgufFile {
    GgufFile::default()
        .meta("general.name", str("small"))
        .tensor("a", F32, &[3])
        .tensor("b", Q8_0, &[64, 2])
}

/// A tiny complete qwen2 model, all f32: 1 layer, hidden 8, 2 heads of 4, 1 kv head, FFN 16,
/// vocab 10.
pub fn tiny_qwen2() -> GgufFile {
    let mut f = GgufFile::default()
        .meta("general.architecture", str("qwen2"))
        .meta("qwen2.block_count", Value::U32(1))
        .meta("qwen2.context_length", Value::U32(128))
        .meta("qwen2.embedding_length", Value::U32(8))
        .meta("qwen2.feed_forward_length", Value::U32(16))
        .meta("qwen2.attention.head_count", Value::U32(2))
        .meta("qwen2.attention.head_count_kv", Value::U32(1))
        .meta("qwen2.rope.freq_base", Value::F32(10000.0))
        .meta("qwen2.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
        .tensor("token_embd.weight", F32, &[8, 10])
        .tensor("output_norm.weight", F32, &[8])
        .tensor("output.weight", F32, &[8, 10]);
    for (name, shape) in [
        ("attn_norm.weight", &[8][..]),
        ("attn_q.weight", &[8, 8]),
        ("attn_q.bias", &[8]),
        ("attn_k.weight", &[8, 4]),
        ("attn_k.bias", &[4]),
        ("attn_v.weight", &[8, 4]),
        ("attn_v.bias", &[4]),
        ("attn_output.weight", &[8, 8]),
        ("ffn_norm.weight", &[8]),
        ("ffn_gate.weight", &[8, 16]),
        ("ffn_up.weight", &[8, 16]),
        ("ffn_down.weight", &[16, 8]),
    ] {
        f = f.tensor(&format!("blk.0.{name}"), F32, shape);
    }
    f
}

/// `f` without the tensor called `name`.
pub fn without_tensor(mut f: GgufFile, name: &str) -> GgufFile {
    f.tensors.retain(|t| t.name != name);
    f
}

/// `f` with the tensor called `name` given type `ty` and `shape`.
pub fn with_tensor(mut f: GgufFile, name: &str, ty: u32, shape: &[u64]) -> GgufFile {
    let t = f.tensors.iter_mut().find(|t| t.name == name).unwrap();
    (t.ty, t.shape) = (ty, shape.to_vec());
    f
}

/// `g` with every matrix (every tensor of two dimensions) dequantized and rounded to f16, the
/// other tensors and all metadata as they are: an F16 GGUF of the same model, as llama.cpp's
/// `llama-quantize ... F16` writes one.
pub fn f16_copy(g: &orcd::gguf::Gguf) -> GgufFile {
    let mut f = GgufFile {
        metadata: g.metadata().to_vec(),
        ..GgufFile::default()
    };
    for t in g.tensors() {
        let data = g.tensor_data(t);
        f = if t.shape.len() == 2 {
            let x = orcd::quant::dequantize_to_vec(t.ty, data).expect("a known type");
            let bytes = x
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect();
            f.tensor_with(&t.name, F16, &t.shape, bytes)
        } else {
            f.tensor_with(&t.name, t.ty as u32, &t.shape, data.to_vec())
        };
    }
    f
}
