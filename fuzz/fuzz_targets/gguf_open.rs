//! Arbitrary bytes as a GGUF file: opening it, reading its config, tensors and tokenizer, and
//! dequantizing every tensor must return `Ok` or an `Err`, never panic, hang or exhaust memory.
#![no_main]

use std::path::PathBuf;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use orcd::config::Config;
use orcd::gguf::Gguf;
use orcd::quant::dequantize_to_vec;
use orcd::tokenizer::Tokenizer;

/// One file per fuzzing process, rewritten for every input (`Gguf::open` takes a path).
static FILE: LazyLock<PathBuf> =
    LazyLock::new(|| std::env::temp_dir().join(format!("orcd-fuzz-{}.gguf", std::process::id())));

fuzz_target!(|data: &[u8]| {
    std::fs::write(&*FILE, data).expect("writing the input file");
    let Ok(g) = Gguf::open(&FILE) else { return };
    if let Ok(c) = Config::from_gguf(&g) {
        let _ = c.check_tensors(&g);
    }
    let _ = Tokenizer::from_gguf(&g);
    for t in g.tensors() {
        let _ = dequantize_to_vec(t.ty, g.tensor_data(t));
    }
});
