//! Shared helpers of orcd's end-to-end and GPU tests.
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use orcd::cpu::model::CpuModel;
use orcd::gguf::Gguf;

pub mod gguf_writer;
pub mod synthetic;

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

/// The folder of reference outputs: `$ORCD_REFS`, else the repository's `tests/refs/`.
pub fn refs_dir() -> PathBuf {
    std::env::var_os("ORCD_REFS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("refs"))
}

/// The reference outputs of Hugging Face transformers for the model under test
/// (`model_path()`): the file of `refs_dir()` whose `model.bytes` is that file's size, so one
/// folder serves several models. Loaded once per test process.
pub fn refs() -> &'static serde_json::Value {
    static R: OnceLock<serde_json::Value> = OnceLock::new();
    R.get_or_init(|| {
        let model = model_path();
        let bytes = std::fs::metadata(&model)
            .unwrap_or_else(|e| panic!("{}: {e}", model.display()))
            .len();
        refs_for(&refs_dir(), bytes).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// The references in `dir` for a model file of `bytes` bytes.
pub fn refs_for(dir: &std::path::Path, bytes: u64) -> Result<serde_json::Value, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    let mut names = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let refs: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
        if refs["model"]["bytes"].as_u64() == Some(bytes) {
            return Ok(refs);
        }
        names.push(path.display().to_string());
    }
    Err(format!(
        "no reference file in {} is for a model of {bytes} bytes (read: {names:?}); set ORCD_REFS to a folder that has one",
        dir.display()
    ))
}

/// A small deterministic generator for test inputs (xorshift64*), uniform in [-1, 1).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n.next_multiple_of(8));
        while out.len() < n {
            out.extend(self.next_u64().to_le_bytes());
        }
        out.truncate(n);
        out
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

/// The default model's path: `$ORCD_MODEL`, else models.lock's default, fetched and cached on
/// first use.
pub fn model_path() -> PathBuf {
    match std::env::var_os("ORCD_MODEL") {
        Some(p) => PathBuf::from(p),
        None => orcd::models::resolve(orcd::models::default_model())
            .unwrap_or_else(|e| panic!("fetching the default model: {e}")),
    }
}

/// One reference prompt: its ids, the reference greedy generation, and the teacher-forced
/// top-5 (ids, logits) at each generated position.
pub struct RefPrompt {
    pub kind: String,
    pub text: String,
    pub ids: Vec<u32>,
    pub generated: Vec<u32>,
    pub top5_ids: Vec<Vec<u32>>,
    pub top5_vals: Vec<Vec<f32>>,
}

impl RefPrompt {
    /// Prompt and reference generation: what teacher forcing feeds.
    pub fn sequence(&self) -> Vec<u32> {
        self.ids.iter().chain(&self.generated).copied().collect()
    }

    /// The row of `logits` (every position of `sequence()`) that predicts generated token `i`.
    pub fn row<'a>(&self, logits: &'a [f32], vocab: usize, i: usize) -> &'a [f32] {
        &logits[(self.ids.len() - 1 + i) * vocab..][..vocab]
    }

    /// The reference's top-1 minus top-2 logit at generated position `i`.
    pub fn margin(&self, i: usize) -> f32 {
        self.top5_vals[i][0] - self.top5_vals[i][1]
    }
}

pub fn ref_prompts() -> Vec<RefPrompt> {
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let vals = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    refs()["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| RefPrompt {
            kind: p["kind"].as_str().unwrap().into(),
            text: p["text"].as_str().unwrap().into(),
            ids: ids(&p["ids"]),
            generated: ids(&p["gen"]),
            top5_ids: p["top5_ids"].as_array().unwrap().iter().map(ids).collect(),
            top5_vals: p["top5_vals"]
                .as_array()
                .unwrap()
                .iter()
                .map(vals)
                .collect(),
        })
        .collect()
}

/// The default model's file, opened once per test process.
pub fn gguf() -> &'static Gguf {
    static G: OnceLock<Gguf> = OnceLock::new();
    G.get_or_init(|| Gguf::open(&model_path()).expect("opening the default model"))
}

/// The CPU reference model (weights dequantized to f32, ~2.5 GB), loaded once per test
/// process; tests take turns with it.
pub fn cpu_model() -> MutexGuard<'static, CpuModel> {
    static M: OnceLock<Mutex<CpuModel>> = OnceLock::new();
    let m =
        M.get_or_init(|| Mutex::new(CpuModel::load(gguf(), 4096).expect("loading the CPU model")));
    // A failed test poisons the lock; the model itself is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
