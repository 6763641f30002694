//! orcd: a pure-Rust inference engine for Qwen2-family GGUF models on NVIDIA GPUs.

pub mod batch;
pub mod chat;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod models;
pub mod pack;
pub mod quant;
pub mod sampling;
pub mod tokenizer;

pub use error::{Error, Result};

/// The PTX of every kernel in `gpu-kernels/`, built by `build.rs` for sm_80 (A100 and later).
pub fn ptx() -> String {
    inflate(include_bytes!(env!("ORCD_PTX")))
}

/// The same kernels built for sm_90 (H100 and later): with programmatic dependent launch.
pub fn ptx_sm90() -> String {
    inflate(include_bytes!(env!("ORCD_PTX_SM90")))
}

/// The text that `build.rs` deflated.
fn inflate(z: &[u8]) -> String {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut flate2::read::DeflateDecoder::new(z), &mut text)
        .expect("the embedded PTX inflates");
    text
}
