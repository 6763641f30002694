//! The GGUF reader and the Qwen2 config: the real default model, and small crafted files with
//! each kind of damage the reader must report as a one-line error naming the file.
use std::collections::HashMap;
use std::path::PathBuf;

use orcd::config::Config;
use orcd::gguf::{Gguf, Value};
use orcd::quant::GgmlType;
use orcd_tests::gguf_writer::{
    F16, F32, GgufFile, Q8_0, replace, small, str, tiny_qwen2, with_tensor, without_tensor,
};

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
    assert_open_err("bad_magic", &bytes, "not a GGUF file: it starts with");
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

// ---- The real model under test (`ORCD_MODEL`) ----

/// What an independent reading of a known model file's header (and its model card) gives:
/// the facts `real_model_header_and_config` checks, found by the file's size.
struct FileFacts {
    name: &'static str,
    bytes: u64,
    metadata: usize,
    /// Tensors of each type; F32: 5 norms and biases per layer and output_norm.
    types: &'static [(GgmlType, usize)],
    /// Where the tensor data starts: the header's end, aligned to 32.
    data_start: u64,
    /// The data offset of output_norm.weight, the last tensor, which ends the file.
    norm_offset: u64,
    /// output.weight, the first tensor: its type and bytes.
    output: (GgmlType, u64),
    config: Config,
}

const KNOWN_FILES: [FileFacts; 2] = [
    FileFacts {
        name: "qwen2.5-coder-0.5b-instruct-q4_k_m",
        bytes: 491_400_064,
        metadata: 26,
        types: &[
            (GgmlType::F32, 24 * 5 + 1),
            (GgmlType::Q5_0, 133),
            (GgmlType::Q8_0, 13),
            (GgmlType::Q4K, 12),
            (GgmlType::Q6K, 12),
        ],
        // The header ends at byte 5,947,750.
        data_start: 5_947_776,
        norm_offset: 485_448_704,
        // q8_0 rows of 896: 28 blocks of 34 bytes.
        output: (GgmlType::Q8_0, 28 * 34 * 151_936),
        config: Config {
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
        },
    },
    FileFacts {
        name: "qwen2.5-coder-1.5b-instruct-q4_k_m",
        bytes: 1_117_320_768,
        metadata: 26,
        types: &[
            (GgmlType::F32, 28 * 5 + 1),
            (GgmlType::Q4K, 169),
            (GgmlType::Q6K, 29),
        ],
        // The header ends at byte 5,950,506.
        data_start: 5_950_528,
        norm_offset: 1_111_364_096,
        // q6_K rows of 1536: 6 blocks of 210 bytes.
        output: (GgmlType::Q6K, 6 * 210 * 151_936),
        config: Config {
            n_layers: 28,
            hidden: 1536,
            n_heads: 12,
            n_kv_heads: 2,
            head_dim: 128,
            ffn: 8960,
            vocab: 151_936,
            ctx_len: 32_768,
            rope_theta: 1e6,
            rms_eps: 1e-6,
            tied_output: false,
        },
    },
];

#[test]
fn real_model_header_and_config() {
    let path = orcd_tests::model_path();
    let g = Gguf::open(&path).unwrap();
    let Some(f) = KNOWN_FILES.iter().find(|f| f.bytes == g.file_size()) else {
        let known: Vec<_> = KNOWN_FILES.iter().map(|f| (f.name, f.bytes)).collect();
        panic!(
            "{}: {} bytes is no known model file; known: {known:?}",
            path.display(),
            g.file_size()
        );
    };
    println!("{}: the facts of {}", path.display(), f.name);

    assert_eq!(g.version(), 3);
    assert_eq!(g.metadata().len(), f.metadata);
    assert_eq!(g.metadata()[0].0, "general.architecture");
    // Both models have Qwen2.5's tokenizer.
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
    let mut counts = HashMap::new();
    for t in g.tensors() {
        *counts.entry(t.ty).or_insert(0) += 1;
    }
    assert_eq!(counts, HashMap::from_iter(f.types.iter().copied()));
    assert_eq!(
        g.tensors().len(),
        f.types.iter().map(|t| t.1).sum::<usize>()
    );

    let hidden = f.config.hidden as u64;
    let norm = g.tensor("output_norm.weight").unwrap();
    assert_eq!(
        (norm.offset, norm.bytes),
        (f.data_start + f.norm_offset, hidden * 4)
    );
    assert_eq!(
        norm.offset + norm.bytes,
        f.bytes,
        "output_norm ends the file"
    );
    assert_eq!(g.tensor_data(norm).len() as u64, hidden * 4);
    let out = g.tensor("output.weight").unwrap();
    assert_eq!(
        (out.ty, out.offset, out.bytes),
        (f.output.0, f.data_start, f.output.1)
    );

    let c = Config::from_gguf(&g).unwrap();
    assert_eq!(c, f.config);
    c.check_tensors(&g).unwrap();
}
