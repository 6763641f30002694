//! Shared helpers of orcd's end-to-end and GPU tests.
use std::path::PathBuf;

/// The GPU for a GPU test, or `None` after printing `skipped: no CUDA device`.
/// With `REQUIRE_GPU=1` a missing GPU fails the test instead.
pub fn gpu() -> Option<orcd::cuda::Device> {
    match orcd::cuda::Device::open(0) {
        Ok(dev) => Some(dev),
        Err(e @ (orcd::Error::NoCudaDriver | orcd::Error::NoCudaDevice)) => {
            if std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("REQUIRE_GPU=1 but {e}");
            }
            println!("skipped: no CUDA device");
            None
        }
        Err(e) => panic!("opening the GPU failed: {e}"),
    }
}

/// The reference outputs of Hugging Face transformers: `$ORCD_REFS`, else `../shared/refs/`.
pub fn refs() -> serde_json::Value {
    let path = std::env::var_os("ORCD_REFS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../shared/refs/qwen2.5-coder-0.5b-q4km.hf.json")
        });
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).expect("refs are JSON")
}

/// A small deterministic generator for test inputs (xorshift64*), uniform in [-1, 1).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        bits as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}
