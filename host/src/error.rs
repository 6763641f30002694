//! The library's error type. Every variant renders as one line that says what went wrong
//! and, where there is one, which file.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A GGUF file that cannot be read or is malformed.
    #[error("{}: {msg}", path.display())]
    Gguf { path: PathBuf, msg: String },
    /// A model file that is valid GGUF but not a model this engine runs.
    #[error("{}: {msg}", path.display())]
    Model { path: PathBuf, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("no CUDA driver found (libcuda.so could not be loaded)")]
    NoCudaDriver,
    #[error("no CUDA device")]
    NoCudaDevice,
    #[error("CUDA: {0}")]
    Cuda(String),
    /// The model does not fit the GPU's free memory; says what was needed and what was free.
    #[error("{0}")]
    GpuMemory(String),
    #[error("fetch: {0}")]
    Fetch(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Cuda(e.to_string())
    }
}
