//! Arbitrary token ids (4 bytes each, any u32) through the default model's tokenizer: `decode`
//! and the streaming decoder must agree, and an id outside the vocabulary must be an `Err` of
//! both, never a panic.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use orcd::gguf::Gguf;
use orcd::tokenizer::Tokenizer;

/// The real tokenizer, built once: `$ORCD_MODEL`, else models.lock's default (fetched if missing).
static TOKENIZER: LazyLock<Tokenizer> = LazyLock::new(|| {
    let path = match std::env::var_os("ORCD_MODEL") {
        Some(p) => p.into(),
        None => orcd::models::resolve(orcd::models::default_model()).expect("the default model"),
    };
    Tokenizer::from_gguf(&Gguf::open(&path).expect("opening the model")).expect("its tokenizer")
});

fuzz_target!(|data: &[u8]| {
    let tok = &*TOKENIZER;
    let ids: Vec<u32> = data
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let in_range = ids.iter().all(|&id| (id as usize) < tok.vocab_size());
    let whole = tok.decode(&ids);
    assert_eq!(whole.is_ok(), in_range, "decode of {ids:?}");

    let mut stream = tok.stream();
    let mut text = String::new();
    for &id in &ids {
        match stream.push(id) {
            Ok(piece) => text.extend(piece),
            Err(_) => {
                assert!((id as usize) >= tok.vocab_size(), "push({id}) failed");
                return;
            }
        }
    }
    text.push_str(&stream.finish().expect("finish after valid ids"));
    assert_eq!(text, whole.expect("valid ids decode"), "stream of {ids:?}");
});
