//! Options and helpers shared by the subcommands.
use std::io::Write;

use anyhow::Result;
use orcd::cuda::model::WeightFormat;
use orcd::engine::{DeviceChoice, Engine, LoadOptions};

/// `--model`, `--device`, `--ctx` and `--weights`: which model to load and where.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// A models.lock name (fetched on first use) or a path to a GGUF file.
    #[arg(long, default_value = orcd::models::default_model())]
    pub model: String,
    /// Where to run: auto (CUDA when a GPU is present, else CPU), cpu or cuda.
    #[arg(long, default_value = "auto", value_parser = ["auto", "cpu", "cuda"])]
    pub device: String,
    /// Context length in tokens (default: the model's, at most 8192).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub ctx: Option<u64>,
    /// How the GPU keeps the weights: native (the file's quantized blocks) or f16.
    #[arg(long, default_value = "native", value_parser = ["native", "f16"])]
    pub weights: String,
}

impl ModelArgs {
    pub fn path(&self) -> Result<std::path::PathBuf> {
        Ok(orcd::models::resolve_with(
            &self.model,
            &mut crate::fetch_model::progress(),
        )?)
    }

    /// What `Engine::load` and `BatchEngine::start` take from these options.
    pub fn load_options(&self) -> LoadOptions {
        let device = match self.device.as_str() {
            "cpu" => DeviceChoice::Cpu,
            "cuda" => DeviceChoice::Cuda,
            _ => DeviceChoice::Auto,
        };
        let weights = match self.weights.as_str() {
            "f16" => WeightFormat::F16,
            _ => WeightFormat::Native,
        };
        LoadOptions {
            device,
            ctx: self.ctx.map(|c| c as usize),
            weights,
        }
    }

    pub fn load(&self) -> Result<Engine> {
        let opts = self.load_options();
        let engine = Engine::load_with(&self.path()?, &opts, &mut crate::fetch_model::progress())
            .map_err(device_error)?;
        if let Some(notice) = engine.notice() {
            crate::note(notice);
        }
        Ok(engine)
    }
}

/// A load error, said in terms of the command line where `--device cuda` found no GPU.
pub fn device_error(e: orcd::Error) -> anyhow::Error {
    match e {
        orcd::Error::NoCudaDriver | orcd::Error::NoCudaDevice => {
            anyhow::anyhow!("--device cuda: {e}; use --device cpu or auto")
        }
        e => e.into(),
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
