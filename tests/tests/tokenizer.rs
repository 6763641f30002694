//! The GGUF tokenizer and chat template against Hugging Face's reference ids.
use std::sync::OnceLock;

use orcd::chat::Message;
use orcd::gguf::Gguf;
use orcd::tokenizer::Tokenizer;
use serde_json::Value;

/// The default model's tokenizer, built once (the model is fetched on first use).
fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let g = Gguf::open(&orcd_tests::model_path()).expect("opening the model");
        Tokenizer::from_gguf(&g).expect("building the tokenizer")
    })
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("ids are a list of u32")
}

fn prompt(kind: &str) -> Value {
    orcd_tests::refs()["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .find(|p| p["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} prompt in the refs"))
        .clone()
}

#[test]
fn reference_strings_encode_to_reference_ids_and_back() {
    let tok = tokenizer();
    let cases = orcd_tests::refs()["tokenizer"]
        .as_array()
        .expect("tokenizer refs")
        .clone();
    assert!(cases.len() >= 10);
    for case in &cases {
        let text = case["text"].as_str().expect("text");
        let got = tok.encode(text).unwrap();
        assert_eq!(got, ids(&case["ids"]), "encoding {text:?}");
        assert_eq!(tok.decode(&got).unwrap(), text, "decoding {text:?}");
    }
}

#[test]
fn metadata_ids_and_special_tokens() {
    let tok = tokenizer();
    // From the GGUF's metadata and token types (see the model card and `xtask inspect`).
    assert_eq!(tok.vocab_size(), 151936);
    assert_eq!(tok.bos_id(), Some(151643));
    assert_eq!(tok.eos_ids(), [151645, 151643]);
    assert_eq!(tok.token_text(151644), Some("<|im_start|>"));
    assert_eq!(tok.token_text(9707), Some("Hello"));
    assert_eq!(tok.token_text(151936), None);
    assert!(tok.is_special(151644) && tok.is_special(151643));
    assert!(!tok.is_special(9707) && !tok.is_special(151657)); // <tool_call> is user-defined
    // A user-defined token is matched whole too, and renders as its text.
    assert_eq!(tok.encode("<tool_call>").unwrap(), [151657]);
    assert_eq!(tok.decode(&[151644, 872]).unwrap(), "<|im_start|>user");
}

#[test]
fn chat_prompt_equals_reference() {
    let tok = tokenizer();
    let p = prompt("chat");
    let messages = [Message::new("user", p["text"].as_str().unwrap())];
    assert_eq!(tok.chat_prompt(&messages).unwrap(), ids(&p["ids"]));
}

#[test]
fn raw_prompt_equals_reference() {
    let tok = tokenizer();
    let p = prompt("raw");
    assert_eq!(
        tok.encode(p["text"].as_str().unwrap()).unwrap(),
        ids(&p["ids"])
    );
}

#[test]
fn streaming_generations_equals_decoding() {
    let tok = tokenizer();
    for p in orcd_tests::refs()["prompts"].as_array().unwrap() {
        let gen_ids = ids(&p["gen"]);
        let whole = tok.decode(&gen_ids).unwrap();
        assert_eq!(whole, p["gen_text"].as_str().unwrap());
        let mut stream = tok.stream();
        let mut streamed = String::new();
        for &id in &gen_ids {
            streamed.extend(stream.push(id).unwrap());
        }
        streamed.push_str(&stream.finish().unwrap());
        assert_eq!(streamed, whole);
    }
}

#[test]
fn emoji_split_over_tokens_never_streams_a_replacement_char() {
    let tok = tokenizer();
    let text = "emoji 🚀🔥👩\u{200d}💻 mix";
    let ids = tok.encode(text).unwrap();
    // The reference splits 🚀 over three byte tokens (11162, 248, 222).
    assert!(ids.windows(3).any(|w| w == [11162, 248, 222]), "{ids:?}");
    let mut stream = tok.stream();
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.extend(stream.push(id).unwrap());
    }
    pieces.push(stream.finish().unwrap());
    assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "{pieces:?}");
    assert_eq!(pieces.concat(), text);
}

#[test]
fn out_of_range_id_is_an_error() {
    let tok = tokenizer();
    let n = tok.vocab_size() as u32;
    assert!(matches!(
        tok.decode(&[9707, n]),
        Err(orcd::Error::Tokenizer(_))
    ));
    assert!(tok.decode(&[u32::MAX]).is_err());
    assert!(tok.stream().push(n).is_err());
}
