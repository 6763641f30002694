//! The command line as a user meets it: broken model files, runtime failures, Ctrl-C, closed
//! pipes and help texts, each answered by one plain line and the right exit status.
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use orcd::gguf::Value;
use orcd_tests::gguf_writer::{
    F16, F32, GgufFile, Q8_0, replace, small, str, tiny_qwen2, with_tensor, without_tensor,
};

/// The CLI that cargo built with this test or, in a GPU bundle (this executable in `tests/`),
/// the bundle's `bin/orcd`.
fn orcd() -> Command {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_orcd"));
    if built.exists() {
        return Command::new(built);
    }
    let exe = std::env::current_exe().unwrap();
    Command::new(exe.parent().unwrap().join("../bin/orcd"))
}

fn run(args: &[&str]) -> Output {
    orcd().args(args).output().expect("running orcd")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A file of this test's own directory: under cargo's target dir, or the system's temporary
/// one where that is not there (a GPU bundle).
fn path(name: &str) -> PathBuf {
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let dir = if target.exists() {
        target.join("cli")
    } else {
        std::env::temp_dir().join(format!("orcd-cli-{}", std::process::id()))
    };
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let path = path(&format!("{name}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// `tiny_qwen2` with a tokenizer of one token per vocabulary row, so that `run` gets as far as
/// the model's config and tensors.
fn tiny_model() -> GgufFile {
    with_vocab(tiny_qwen2(), 10)
}

fn with_vocab(f: GgufFile, n: usize) -> GgufFile {
    let tokens = (0..n).map(|i| str(&format!("t{i}"))).collect();
    f.meta("tokenizer.ggml.model", str("gpt2"))
        .meta("tokenizer.ggml.pre", str("qwen2"))
        .meta("tokenizer.ggml.tokens", Value::Array(tokens))
        .meta("tokenizer.ggml.merges", Value::Array(vec![]))
}

/// One crafted file per kind of damage, and the phrase its error must contain.
fn malformed_cases() -> Vec<(PathBuf, &'static str)> {
    let mut cases = Vec::new();
    let mut case = |name: &str, bytes: Vec<u8>, phrase: &'static str| {
        cases.push((write(name, &bytes), phrase))
    };
    let patched = |f: GgufFile, from: &[u8], to: &[u8]| {
        let mut bytes = f.bytes();
        replace(&mut bytes, from, to);
        bytes
    };
    let at = |range: std::ops::Range<usize>, value: &[u8]| {
        let mut bytes = small().bytes();
        bytes[range].copy_from_slice(value);
        bytes
    };

    // The GGUF reader.
    case("empty", vec![], "truncated header: magic ends at byte 4");
    case(
        "bad_magic",
        at(0..4, b"GGML"),
        "not a GGUF file: it starts with \"GGML\"",
    );
    case(
        "version4",
        at(4..8, &4u32.to_le_bytes()),
        "unsupported GGUF version 4",
    );
    case("big_endian", at(4..8, &3u32.to_be_bytes()), "big-endian");
    case(
        "cut_in_metadata",
        small().bytes()[..46].to_vec(),
        "truncated header: metadata entry 0 'general.name' ends at byte 48",
    );
    let whole = small().bytes();
    case(
        "cut_in_data",
        whole[..whole.len() - 1].to_vec(),
        "truncated data: tensor 'b' ends at byte",
    );
    case(
        "tensor_count",
        at(8..16, &u64::MAX.to_le_bytes()),
        "tensor count 18446744073709551615 exceeds the rest of the file",
    );
    case(
        "metadata_count",
        at(16..24, &(1u64 << 40).to_le_bytes()),
        "metadata count 1099511627776 exceeds the rest of the file",
    );
    case(
        "array_count",
        patched(
            small().meta("list", Value::Array(vec![Value::U32(7)])),
            &[4, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7],
            &[4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f],
        ),
        "'list': array count 1152921504606846975 exceeds the rest of the file",
    );
    case(
        "key_length",
        at(24..32, &u64::MAX.to_le_bytes()),
        "string length 18446744073709551615 exceeds the rest of the file",
    );
    case(
        "non_utf8",
        patched(
            small().meta("general.author", str("XXXX")),
            b"XXXX",
            &[0xff, 0xfe, 0xfd, 0xfc],
        ),
        "'general.author': string is not valid UTF-8",
    );
    case(
        "bad_bool",
        patched(
            small().meta("flag", Value::Bool(true)),
            &[7, 0, 0, 0, 1],
            &[7, 0, 0, 0, 2],
        ),
        "'flag': bool byte 2 is neither 0 nor 1",
    );
    case(
        "unknown_value_type",
        patched(
            small().meta("odd", Value::U8(9)),
            &[b'd', 0, 0, 0, 0, 9],
            &[b'd', 13, 0, 0, 0],
        ),
        "'odd': unknown metadata value type 13",
    );
    let mut deep = Value::U8(1);
    for _ in 0..9 {
        deep = Value::Array(vec![deep]);
    }
    case(
        "deep_array",
        small().meta("deep", deep).bytes(),
        "'deep': arrays nested deeper than 8",
    );
    case(
        "duplicate_key",
        small().meta("general.name", str("again")).bytes(),
        "duplicate metadata key 'general.name'",
    );
    case(
        "align48",
        small().meta("general.alignment", Value::U32(48)).bytes(),
        "general.alignment 48 is not a nonzero power of two",
    );
    case(
        "duplicate_tensor",
        small().tensor("a", F32, &[4]).bytes(),
        "duplicate tensor name 'a'",
    );
    case(
        "out_of_bounds",
        small().tensor("c", F32, &[8]).at(1 << 20).bytes(),
        "tensor 'c' data offset 1048576 is out of bounds of the file",
    );
    case(
        "misaligned",
        small().tensor("c", F32, &[1]).at(4).bytes(),
        "tensor 'c' data offset 4 is misaligned (alignment 32)",
    );
    case(
        "overlap",
        small().tensor("c", F32, &[8]).at(64).bytes(),
        "tensor data of 'b' and 'c' overlap",
    );
    case(
        "unknown_type",
        small().tensor("c", 99, &[1]).bytes(),
        "tensor 'c' has unknown tensor type id 99",
    );
    case(
        "row_not_blocks",
        small().tensor("c", Q8_0, &[33, 2]).bytes(),
        "tensor 'c' row length 33 is not a multiple of the q8_0 block size 32",
    );
    case(
        "five_dims",
        small().tensor("c", F32, &[1; 5]).bytes(),
        "tensor 'c' has 5 dimensions (expected 1 to 4)",
    );
    case(
        "zero_dim",
        small().tensor("c", F32, &[4, 0]).bytes(),
        "tensor 'c' has a zero dimension in shape [4, 0]",
    );
    case(
        "row_overflow",
        small().tensor("c", F32, &[1 << 62]).bytes(),
        "tensor 'c' shape [4611686018427387904] overflows",
    );
    case(
        "dims_overflow",
        small().tensor("c", F32, &[1 << 32, 1 << 32]).bytes(),
        "tensor 'c' shape [4294967296, 4294967296] overflows",
    );

    // Valid GGUF, but not a model orcd runs.
    let mut f = tiny_model();
    f.metadata[0].1 = str("llama");
    case(
        "llama",
        f.bytes(),
        "unsupported architecture 'llama' (orcd runs qwen2)",
    );
    let mut f = tiny_model();
    f.metadata
        .retain(|(k, _)| k != "qwen2.attention.head_count_kv");
    case(
        "no_kv_heads",
        f.bytes(),
        "missing metadata key 'qwen2.attention.head_count_kv'",
    );
    let mut f = tiny_model();
    f.metadata[1].1 = str("1");
    case(
        "layers_str",
        f.bytes(),
        "metadata key 'qwen2.block_count' is string, expected a non-negative integer",
    );
    let mut f = tiny_model();
    f.metadata[1].1 = Value::U32(u32::MAX);
    case(
        "many_layers",
        f.bytes(),
        "metadata key 'qwen2.block_count' is 4294967295 but the file has only 15 tensors",
    );
    let mut f = tiny_model();
    f.metadata[6].1 = Value::U32(3);
    case(
        "heads_uneven",
        f.bytes(),
        "2 heads and 3 kv heads do not divide evenly",
    );
    let mut f = tiny_model();
    f.tensors.clear();
    case("no_tensors", f.bytes(), "no tensors: not a model file");
    case(
        "no_ffn_down",
        without_tensor(tiny_model(), "blk.0.ffn_down.weight").bytes(),
        "missing tensor 'blk.0.ffn_down.weight' required by qwen2",
    );
    case(
        "v_shape",
        with_tensor(tiny_model(), "blk.0.attn_v.weight", F32, &[8, 8]).bytes(),
        "tensor 'blk.0.attn_v.weight' has shape [8, 8], expected [8, 4]",
    );
    case(
        "norm_type",
        with_tensor(tiny_model(), "blk.0.ffn_norm.weight", F16, &[8]).bytes(),
        "tensor 'blk.0.ffn_norm.weight' has type f16, expected f32",
    );
    case(
        "short_vocab",
        with_vocab(tiny_qwen2(), 9).bytes(),
        "the tokenizer has 9 tokens, fewer than the model's vocabulary of 10",
    );
    let mut f = tiny_model();
    f.metadata.retain(|(k, _)| k != "tokenizer.ggml.model");
    let f = f.meta("tokenizer.ggml.model", str("llama"));
    case(
        "sentencepiece",
        f.bytes(),
        "tokenizer model 'llama' is not supported",
    );

    // Not a readable file.
    let dir = path("a_directory.gguf");
    std::fs::create_dir_all(&dir).unwrap();
    cases.push((dir, "is a directory, not a GGUF file"));
    let socket = path("a_socket.gguf");
    let _ = std::fs::remove_file(&socket);
    // Bound and closed at once: the socket file stays.
    std::os::unix::net::UnixListener::bind(&socket).unwrap();
    cases.push((socket, "is a pipe, socket or device, not a GGUF file"));
    cases.push((path("missing.gguf"), "no such file"));
    let unreadable = write("unreadable", &small().bytes());
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&unreadable, std::fs::Permissions::from_mode(0o000)).unwrap();
    if std::fs::File::open(&unreadable).is_err() {
        cases.push((unreadable, "Permission denied"));
    } else {
        println!("skipped the unreadable file: root reads every file");
    }
    cases
}

/// Checks that `out` failed with exactly `error: <file>: <message>`, the message saying
/// `phrase` once; returns what is wrong otherwise.
fn one_line_error(out: &Output, file: &Path, phrase: &str) -> Result<(), String> {
    let stderr = text(&out.stderr);
    let prefix = format!("error: {}: ", file.display());
    let one_line = stderr.ends_with('\n') && stderr.lines().count() == 1;
    if out.status.code() == Some(1)
        && one_line
        && stderr.starts_with(&prefix)
        && stderr.matches(phrase).count() == 1
    {
        return Ok(());
    }
    Err(format!(
        "{}: status {:?}, stderr {stderr:?}, expected '{prefix}…{phrase}…'",
        file.display(),
        out.status.code()
    ))
}

#[test]
fn malformed_models_are_one_line_errors() {
    let cases = malformed_cases();
    assert!(cases.len() >= 20, "{} cases", cases.len());
    let mut failures = Vec::new();
    for (file, phrase) in &cases {
        let model = file.to_str().unwrap();
        let runs = [
            run(&[
                "run", "--device", "cpu", "--raw", "--prompt", "hi", "--model", model,
            ]),
            run(&["inspect", "--model", model]),
        ];
        for out in &runs {
            failures.extend(one_line_error(out, file, phrase).err());
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn inspect_prints_the_table_of_a_file_it_cannot_run() {
    let file = write("inspect_llama", &{
        let mut f = tiny_model();
        f.metadata[0].1 = str("llama");
        f.bytes()
    });
    let out = run(&["inspect", "--model", file.to_str().unwrap()]);
    one_line_error(&out, &file, "unsupported architecture 'llama'").unwrap();
    let stdout = text(&out.stdout);
    // 12 tensors of the one layer, 3 outside it.
    assert!(stdout.contains("\ntensors (15)\n"), "{stdout}");
    let row = ["blk.0.ffn_down.weight", "f32", "16", "x", "8", "512"];
    assert!(
        stdout.lines().any(|l| l.split_whitespace().eq(row)),
        "{stdout}"
    );
}

// ---- Runtime failures, on the real model and the CPU ----

fn model() -> String {
    orcd_tests::model_path().to_str().unwrap().to_string()
}

/// The first reference string that has more than `n` tokens, and its token count.
fn text_longer_than(n: usize) -> (String, usize) {
    let refs = orcd_tests::refs();
    let entry = refs["tokenizer"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["ids"].as_array().unwrap().len() > n)
        .expect("a long reference string");
    let ids = entry["ids"].as_array().unwrap().len();
    (entry["text"].as_str().unwrap().to_string(), ids)
}

#[test]
fn prompt_longer_than_the_context_is_refused_with_both_lengths() {
    let (prompt, n) = text_longer_than(8);
    let out = run(&[
        "run",
        "--model",
        &model(),
        "--device",
        "cpu",
        "--ctx",
        "8",
        "--raw",
        "--prompt",
        &prompt,
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        format!("error: the prompt has {n} tokens but the context holds 8\n")
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn zero_max_tokens_is_an_empty_answer() {
    let out = run(&[
        "run",
        "--model",
        &model(),
        "--device",
        "auto",
        "--max-tokens",
        "0",
        "--raw",
        "--prompt",
        "Hello",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    // "Hello" is one token.
    let stats = lines.last().unwrap();
    assert!(
        stats.ends_with("] 1 prompt tokens, 0 generated, stop: max_tokens"),
        "{stderr}"
    );
    if orcd::cuda::is_available() {
        // The weight upload's progress (a plain line: stderr is not a terminal), then the stats.
        assert_eq!(lines.len(), 2, "{stderr}");
        assert!(lines[0].starts_with("uploading weights to "), "{stderr}");
    } else {
        // Auto without a GPU says so in one line and runs on the CPU.
        assert_eq!(lines.len(), 2, "{stderr}");
        assert!(
            lines[0].starts_with("note: no CUDA") && lines[0].ends_with(": running on the CPU"),
            "{stderr}"
        );
        assert!(stats.starts_with("[cpu] "), "{stderr}");
    }
}

#[test]
fn quiet_prints_the_answer_alone() {
    let out = run(&[
        "run",
        "--quiet",
        "--model",
        &model(),
        "--device",
        "cpu",
        "--max-tokens",
        "2",
        "--temperature",
        "0",
        "--raw",
        "--prompt",
        "Hello",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "");
    assert!(!out.stdout.is_empty());
}

#[test]
fn cuda_without_a_gpu_is_a_one_line_error() {
    if orcd::cuda::is_available() {
        println!("skipped: a CUDA device is present");
        return;
    }
    let out = run(&[
        "run",
        "--model",
        &model(),
        "--device",
        "cuda",
        "--prompt",
        "Hello",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("error: --device cuda: no CUDA")
            && stderr.trim_end().ends_with("; use --device cpu or auto")
            && stderr.lines().count() == 1,
        "{stderr}"
    );
}

#[test]
fn gpu_out_of_memory_says_what_is_needed_and_free() {
    if !orcd::cuda::is_available() {
        println!("skipped: no CUDA device");
        return;
    }
    // tiny_model widened to hidden = FFN = kv width = 2^17 (2048 heads of 64): its seven
    // matrices of 2^34 f16 weights need 224 GiB, more than any one GPU has. The file is sparse:
    // every tensor is laid out explicitly and nothing past the header is written.
    let hidden: u64 = 1 << 17;
    let mut f = tiny_model();
    f.metadata[3].1 = Value::U64(hidden);
    f.metadata[4].1 = Value::U64(hidden);
    f.metadata[5].1 = Value::U64(hidden / 64);
    f.metadata[6].1 = Value::U64(hidden / 64);
    let mut end = 0;
    for t in &mut f.tensors {
        for d in t.shape.iter_mut().filter(|d| **d != 10) {
            *d = hidden;
        }
        if t.shape == [hidden, hidden] {
            t.ty = F16;
        }
        let elem_bytes = if t.ty == F16 { 2 } else { 4 };
        t.offset = Some(end);
        end = (end + t.shape.iter().product::<u64>() * elem_bytes).next_multiple_of(32);
    }
    let file = write("huge", &f.bytes());
    let len = std::fs::metadata(&file).unwrap().len() + end;
    std::fs::File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len)
        .unwrap();
    let out = run(&[
        "run",
        "--model",
        file.to_str().unwrap(),
        "--device",
        "cuda",
        "--raw",
        "--prompt",
        "t1",
    ]);
    std::fs::remove_file(&file).unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: ")
            && stderr.lines().count() == 1
            && stderr.contains("not enough GPU memory: the model needs 22")
            && stderr.contains(" GiB are free"),
        "{stderr}"
    );
}

/// Starts a long greedy generation on the CPU and returns it once its first text is out.
fn start_generation(extra: &[&str]) -> (Child, Vec<u8>) {
    let mut child = orcd()
        .args([
            "run",
            "--model",
            &model(),
            "--device",
            "cpu",
            "--temperature",
            "0",
        ])
        .args([
            "--max-tokens",
            "300",
            "--raw",
            "--prompt",
            "Once upon a time",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting orcd");
    let mut first = vec![0; 64];
    let n = child.stdout.as_mut().unwrap().read(&mut first).unwrap();
    assert!(n > 0, "no output");
    first.truncate(n);
    (child, first)
}

#[test]
fn ctrl_c_stops_the_generation_and_keeps_the_answer() {
    let (mut child, first) = start_generation(&[]);
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let mut rest = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    let stats = stderr.lines().last().unwrap_or_default();
    assert!(stats.contains(" generated, stop: cancelled"), "{stderr}");
    let generated: usize = stats
        .split(" prompt tokens, ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {stats:?}"));
    assert!((1..300).contains(&generated), "{stats}");
    // What was streamed stands, ended by a newline.
    let answer = [first, rest].concat();
    assert!(answer.len() > 1 && answer.ends_with(b"\n"), "{answer:?}");
}

#[test]
fn closed_stdout_ends_quietly() {
    let (mut child, _) = start_generation(&[]);
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "");
}

// ---- Help ----

/// Every option of every subcommand says its default, or is a flag, or is (or may be) required.
#[test]
fn help_lists_every_option_with_its_default() {
    let top = text(&run(&["--help"]).stdout);
    let subcommands: Vec<&str> = top
        .split("Commands:\n")
        .nth(1)
        .unwrap()
        .lines()
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|&c| c != "help")
        .collect();
    assert!(
        subcommands.contains(&"run") && subcommands.contains(&"inspect"),
        "{top}"
    );
    let mut missing = Vec::new();
    for sub in subcommands {
        let help = text(&run(&[sub, "--help"]).stdout);
        let usage = help.lines().find(|l| l.starts_with("Usage:")).unwrap_or("");
        for option in options(&help) {
            let name = option
                .split_whitespace()
                .find(|w| w.starts_with("--"))
                .unwrap();
            let takes_value = option.lines().next().unwrap().contains('<');
            let required = usage.contains(&format!("{name} <"));
            let says_default = option.contains("[default: ") || option.contains("(default: ");
            if takes_value && !required && !says_default && !option.contains("required") {
                missing.push(format!("{sub} {name}"));
            }
        }
        for positional in help.split("Arguments:\n").skip(1) {
            let first = positional.lines().next().unwrap_or("");
            if first.contains("[") && !positional.contains("[default: ") {
                missing.push(format!("{sub} {first}"));
            }
        }
    }
    assert!(missing.is_empty(), "no default shown: {missing:?}");
}

/// The option entries (`  -x, --name <V>  help…`, with any continuation lines) of a help text.
fn options(help: &str) -> Vec<String> {
    let mut entries: Vec<String> = Vec::new();
    let section = help.split("Options:\n").nth(1).unwrap_or("");
    for line in section.lines().take_while(|l| !l.is_empty()) {
        match entries.last_mut() {
            Some(last) if !line.trim_start().starts_with('-') => {
                last.push('\n');
                last.push_str(line);
            }
            _ => entries.push(line.to_string()),
        }
    }
    entries
}

/// Opening the model must not copy it: `inspect` (which opens it, checks the config and tensors
/// and prints the table) peaks under 100 MB of RSS on the 491 MB file. Measured on its own
/// process (wait4's rusage), so other tests' memory does not count.
#[test]
fn inspect_does_not_copy_the_model() {
    #[allow(clippy::zombie_processes)] // reaped by wait4 below, which also gives its rusage
    let child = orcd()
        .args(["inspect", "--model", &model()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
    // SAFETY: waits for our own child; `status` and `usage` are valid for writes.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "inspect failed"
    );
    let peak_mb = usage.ru_maxrss / 1024; // ru_maxrss is in kB on Linux
    println!("inspect of the default model: peak RSS {peak_mb} MB");
    assert!(peak_mb < 100, "inspect peaked at {peak_mb} MB of RSS");
}
