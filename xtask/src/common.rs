//! Options and helpers shared by the subcommands.
use std::io::Write;

use anyhow::Result;
use orcd::cuda::model::WeightFormat;
use orcd::engine::{DeviceChoice, Engine, LoadOptions};

/// `--model`, `--device` and `--ctx`: which model to load and where.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// A models.lock name or a path to a GGUF file (default: models.lock's default, fetched on
    /// first use).
    #[arg(long)]
    pub model: Option<String>,
    /// Where to run: auto (CUDA when a GPU is present, else CPU), cpu or cuda.
    #[arg(long, default_value = "auto", value_parser = ["auto", "cpu", "cuda"])]
    pub device: String,
    /// Context length in tokens (default: the model's, at most 8192).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// How the GPU keeps the weights: native (the file's quantized blocks) or f16.
    #[arg(long, default_value = "native", value_parser = ["native", "f16"])]
    pub weights: String,
}

impl ModelArgs {
    pub fn path(&self) -> Result<std::path::PathBuf> {
        let name = self
            .model
            .as_deref()
            .unwrap_or(orcd::models::default_model());
        Ok(orcd::models::resolve(name)?)
    }

    pub fn load(&self) -> Result<Engine> {
        let device = match self.device.as_str() {
            "cpu" => DeviceChoice::Cpu,
            "cuda" => DeviceChoice::Cuda,
            _ => DeviceChoice::Auto,
        };
        let weights = match self.weights.as_str() {
            "f16" => WeightFormat::F16,
            _ => WeightFormat::Native,
        };
        let opts = LoadOptions {
            device,
            ctx: self.ctx,
            weights,
        };
        let engine = Engine::load(&self.path()?, &opts)?;
        if let Some(notice) = engine.notice() {
            eprintln!("note: {notice}");
        }
        Ok(engine)
    }
}

/// Writes to stdout; a closed pipe (`| head -1`) ends the program quietly.
pub fn write_or_exit(out: &mut impl Write, bytes: &[u8]) {
    if let Err(e) = out.write_all(bytes).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {e}");
        std::process::exit(1);
    }
}
