//! The GGUF reader and the Qwen2 config: the real default model, and small crafted files with
//! each kind of damage the reader must report as a one-line error naming the file.
use std::collections::HashMap;
use std::path::PathBuf;

use orcd::config::Config;
use orcd::gguf::{Gguf, Value};
use orcd::quant::GgmlType;

// ---- A tiny GGUF writer, for crafting test files ----

const F32: u32 = 0;
const F16: u32 = 1;
const Q8_0: u32 = 8;

struct TensorSpec {
    name: String,
    ty: u32,
    shape: Vec<u64>,
    /// Data offset to write instead of the laid-out one.
    offset: Option<u64>,
}

struct GgufFile {
    version: u32,
    /// Layout alignment; the `general.alignment` key is set separately, as a test needs.
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorSpec>,
}

/// Data bytes written for a tensor, from the ggml block layouts: f32 4 bytes, f16 2, q8_0 34
/// per 32. Huge shapes (which the reader must refuse from the header alone) get no data.
fn data_bytes(ty: u32, shape: &[u64]) -> u64 {
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

impl GgufFile {
    fn new() -> Self {
        GgufFile {
            version: 3,
            alignment: 32,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    fn meta(mut self, key: &str, value: Value) -> Self {
        self.metadata.push((key.into(), value));
        self
    }

    fn tensor(mut self, name: &str, ty: u32, shape: &[u64]) -> Self {
        self.tensors.push(TensorSpec {
            name: name.into(),
            ty,
            shape: shape.to_vec(),
            offset: None,
        });
        self
    }

    /// Sets the data offset written for the last tensor added.
    fn at(mut self, offset: u64) -> Self {
        self.tensors.last_mut().unwrap().offset = Some(offset);
        self
    }

    /// The file. Tensor data is laid out in order, each aligned; byte `i` of tensor `t`'s data
    /// is `(t + i) as u8`, so slices can be told apart.
    fn bytes(&self) -> Vec<u8> {
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
            next = (offset + data_bytes(t.ty, &t.shape)).next_multiple_of(self.alignment);
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
            out.extend((0..data_bytes(t.ty, &t.shape)).map(|j| (i as u64 + j) as u8));
        }
        out
    }
}

/// Writes `bytes` to a file of its own (tests run in parallel) and returns its path.
fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gguf_validation");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Opens the crafted file and returns the error, after checking it is one line naming the file.
fn open_err(name: &str, bytes: &[u8]) -> String {
    let path = write(name, bytes);
    let Err(e) = Gguf::open(&path) else {
        panic!("{name}: opened without error")
    };
    let msg = e.to_string();
    assert!(msg.contains(&format!("{name}.gguf")), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
    msg
}

fn assert_open_err(name: &str, bytes: &[u8], phrase: &str) {
    let msg = open_err(name, bytes);
    assert!(msg.contains(phrase), "expected '{phrase}' in: {msg}");
}

fn replace(bytes: &mut [u8], from: &[u8], to: &[u8]) {
    let at = bytes
        .windows(from.len())
        .position(|w| w == from)
        .expect("pattern in file");
    bytes[at..at + to.len()].copy_from_slice(to);
}

fn str(s: &str) -> Value {
    Value::String(s.into())
}

/// One small valid file: an f32 vector and a q8_0 matrix.
fn small() -> GgufFile {
    GgufFile::new()
        .meta("general.name", str("small"))
        .tensor("a", F32, &[3])
        .tensor("b", Q8_0, &[64, 2])
}

// ---- Valid files ----

#[test]
fn reads_every_value_type_and_tensor_data() {
    let metadata = vec![
        ("u8".to_string(), Value::U8(200)),
        ("i8".into(), Value::I8(-100)),
        ("u16".into(), Value::U16(60000)),
        ("i16".into(), Value::I16(-30000)),
        ("u32".into(), Value::U32(4_000_000_000)),
        ("i32".into(), Value::I32(-2_000_000_000)),
        ("u64".into(), Value::U64(u64::MAX)),
        ("i64".into(), Value::I64(i64::MIN)),
        ("f32".into(), Value::F32(1.5)),
        ("f64".into(), Value::F64(-2.25)),
        ("bool".into(), Value::Bool(true)),
        ("string".into(), str("héllo")),
        ("empty".into(), str("")),
        ("array".into(), Value::Array(vec![str("x"), str("yz")])),
        (
            "nested".into(),
            Value::Array(vec![
                Value::Array(vec![Value::I16(1), Value::I16(-2)]),
                Value::Array(vec![Value::I16(3)]),
            ]),
        ),
    ];
    let mut file = small();
    file.metadata = metadata.clone();
    let path = write("every_value_type", &file.bytes());
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.metadata(), &metadata[..]);
    assert_eq!(g.get("string"), Some(&str("héllo")));
    assert_eq!(g.get_str("string").unwrap(), "héllo");
    assert_eq!(g.get_u64("u16").unwrap(), 60000);
    assert_eq!(g.get_u64("u64").unwrap(), u64::MAX);
    assert_eq!(g.get_f32("f64").unwrap(), -2.25);
    assert_eq!(g.get_str_array("array").unwrap(), ["x", "yz"]);
    assert_eq!(
        g.get("i8").unwrap().as_u64(),
        None,
        "negative integers are not u64"
    );

    // Header: 24 fixed bytes, then the metadata and the two tensor infos; data aligned to 32.
    let a = g.tensor("a").unwrap();
    assert_eq!(
        (a.ty, a.shape.as_slice(), a.bytes),
        (GgmlType::F32, &[3u64][..], 12)
    );
    assert_eq!(a.offset % 32, 0);
    assert_eq!(g.tensor_data(a), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
    let b = g.tensor("b").unwrap();
    assert_eq!(
        (b.ty, b.shape.as_slice(), b.bytes),
        (GgmlType::Q8_0, &[64u64, 2][..], 4 * 34)
    );
    assert_eq!(
        b.offset,
        a.offset + 32,
        "b follows a's 12 bytes, padded to 32"
    );
    assert_eq!(g.tensor_data(b)[..3], [1, 2, 3]);
    assert_eq!(g.file_size(), b.offset + 136);
    assert_eq!(
        g.tensors()
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );
}

#[test]
fn reads_version_2_and_custom_alignment() {
    let mut file = small().meta("general.alignment", Value::U32(64));
    file.version = 2;
    file.alignment = 64;
    let g = Gguf::open(&write("v2_align64", &file.bytes())).unwrap();
    assert_eq!((g.version(), g.alignment()), (2, 64));
    let (a, b) = (g.tensor("a").unwrap(), g.tensor("b").unwrap());
    assert_eq!((a.offset % 64, b.offset - a.offset), (0, 64));
    assert_eq!(g.tensor_data(b)[..2], [1, 2]);
}

#[test]
fn lookup_errors_name_the_key_or_tensor() {
    let g = Gguf::open(&write("lookups", &small().bytes())).unwrap();
    let err = |r: Result<(), orcd::Error>| r.unwrap_err().to_string();
    let msg = err(g.get_u64("nope").map(drop));
    assert!(
        msg.contains("lookups.gguf") && msg.contains("missing metadata key 'nope'"),
        "{msg}"
    );
    let msg = err(g.get_u64("general.name").map(drop));
    assert!(
        msg.contains("metadata key 'general.name' is string, expected a non-negative integer"),
        "{msg}"
    );
    let msg = err(g.get_str_array("general.name").map(drop));
    assert!(msg.contains("expected an array of strings"), "{msg}");
    let msg = err(g.tensor("c").map(drop));
    assert!(
        msg.contains("lookups.gguf") && msg.contains("no tensor named 'c'"),
        "{msg}"
    );
}

// ---- Malformed files: one test per kind of damage ----

#[test]
fn bad_magic() {
    let mut bytes = small().bytes();
    bytes[..4].copy_from_slice(b"GGML");
    assert_open_err("bad_magic", &bytes, "bad magic");
    assert_open_err(
        "empty",
        b"",
        "truncated header: magic ends at byte 4 past the end of the file (0 bytes)",
    );
}

#[test]
fn unsupported_version() {
    let mut bytes = small().bytes();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert_open_err("version1", &bytes, "unsupported GGUF version 1");
    bytes[4..8].copy_from_slice(&4u32.to_le_bytes());
    assert_open_err("version4", &bytes, "unsupported GGUF version 4");
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert_open_err("big_endian", &bytes, "big-endian");
}

#[test]
fn truncated_header() {
    let bytes = small().bytes();
    // 24 fixed bytes, then "general.name" = "small": 8 + 12 + 4 + 8 + 5 = 37 bytes.
    let infos_start = 24 + 37;
    assert_open_err(
        "cut_in_counts",
        &bytes[..20],
        "truncated header: metadata count ends at byte 24",
    );
    // Cut in the value's type field, bytes 44..48.
    assert_open_err(
        "cut_in_metadata",
        &bytes[..46],
        "truncated header: metadata entry 0 'general.name' ends at byte 48",
    );
    // Tensor info "a": name 8 + 1, n_dims 4, one dim 8, type 4, offset 8 = 33 bytes; then "b"
    // takes 41, its offset field last. Cut in that field:
    assert_open_err(
        "cut_in_tensor_info",
        &bytes[..infos_start + 70],
        "truncated header: tensor info 1 'b' ends at byte 135",
    );
}

#[test]
fn truncated_data() {
    let bytes = small().bytes();
    let msg = open_err("cut_in_data", &bytes[..bytes.len() - 1]);
    assert!(
        msg.contains("truncated data: tensor 'b' ends at byte"),
        "{msg}"
    );
    assert!(
        msg.contains(&format!(
            "past the end of the file ({} bytes)",
            bytes.len() - 1
        )),
        "{msg}"
    );
}

#[test]
fn counts_that_exceed_the_file() {
    let mut bytes = small().bytes();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_open_err(
        "tensor_count",
        &bytes,
        "tensor count 18446744073709551615 exceeds the rest of the file",
    );
    let mut bytes = small().bytes();
    bytes[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert_open_err(
        "metadata_count",
        &bytes,
        "metadata count 1099511627776 exceeds the rest of the file",
    );
    let mut bytes = small()
        .meta("list", Value::Array(vec![Value::U32(7)]))
        .bytes();
    replace(
        &mut bytes,
        &[4, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7],
        &[4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f],
    );
    assert_open_err(
        "array_count",
        &bytes,
        "metadata entry 1 'list': array count 1152921504606846975 exceeds the rest of the file",
    );
}

#[test]
fn string_lengths_that_exceed_the_file() {
    let mut bytes = small().bytes();
    bytes[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_open_err(
        "key_length",
        &bytes,
        "metadata entry 0: string length 18446744073709551615 exceeds the rest of the file",
    );
    let mut bytes = small().bytes();
    replace(
        &mut bytes,
        &[5, 0, 0, 0, 0, 0, 0, 0, b's'],
        &[0, 0, 0, 0, 0, 0, 0, 0x80],
    );
    assert_open_err(
        "value_length",
        &bytes,
        "metadata entry 0 'general.name': string length 9223372036854775808 exceeds",
    );
}

#[test]
fn non_utf8_string_names_the_key() {
    let mut bytes = small().meta("general.author", str("XXXX")).bytes();
    replace(&mut bytes, b"XXXX", &[0xff, 0xfe, 0xfd, 0xfc]);
    assert_open_err(
        "non_utf8",
        &bytes,
        "metadata entry 1 'general.author': string is not valid UTF-8",
    );
}

#[test]
fn bad_metadata_values() {
    let mut bytes = small().meta("flag", Value::Bool(true)).bytes();
    replace(&mut bytes, &[7, 0, 0, 0, 1], &[7, 0, 0, 0, 2]);
    assert_open_err("bad_bool", &bytes, "'flag': bool byte 2 is neither 0 nor 1");
    let mut bytes = small().meta("odd", Value::U8(9)).bytes();
    replace(&mut bytes, &[b'd', 0, 0, 0, 0, 9], &[b'd', 13, 0, 0, 0]);
    assert_open_err(
        "unknown_value_type",
        &bytes,
        "'odd': unknown metadata value type 13",
    );
    let mut deep = Value::U8(1);
    for _ in 0..9 {
        deep = Value::Array(vec![deep]);
    }
    assert_open_err(
        "deep_array",
        &small().meta("deep", deep).bytes(),
        "'deep': arrays nested deeper than 8",
    );
    let dup = small().meta("general.name", str("again"));
    assert_open_err(
        "duplicate_key",
        &dup.bytes(),
        "duplicate metadata key 'general.name'",
    );
}

#[test]
fn bad_alignment() {
    for (name, value, phrase) in [
        (
            "align0",
            Value::U32(0),
            "general.alignment 0 is not a nonzero power of two",
        ),
        (
            "align48",
            Value::U32(48),
            "general.alignment 48 is not a nonzero power of two",
        ),
        (
            "align_str",
            str("32"),
            "general.alignment is string, expected an unsigned integer",
        ),
    ] {
        assert_open_err(
            name,
            &small().meta("general.alignment", value).bytes(),
            phrase,
        );
    }
}

#[test]
fn duplicate_tensor_names() {
    assert_open_err(
        "duplicate_tensor",
        &small().tensor("a", F32, &[4]).bytes(),
        "duplicate tensor name 'a'",
    );
}

#[test]
fn tensor_data_out_of_bounds() {
    let far = small().tensor("c", F32, &[8]).at(1 << 20);
    assert_open_err(
        "out_of_bounds",
        &far.bytes(),
        "tensor 'c' data offset 1048576 is out of bounds of the file",
    );
    let wraps = small().tensor("c", F32, &[8]).at(u64::MAX - 31);
    assert_open_err(
        "offset_overflow",
        &wraps.bytes(),
        "tensor 'c' data offset 18446744073709551584 is out of bounds",
    );
}

#[test]
fn misaligned_tensor_data() {
    assert_open_err(
        "misaligned",
        &small().tensor("c", F32, &[1]).at(4).bytes(),
        "tensor 'c' data offset 4 is misaligned (alignment 32)",
    );
}

#[test]
fn overlapping_tensor_data() {
    // "c" claims the 32 bytes where "b"'s 136 bytes lie.
    assert_open_err(
        "overlap",
        &small().tensor("c", F32, &[8]).at(64).bytes(),
        "tensor data of 'b' and 'c' overlap",
    );
}

#[test]
fn unknown_tensor_type() {
    assert_open_err(
        "unknown_type",
        &small().tensor("c", 99, &[1]).bytes(),
        "tensor 'c' has unknown tensor type id 99",
    );
}

#[test]
fn shape_type_size_mismatch() {
    assert_open_err(
        "row_not_blocks",
        &small().tensor("c", Q8_0, &[33, 2]).bytes(),
        "tensor 'c' row length 33 is not a multiple of the q8_0 block size 32",
    );
}

#[test]
fn bad_shapes() {
    assert_open_err(
        "zero_dims",
        &small().tensor("c", F32, &[]).bytes(),
        "tensor 'c' has 0 dimensions (expected 1 to 4)",
    );
    assert_open_err(
        "five_dims",
        &small().tensor("c", F32, &[1; 5]).bytes(),
        "tensor 'c' has 5 dimensions (expected 1 to 4)",
    );
    assert_open_err(
        "zero_dim",
        &small().tensor("c", F32, &[4, 0]).bytes(),
        "tensor 'c' has a zero dimension in shape [4, 0]",
    );
    assert_open_err(
        "dims_overflow",
        &small().tensor("c", F32, &[1 << 32, 1 << 32]).bytes(),
        "tensor 'c' shape [4294967296, 4294967296] overflows",
    );
    // The element count fits in a u64 but the byte count does not.
    assert_open_err(
        "bytes_overflow",
        &small().tensor("c", F32, &[1 << 31, 1 << 31]).bytes(),
        "tensor 'c' shape [2147483648, 2147483648] overflows",
    );
}

// ---- The Qwen2 config ----

/// A tiny complete qwen2 model, all f32: 1 layer, hidden 8, 2 heads of 4, 1 kv head, FFN 16,
/// vocab 10.
fn tiny_qwen2() -> GgufFile {
    let mut f = GgufFile::new()
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

/// The error of `Config::from_gguf` then `check_tensors`, checked to be one line naming the file.
fn config_err(name: &str, file: &GgufFile) -> String {
    let g = Gguf::open(&write(name, &file.bytes())).unwrap();
    let Err(e) = Config::from_gguf(&g).and_then(|c| c.check_tensors(&g)) else {
        panic!("{name}: accepted")
    };
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("{name}.gguf")) && !msg.contains('\n'),
        "{msg}"
    );
    msg
}

fn assert_config_err(name: &str, file: &GgufFile, phrase: &str) {
    let msg = config_err(name, file);
    assert!(msg.contains(phrase), "expected '{phrase}' in: {msg}");
}

fn without_tensor(mut f: GgufFile, name: &str) -> GgufFile {
    f.tensors.retain(|t| t.name != name);
    f
}

fn with_tensor(mut f: GgufFile, name: &str, ty: u32, shape: &[u64]) -> GgufFile {
    let t = f.tensors.iter_mut().find(|t| t.name == name).unwrap();
    (t.ty, t.shape) = (ty, shape.to_vec());
    f
}

#[test]
fn tiny_qwen2_config() {
    let g = Gguf::open(&write("tiny_qwen2", &tiny_qwen2().bytes())).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    let expected = Config {
        n_layers: 1,
        hidden: 8,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 4,
        ffn: 16,
        vocab: 10,
        ctx_len: 128,
        rope_theta: 10000.0,
        rms_eps: 1e-5,
        tied_output: false,
    };
    assert_eq!(c, expected);
    c.check_tensors(&g).unwrap();

    let tied = without_tensor(tiny_qwen2(), "output.weight");
    let g = Gguf::open(&write("tiny_qwen2_tied", &tied.bytes())).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    assert!(c.tied_output);
    c.check_tensors(&g).unwrap();
}

#[test]
fn unsupported_architecture() {
    let mut f = tiny_qwen2();
    f.metadata[0].1 = str("llama");
    assert_config_err(
        "llama",
        &f,
        "unsupported architecture 'llama' (orcd runs qwen2)",
    );
}

#[test]
fn missing_metadata() {
    let mut f = tiny_qwen2();
    f.metadata
        .retain(|(k, _)| k != "qwen2.attention.head_count_kv");
    assert_config_err(
        "no_kv_heads",
        &f,
        "missing metadata key 'qwen2.attention.head_count_kv'",
    );
    let mut f = tiny_qwen2();
    f.metadata.remove(0);
    assert_config_err("no_arch", &f, "missing metadata key 'general.architecture'");
    let mut f = tiny_qwen2();
    f.metadata[1].1 = str("1");
    assert_config_err(
        "layers_str",
        &f,
        "metadata key 'qwen2.block_count' is string, expected a non-negative integer",
    );
    let mut f = tiny_qwen2();
    f.metadata[6].1 = Value::U32(3);
    assert_config_err(
        "heads_uneven",
        &f,
        "2 heads and 3 kv heads do not divide evenly",
    );
}

#[test]
fn no_tensors() {
    let mut f = tiny_qwen2();
    f.tensors.clear();
    assert_config_err("no_tensors", &f, "no tensors: not a model file");
}

#[test]
fn missing_tensors() {
    let f = without_tensor(tiny_qwen2(), "token_embd.weight");
    assert_config_err("no_embd", &f, "no tensor named 'token_embd.weight'");
    let f = without_tensor(tiny_qwen2(), "blk.0.ffn_down.weight");
    assert_config_err(
        "no_ffn_down",
        &f,
        "missing tensor 'blk.0.ffn_down.weight' required by qwen2",
    );
    let f = without_tensor(tiny_qwen2(), "blk.0.attn_k.bias");
    assert_config_err(
        "no_k_bias",
        &f,
        "missing tensor 'blk.0.attn_k.bias' required by qwen2",
    );
}

#[test]
fn wrong_tensor_shape_or_type() {
    let f = with_tensor(tiny_qwen2(), "blk.0.attn_v.weight", F32, &[8, 8]);
    assert_config_err(
        "v_shape",
        &f,
        "tensor 'blk.0.attn_v.weight' has shape [8, 8], expected [8, 4]",
    );
    let f = with_tensor(tiny_qwen2(), "token_embd.weight", F32, &[10, 8]);
    assert_config_err(
        "embd_shape",
        &f,
        "tensor 'token_embd.weight' has shape [10, 8], expected [8, vocab]",
    );
    let f = with_tensor(tiny_qwen2(), "blk.0.ffn_norm.weight", F16, &[8]);
    assert_config_err(
        "norm_type",
        &f,
        "tensor 'blk.0.ffn_norm.weight' has type f16, expected f32",
    );
}

// ---- The real default model ----

/// A `/proc/self/status` field in kB (Linux).
fn status_kb(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

#[test]
fn real_model_header_and_config() {
    let path = orcd_tests::model_path();
    let rss_before = status_kb("VmRSS:");
    let g = Gguf::open(&path).unwrap();
    // Peak during the open is at most the high-water mark now; its rise over the RSS before
    // bounds what the open took (other tests in this process only add to it).
    if let (Some(before), Some(peak)) = (rss_before, status_kb("VmHWM:")) {
        let grown_mb = peak.saturating_sub(before) / 1024;
        println!("peak RSS grew by at most {grown_mb} MB while opening");
        assert!(
            grown_mb < 100,
            "opening the model raised peak RSS by {grown_mb} MB"
        );
    }

    // Expected values from an independent reading of the file's header (and the model card).
    assert_eq!(g.version(), 3);
    assert_eq!(g.file_size(), 491_400_064);
    assert_eq!(g.metadata().len(), 26);
    assert_eq!(g.metadata()[0].0, "general.architecture");
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        151_936
    );
    assert_eq!(
        g.get("tokenizer.ggml.merges")
            .and_then(Value::as_array)
            .map(<[_]>::len),
        Some(151_387)
    );
    assert_eq!(g.get_u64("tokenizer.ggml.eos_token_id").unwrap(), 151_645);
    assert_eq!(g.tensors().len(), 291);
    let mut counts = HashMap::new();
    for t in g.tensors() {
        *counts.entry(t.ty).or_insert(0) += 1;
    }
    use GgmlType::*;
    // F32: 5 norms and biases per layer and output_norm.
    assert_eq!(
        counts,
        HashMap::from([
            (F32, 24 * 5 + 1),
            (Q5_0, 133),
            (Q8_0, 13),
            (Q4K, 12),
            (Q6K, 12)
        ])
    );

    // The header ends at byte 5,947,750, so data starts at 5,947,776. The last tensor,
    // output_norm.weight (896 f32), lies at data offset 485,448,704 and ends the file.
    let norm = g.tensor("output_norm.weight").unwrap();
    assert_eq!(
        (norm.offset, norm.bytes),
        (5_947_776 + 485_448_704, 896 * 4)
    );
    assert_eq!(g.tensor_data(norm).len(), 3584);
    // output.weight, q8_0 [896, 151936], comes first: 28 blocks of 34 bytes per row.
    let out = g.tensor("output.weight").unwrap();
    assert_eq!(
        (out.ty, out.offset, out.bytes),
        (Q8_0, 5_947_776, 28 * 34 * 151_936)
    );

    let c = Config::from_gguf(&g).unwrap();
    let expected = Config {
        n_layers: 24,
        hidden: 896,
        n_heads: 14,
        n_kv_heads: 2,
        head_dim: 64,
        ffn: 4864,
        vocab: 151_936,
        ctx_len: 32_768,
        rope_theta: 1e6,
        rms_eps: 1e-6,
        tied_output: false,
    };
    assert_eq!(c, expected);
    c.check_tensors(&g).unwrap();
}
