//! The library's front door: load a model for a device, then generate from a prompt or chat
//! messages as a stream of events.
//!
//! ```no_run
//! use orcd::engine::{Engine, Event, GenerateOptions, LoadOptions, Prompt};
//! # fn main() -> orcd::Result<()> {
//! let path = orcd::models::resolve(orcd::models::default_model())?;
//! let mut engine = Engine::load(&path, &LoadOptions::default())?;
//! let prompt = engine.prompt_ids(&Prompt::user("Write a haiku about the sea."))?;
//! for event in engine.generate(prompt, GenerateOptions::default())? {
//!     match event? {
//!         Event::Token { text, .. } => print!("{text}"),
//!         Event::Done(stats) => eprintln!("\n{:.1} tok/s", stats.decode_tok_per_s()),
//!     }
//! }
//! # Ok(())
//! # }
//! ```
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::chat::Message;
use crate::cpu::model::CpuModel;
use crate::cuda::Device;
use crate::cuda::decode_pipeline::DecodePipeline;
use crate::cuda::model::WeightFormat;
use crate::gguf::Gguf;
use crate::models::Progress;
use crate::sampling::{SamplingParams, sample};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::{Error, Result};

/// Where the model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceChoice {
    /// CUDA when a device is present, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// The context length when none is asked for (and the model's is larger).
pub const DEFAULT_CTX: usize = 8192;

#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    pub device: DeviceChoice,
    /// Context length (KV cache positions); default: the smaller of the model's and 8192.
    pub ctx: Option<usize>,
    /// How the GPU keeps the weight matrices (the CPU always dequantizes to f32).
    pub weights: WeightFormat,
}

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Text fed to the model as is (no chat template).
    Raw(String),
    /// A conversation, rendered with the model's chat template and the assistant's turn opened.
    Chat(Vec<Message>),
}

impl Prompt {
    /// A one-message conversation from the user.
    pub fn user(text: &str) -> Prompt {
        Prompt::Chat(vec![Message::new("user", text)])
    }
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Set it from another thread (e.g. a Ctrl-C handler) to stop before the next token.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Keep going past end-of-sequence tokens (benchmarks generate a fixed length).
    pub ignore_eos: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            sampling: SamplingParams::default(),
            max_tokens: 512,
            cancel: None,
            ignore_eos: false,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model emitted an end-of-sequence token (not part of the output).
    Eos,
    MaxTokens,
    /// The KV cache is full.
    Context,
    Cancelled,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxTokens => "max_tokens",
            StopReason::Context => "context",
            StopReason::Cancelled => "cancelled",
        }
    }
}

/// Figures of one generation.
#[derive(Clone, Debug)]
pub struct Stats {
    pub prompt_tokens: usize,
    /// The generated text (`decode` of `tokens`).
    pub text: String,
    /// Generated tokens, the end-of-sequence token not counted.
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    /// From the call to the first generated token (prefill included).
    pub ttft_s: f64,
    pub prefill_s: f64,
    /// Time spent on the tokens after the first.
    pub decode_s: f64,
    /// Forward steps after the prefill.
    pub decode_steps: usize,
}

impl Stats {
    pub fn prefill_tok_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s.max(1e-9)
    }

    pub fn decode_tok_per_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode_s.max(1e-9)
    }
}

/// One step of a generation.
#[derive(Clone, Debug)]
pub enum Event {
    /// A generated token and the text it completes (may be empty while a UTF-8 character is
    /// split over tokens).
    Token { id: u32, text: String },
    /// The last event: why it stopped and how fast it went.
    Done(Stats),
}

/// The forward pass on the device the model was loaded for.
#[allow(clippy::large_enum_variant)] // one per engine; boxing buys nothing
enum Model {
    Cpu(CpuModel),
    Cuda(DecodePipeline),
}

impl Model {
    fn reset(&mut self) {
        match self {
            Model::Cpu(m) => m.reset(),
            Model::Cuda(m) => m.reset(),
        }
    }

    fn max_ctx(&self) -> usize {
        match self {
            Model::Cpu(m) => m.max_ctx(),
            Model::Cuda(m) => m.model().max_ctx(),
        }
    }

    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        match self {
            Model::Cpu(m) => m.forward(tokens, all_logits),
            Model::Cuda(m) => m.forward(tokens, all_logits),
        }
    }

    /// Runs `tokens` (the end of `seq`, not yet in the cache) and picks the next token;
    /// `more`: at most this many will be asked for after it (fewer if one ends the text).
    fn next_token(
        &mut self,
        tokens: &[u32],
        seq: &[u32],
        p: &SamplingParams,
        step: u64,
        more: usize,
    ) -> Result<u32> {
        match self {
            Model::Cpu(m) => Ok(sample(&mut m.forward(tokens, false)?, seq, p, step)),
            Model::Cuda(m) => m.next_token(tokens, p, step, more),
        }
    }
}

/// The model of `g` on `opts.device`, with its device's name and vocabulary. With `Auto`, a
/// GPU that does not open leaves the model on the CPU and `notice` says why.
fn load_model(
    g: &Gguf,
    opts: &LoadOptions,
    ctx: usize,
    progress: &mut dyn FnMut(Progress),
    notice: &mut Option<String>,
) -> Result<(Model, String, usize)> {
    let gpu = match opts.device {
        DeviceChoice::Cpu => None,
        DeviceChoice::Cuda => Some(Device::open(0)?),
        DeviceChoice::Auto => Device::open(0)
            .map_err(|e| *notice = Some(format!("{e}: running on the CPU")))
            .ok(),
    };
    Ok(match gpu {
        Some(dev) => {
            let name = dev.name()?;
            let m = DecodePipeline::load(dev, g, ctx, opts.weights, progress)?;
            let vocab = m.model().cfg.vocab;
            (Model::Cuda(m), name, vocab)
        }
        None => {
            let m = CpuModel::load(g, ctx)?;
            let vocab = m.cfg.vocab;
            (Model::Cpu(m), "cpu".to_string(), vocab)
        }
    })
}

/// Opens the GGUF file at `path` and builds its tokenizer (~0.2 s for Qwen2's 151k tokens and
/// merges) while `load` opens the device and loads the weights; the tokenizer's error, if any,
/// is the one reported.
pub(crate) fn open_with_tokenizer<T>(
    path: &Path,
    load: impl FnOnce(&Gguf) -> Result<T>,
) -> Result<(Tokenizer, T)> {
    let g = Gguf::open(path)?;
    let (tokenizer, loaded) = std::thread::scope(|s| {
        let tokenizer = s.spawn(|| Tokenizer::from_gguf(&g));
        let loaded = load(&g);
        let tokenizer = tokenizer
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        (tokenizer, loaded)
    });
    Ok((tokenizer?, loaded?))
}

/// A loaded model: weights on its device, tokenizer and chat template.
pub struct Engine {
    tokenizer: Tokenizer,
    model: Model,
    vocab: usize,
    device: String,
    load_s: f64,
    notice: Option<String>,
}

impl Engine {
    /// Loads the model at `path` for `opts.device`. With `Auto` and no GPU it runs on the CPU
    /// and `notice` says why.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Engine> {
        Engine::load_with(path, opts, &mut |_| {})
    }

    /// `load`, telling `progress` how the upload of the weights to the GPU goes.
    pub fn load_with(
        path: &Path,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Engine> {
        let t0 = Instant::now();
        let ctx = opts.ctx.unwrap_or(DEFAULT_CTX);
        let mut notice = None;
        let (tokenizer, (model, device, vocab)) =
            open_with_tokenizer(path, |g| load_model(g, opts, ctx, progress, &mut notice))?;
        let load_s = t0.elapsed().as_secs_f64();
        Ok(Engine {
            tokenizer,
            model,
            vocab,
            device,
            load_s,
            notice,
        })
    }

    /// Bytes of weights one greedy decoded token reads (every matrix, norm and bias once, and
    /// one row of the embedding table), in the form the device keeps them.
    pub fn weight_bytes_per_token(&self) -> u64 {
        match &self.model {
            Model::Cpu(m) => m.weight_bytes_per_token(),
            Model::Cuda(m) => m.model().weight_bytes_per_token(),
        }
    }

    /// GPU memory this engine has allocated (weights, KV cache, buffers); `None` on the CPU.
    pub fn gpu_memory_used(&self) -> Option<u64> {
        match &self.model {
            Model::Cpu(_) => None,
            Model::Cuda(m) => m.model().gpu_memory_used().ok(),
        }
    }

    /// Why `Auto` chose the CPU, if it did.
    pub fn notice(&self) -> Option<&str> {
        self.notice.as_deref()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// "cpu" or the GPU's name.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Seconds `load` took.
    pub fn load_s(&self) -> f64 {
        self.load_s
    }

    /// The context length: prompt and generated tokens together fit in it.
    pub fn ctx_len(&self) -> usize {
        self.model.max_ctx()
    }

    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Raw(text) => self.tokenizer.encode(text),
            Prompt::Chat(messages) => self.tokenizer.chat_prompt(messages),
        }
    }

    /// Logits after every token of `ids`, run as one prompt: `[ids.len()][vocab]`.
    pub fn logits(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.check_fits(ids.len())?;
        self.model.reset();
        let logits = self.model.forward(ids, true)?;
        Ok(logits
            .chunks_exact(self.vocab)
            .map(<[f32]>::to_vec)
            .collect())
    }

    /// Starts generating after `prompt` (token ids); the returned iterator runs one forward
    /// step per `next`. Errors before any work if the prompt does not fit the context.
    pub fn generate(&mut self, prompt: Vec<u32>, opts: GenerateOptions) -> Result<Generation<'_>> {
        opts.sampling.validate()?;
        self.check_fits(prompt.len())?;
        if prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty".into()));
        }
        self.model.reset();
        Ok(Generation {
            model: &mut self.model,
            tokenizer: &self.tokenizer,
            decoder: self.tokenizer.stream(),
            eos: self.tokenizer.eos_ids().to_vec(),
            prompt_tokens: prompt.len(),
            seq: prompt,
            opts,
            started: Instant::now(),
            prefill_s: 0.0,
            ttft_s: 0.0,
            decode_s: 0.0,
            decode_steps: 0,
            done: false,
        })
    }

    fn check_fits(&self, n: usize) -> Result<()> {
        if n > self.ctx_len() {
            return Err(Error::Invalid(format!(
                "the prompt has {n} tokens but the context holds {}",
                self.ctx_len()
            )));
        }
        Ok(())
    }
}

/// A generation in progress; iterate it for events. Ends with `Event::Done`.
pub struct Generation<'a> {
    model: &'a mut Model,
    tokenizer: &'a Tokenizer,
    decoder: StreamDecoder<'a>,
    eos: Vec<u32>,
    prompt_tokens: usize,
    /// Prompt and generated tokens so far; all but the last generated one are in the cache.
    seq: Vec<u32>,
    opts: GenerateOptions,
    started: Instant,
    prefill_s: f64,
    ttft_s: f64,
    decode_s: f64,
    decode_steps: usize,
    done: bool,
}

impl Generation<'_> {
    fn generated(&self) -> &[u32] {
        &self.seq[self.prompt_tokens..]
    }

    fn finish(&mut self, stop: StopReason) -> Result<Event> {
        self.done = true;
        Ok(Event::Done(Stats {
            prompt_tokens: self.prompt_tokens,
            text: self.tokenizer.decode(self.generated())?,
            tokens: self.generated().to_vec(),
            stop,
            ttft_s: self.ttft_s,
            prefill_s: self.prefill_s,
            decode_s: self.decode_s,
            decode_steps: self.decode_steps,
        }))
    }

    fn step(&mut self) -> Result<Event> {
        let cancelled = self
            .opts
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed));
        if cancelled {
            return self.finish(StopReason::Cancelled);
        }
        let n_gen = self.generated().len();
        if n_gen >= self.opts.max_tokens {
            return self.finish(StopReason::MaxTokens);
        }
        // The first step runs the whole prompt; later ones the token generated last, which
        // needs a free cache position.
        let first = n_gen == 0;
        if !first && self.seq.len() > self.model.max_ctx() {
            return self.finish(StopReason::Context);
        }
        let feed = if first {
            &self.seq[..]
        } else {
            &self.seq[self.seq.len() - 1..]
        };
        let more = self.opts.max_tokens - n_gen - 1;
        let t = Instant::now();
        let id = self
            .model
            .next_token(feed, &self.seq, &self.opts.sampling, n_gen as u64, more)?;
        let took = t.elapsed().as_secs_f64();
        if first {
            self.prefill_s = took;
            self.ttft_s = self.started.elapsed().as_secs_f64();
        } else {
            self.decode_s += took;
            self.decode_steps += 1;
        }
        if !self.opts.ignore_eos && self.eos.contains(&id) {
            return self.finish(StopReason::Eos);
        }
        self.seq.push(id);
        let text = self.decoder.push(id)?.unwrap_or_default();
        Ok(Event::Token { id, text })
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<Event>;

    fn next(&mut self) -> Option<Result<Event>> {
        if self.done {
            return None;
        }
        let event = self.step();
        if event.is_err() {
            self.done = true;
        }
        Some(event)
    }
}
