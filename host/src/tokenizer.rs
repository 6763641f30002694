//! The tokenizer stored in a GGUF file: byte-level BPE (`tokenizer.ggml.model` = "gpt2") with
//! Qwen2's pre-tokenizer, built on the `tokenizers` crate to match Hugging Face's encoding.
//!
//! Encoding goes through `tokenizers`, set up as Qwen2's `tokenizer.json` is: NFC normalizer,
//! the qwen2 split regex (isolated), byte-level mapping without its own regex, BPE without byte
//! fallback, and control/user-defined tokens matched as whole tokens before all of that.
//! Decoding is done here: every token's bytes are precomputed once (the GPT-2 byte<->unicode
//! table undone), so `decode` and the streaming decoder share one exact byte stream.
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::chat::{Message, apply_chat_template};
use crate::gguf::{Gguf, Value};
use crate::{Error, Result};

/// Qwen2's pre-tokenizer split regex (`tokenizer.ggml.pre` = "qwen2"), as in its `tokenizer.json`.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The vocabulary as stored in the GGUF (byte-level encoded for ordinary tokens).
    tokens: Vec<String>,
    /// Control tokens (`<|im_start|>`, `<|endoftext|>`, …).
    special: Vec<bool>,
    /// Token `i` decodes to the bytes `bytes[starts[i]..starts[i + 1]]`.
    bytes: Vec<u8>,
    starts: Vec<usize>,
    bos: Option<u32>,
    eos: Vec<u32>,
    pad: Option<u32>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        let bad = |msg: String| Error::Model {
            path: g.path().to_path_buf(),
            msg,
        };
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(bad(format!(
                "tokenizer model '{model}' is not supported (only byte-level BPE, 'gpt2')"
            )));
        }
        // DeepSeek-R1's Qwen distills name Qwen2's regex differently.
        let pre = g.get_str("tokenizer.ggml.pre")?;
        if !matches!(pre, "qwen2" | "deepseek-r1-qwen") {
            return Err(bad(format!(
                "pre-tokenizer '{pre}' is not supported (only 'qwen2')"
            )));
        }
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        // Every id the model can emit (a row of its embedding and output) needs a text.
        if let Ok(embd) = g.tensor("token_embd.weight")
            && let Some(&rows) = embd.shape.last()
            && rows > n as u64
        {
            return Err(bad(format!(
                "the tokenizer has {n} tokens, fewer than the model's vocabulary of {rows} (token_embd.weight)"
            )));
        }
        let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
            None => vec![1; n],
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>())
                .filter(|t| t.len() == n)
                .ok_or_else(|| {
                    bad(format!(
                        "tokenizer.ggml.token_type is not {n} non-negative integers"
                    ))
                })?,
        };
        let merges = g
            .get_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| bad(format!("tokenizer merge '{m}' is not two tokens")))
            })
            .collect::<Result<Vec<_>>>()?;
        let id = |key: &str| -> Result<Option<u32>> {
            match g.get(key) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(id) if (id as usize) < n => Ok(Some(id as u32)),
                    _ => Err(bad(format!("{key} is not a token id below {n}"))),
                },
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let pad = id("tokenizer.ggml.padding_token_id")?;
        let add_bos = matches!(
            g.get("tokenizer.ggml.add_bos_token"),
            Some(Value::Bool(true))
        );
        let chat_template = g
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
            .map(String::from);

        let is_added = |t: u64| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED;
        let special: Vec<bool> = types.iter().map(|&t| t == TOKEN_TYPE_CONTROL).collect();
        let mut bytes = Vec::with_capacity(n * 8);
        let mut starts = Vec::with_capacity(n + 1);
        for (tok, &ty) in tokens.iter().zip(&types) {
            starts.push(bytes.len());
            if is_added(ty) {
                bytes.extend_from_slice(tok.as_bytes());
            } else {
                byte_level_decode(tok, &mut bytes);
            }
        }
        starts.push(bytes.len());

        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .byte_fallback(false)
            .build()
            .map_err(|e| bad(format!("building the tokenizer: {e}")))?;
        let split = Split::new(
            SplitPattern::Regex(QWEN2_SPLIT.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| bad(format!("the tokenizer's split regex: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner
            .with_normalizer(Some(NFC))
            .with_pre_tokenizer(Some(Sequence::new(vec![
                split.into(),
                ByteLevel::new(false, false, false).into(),
            ])));
        // Hugging Face's added tokens: control tokens are special, user-defined ones
        // (`<tool_call>`) are not; neither is normalized, so both match the raw text.
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|&(t, &ty)| is_added(ty) && !t.is_empty())
            .map(|(&t, &ty)| AddedToken::from(t, ty == TOKEN_TYPE_CONTROL).normalized(false))
            .collect();
        inner.add_tokens(&added);

        // Chat models end a turn with <|im_end|>; <|endoftext|> ends a document.
        let mut eos: Vec<u32> = id("tokenizer.ggml.eos_token_id")?.into_iter().collect();
        for text in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(i) = inner.token_to_id(text).filter(|i| !eos.contains(i)) {
                eos.push(i);
            }
        }

        Ok(Tokenizer {
            inner,
            tokens: tokens.into_iter().map(String::from).collect(),
            special,
            bytes,
            starts,
            bos,
            eos,
            pad,
            add_bos,
            chat_template,
        })
    }

    /// The ids of `text`; control tokens written in it are matched as whole tokens. A BOS is
    /// prepended when the GGUF says so (`tokenizer.ggml.add_bos_token`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend(self.encode_text(text)?);
        Ok(ids)
    }

    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| Error::Tokenizer(format!("encoding: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included as their text. Bytes that are not valid
    /// UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The bytes a token stands for (part of a UTF-8 character, for some): what OpenAI's
    /// logprob entries report as `bytes`.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        let i = id as usize;
        if i >= self.tokens.len() {
            return Err(Error::Tokenizer(format!(
                "token id {id} is out of range (vocabulary size {})",
                self.tokens.len()
            )));
        }
        Ok(&self.bytes[self.starts[i]..self.starts[i + 1]])
    }

    /// A decoder for generated tokens that emits text only at UTF-8 character boundaries.
    pub fn stream(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tok: self,
            pending: Vec::new(),
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The token as stored in the GGUF (ordinary tokens in GPT-2's byte-level alphabet, `Ġ` for
    /// a space); `decode(&[id])` gives its text.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The tokens that end generation: the GGUF's EOS plus `<|im_end|>` and `<|endoftext|>`.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether `id` is a control token (`<|im_start|>`, `<|endoftext|>`, …).
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The ids of the GGUF's chat template rendered for `messages`, ready for the assistant's
    /// reply (`add_generation_prompt`). No BOS is added: templates that want one write it.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::Template("the model has no tokenizer.chat_template".into()))?;
        let text_of = |id: Option<u32>| id.and_then(|i| self.token_text(i)).unwrap_or("");
        let text = apply_chat_template(
            template,
            messages,
            true,
            text_of(self.bos),
            text_of(self.eos.first().copied()),
        )?;
        self.encode_text(&text)
    }
}

/// Decodes generated tokens one at a time. `push` returns the text completed so far, holding
/// back an incomplete UTF-8 sequence until the token that completes it arrives, so that a
/// character split over tokens never shows as U+FFFD. The concatenation of all `push` outputs
/// and `finish` equals `decode` of all the ids.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.pending.extend_from_slice(self.tok.token_bytes(id)?);
        let text = take_complete_utf8(&mut self.pending);
        Ok((!text.is_empty()).then_some(text))
    }

    /// The held-back bytes; an incomplete sequence at the very end becomes U+FFFD.
    pub fn finish(self) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.pending).into_owned())
    }
}

/// Removes from `pending` and returns as text everything that later bytes cannot change:
/// all of it but an incomplete UTF-8 sequence at its end. Invalid bytes become U+FFFD exactly
/// as `String::from_utf8_lossy` replaces them (one per `Utf8Chunks` invalid part).
fn take_complete_utf8(pending: &mut Vec<u8>) -> String {
    let mut text = String::new();
    let mut taken = 0;
    for chunk in pending.utf8_chunks() {
        text.push_str(chunk.valid());
        taken += chunk.valid().len();
        let bad = chunk.invalid();
        if bad.is_empty() {
            continue;
        }
        // A truncated sequence at the end (error_len None) may still be completed.
        let at_end = taken + bad.len() == pending.len();
        if at_end && std::str::from_utf8(bad).is_err_and(|e| e.error_len().is_none()) {
            break;
        }
        text.push(char::REPLACEMENT_CHARACTER);
        taken += bad.len();
    }
    pending.drain(..taken);
    text
}

/// Undoes GPT-2's byte-to-unicode mapping, appending the bytes of `token` to `out`. A character
/// outside the alphabet (no such token in a well-formed vocabulary) is kept as its UTF-8.
fn byte_level_decode(token: &str, out: &mut Vec<u8>) {
    for c in token.chars() {
        let cp = c as usize;
        if cp < BYTE_OF_CHAR.len() && (cp >= 256 || is_printable_byte(cp as u8)) {
            out.push(BYTE_OF_CHAR[cp]);
        } else {
            out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
        }
    }
}

/// GPT-2's byte-level alphabet: printable bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for
/// themselves; the other 68 bytes were shifted, in order, to U+0100..=U+0143.
/// `BYTE_OF_CHAR[c]` is the byte that alphabet character `c` stands for.
const BYTE_OF_CHAR: [u8; 256 + 68] = {
    let mut table = [0; 256 + 68];
    let mut shifted = 256;
    let mut b = 0;
    while b < 256 {
        if is_printable_byte(b as u8) {
            table[b] = b as u8;
        } else {
            table[shifted] = b as u8;
            shifted += 1;
        }
        b += 1;
    }
    table
};

const fn is_printable_byte(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `bytes` to the hold-back in pieces of `step` bytes, then flushes as `finish` does.
    fn stream_bytes(bytes: &[u8], step: usize) -> Vec<String> {
        let mut pending = Vec::new();
        let mut out = Vec::new();
        for piece in bytes.chunks(step) {
            pending.extend_from_slice(piece);
            out.push(take_complete_utf8(&mut pending));
        }
        out.push(String::from_utf8_lossy(&pending).into_owned());
        out
    }

    #[test]
    fn four_byte_char_is_held_until_complete() {
        // U+1F680 ROCKET is F0 9F 9A 80.
        assert_eq!(
            stream_bytes(&[0xf0, 0x9f, 0x9a, 0x80], 1),
            ["", "", "", "🚀", ""]
        );
    }

    #[test]
    fn text_before_a_split_char_is_emitted_at_once() {
        // "aé" with é = C3 A9 split after its first byte.
        let mut pending = vec![b'a', 0xc3];
        assert_eq!(take_complete_utf8(&mut pending), "a");
        assert_eq!(pending, [0xc3]);
        pending.push(0xa9);
        assert_eq!(take_complete_utf8(&mut pending), "é");
        assert!(pending.is_empty());
    }

    #[test]
    fn invalid_bytes_are_replaced_not_held() {
        // A lone continuation byte, a byte never valid in UTF-8, and a truncated 3-byte
        // sequence (E2 82) cut off by 'A': each one U+FFFD, nothing held back.
        for (bytes, want) in [
            (&[0x80, b'A'][..], "\u{fffd}A"),
            (&[b'x', 0xff][..], "x\u{fffd}"),
            (&[0xe2, 0x82, b'A'][..], "\u{fffd}A"),
        ] {
            let mut pending = bytes.to_vec();
            assert_eq!(take_complete_utf8(&mut pending), want, "{bytes:x?}");
            assert!(pending.is_empty(), "{bytes:x?}");
        }
    }

    #[test]
    fn incomplete_tail_becomes_one_replacement_at_finish() {
        // F0 9F is the start of a 4-byte sequence that never completes.
        assert_eq!(
            stream_bytes(&[b'o', b'k', 0xf0, 0x9f], 1),
            ["o", "k", "", "", "\u{fffd}"]
        );
    }

    #[test]
    fn streamed_pieces_concatenate_to_lossy_decoding() {
        let bytes = b"x\xf0\x9f\x9a\x80\xff\xc3\xa9\xe2\x82Az\xe6\x97\xa5\xf0\x9f";
        let whole = String::from_utf8_lossy(bytes);
        for step in 1..=bytes.len() {
            assert_eq!(stream_bytes(bytes, step).concat(), whole, "step {step}");
        }
    }

    #[test]
    fn byte_level_table_matches_gpt2() {
        // From GPT-2's definition: ' ' (0x20) is the 33rd non-printable byte -> U+0120 'Ġ',
        // '\n' (0x0a) the 11th -> U+010A 'Ċ', 0x00 -> U+0100, 0xAD (soft hyphen) the last -> U+0143.
        let mut out = Vec::new();
        byte_level_decode("ĠĊĀŃa¡", &mut out);
        assert_eq!(out, [0x20, 0x0a, 0x00, 0xad, b'a', 0xa1]);
    }
}
