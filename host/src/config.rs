//! The model's hyperparameters, read from GGUF metadata, and the check that its tensors are
//! the ones the Qwen2 forward pass needs.
use crate::gguf::Gguf;
use crate::quant::GgmlType;
use crate::{Error, Result};

/// The one architecture this engine runs.
pub const ARCH: &str = "qwen2";

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub ctx_len: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    /// No `output.weight`: the output projection reuses `token_embd.weight`.
    pub tied_output: bool,
}

impl Config {
    pub fn from_gguf(g: &Gguf) -> Result<Config> {
        let model_error = |msg: String| Error::Model {
            path: g.path().to_path_buf(),
            msg,
        };
        let arch = g.get_str("general.architecture")?;
        if arch != ARCH {
            return Err(model_error(format!(
                "unsupported architecture '{arch}' (orcd runs {ARCH})"
            )));
        }
        if g.tensors().is_empty() {
            return Err(model_error("no tensors: not a model file".into()));
        }
        let count = |key: &str| -> Result<usize> {
            let key = format!("{ARCH}.{key}");
            match g.get_u64(&key)? {
                0 => Err(model_error(format!("metadata key '{key}' is 0"))),
                // Anything that does not fit a usize could never be allocated anyway.
                n => usize::try_from(n)
                    .map_err(|_| model_error(format!("metadata key '{key}' is too large: {n}"))),
            }
        };
        let positive = |key: &str| -> Result<f32> {
            let key = format!("{ARCH}.{key}");
            match g.get_f32(&key)? {
                v if v > 0.0 && v.is_finite() => Ok(v),
                v => Err(model_error(format!(
                    "metadata key '{key}' is {v}, expected a positive number"
                ))),
            }
        };
        let n_layers = count("block_count")?;
        // Every layer has 12 tensors: a count beyond the file's would only exhaust memory later.
        if n_layers > g.tensors().len() / 12 {
            return Err(model_error(format!(
                "metadata key '{ARCH}.block_count' is {n_layers} but the file has only {} tensors (12 per layer)",
                g.tensors().len()
            )));
        }
        let hidden = count("embedding_length")?;
        let n_heads = count("attention.head_count")?;
        let n_kv_heads = count("attention.head_count_kv")?;
        let ffn = count("feed_forward_length")?;
        let ctx_len = count("context_length")?;
        let rope_theta = positive("rope.freq_base")?;
        let rms_eps = positive("attention.layer_norm_rms_epsilon")?;
        if !hidden.is_multiple_of(n_heads) || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(model_error(format!(
                "{hidden} hidden units, {n_heads} heads and {n_kv_heads} kv heads do not divide evenly"
            )));
        }
        let head_dim = hidden / n_heads;
        if !head_dim.is_multiple_of(2) {
            return Err(model_error(format!(
                "head dim {head_dim} is odd: rotary embedding needs pairs"
            )));
        }
        let embd = g.tensor("token_embd.weight")?;
        let vocab = match embd.shape[..] {
            [h, v] if h == hidden as u64 => v as usize,
            _ => {
                return Err(model_error(format!(
                    "tensor 'token_embd.weight' has shape {:?}, expected [{hidden}, vocab]",
                    embd.shape
                )));
            }
        };
        let tied_output = g.tensor("output.weight").is_err();
        Ok(Config {
            n_layers,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            vocab,
            ctx_len,
            rope_theta,
            rms_eps,
            tied_output,
        })
    }

    /// Width of the K and V projections.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Checks that every tensor the forward pass reads exists with the expected shape (ggml
    /// order, row length first), and that norms and biases are F32.
    pub fn check_tensors(&self, g: &Gguf) -> Result<()> {
        let (h, kv, ffn, vocab) = (self.hidden, self.kv_dim(), self.ffn, self.vocab);
        let mut expected: Vec<(String, Vec<usize>, bool)> = Vec::new();
        let mut want = |name: String, shape: &[usize], f32_only: bool| {
            expected.push((name, shape.to_vec(), f32_only))
        };
        want("token_embd.weight".into(), &[h, vocab], false);
        want("output_norm.weight".into(), &[h], true);
        if !self.tied_output {
            want("output.weight".into(), &[h, vocab], false);
        }
        for l in 0..self.n_layers {
            let b = |s: &str| format!("blk.{l}.{s}");
            want(b("attn_norm.weight"), &[h], true);
            want(b("attn_q.weight"), &[h, h], false);
            want(b("attn_q.bias"), &[h], true);
            want(b("attn_k.weight"), &[h, kv], false);
            want(b("attn_k.bias"), &[kv], true);
            want(b("attn_v.weight"), &[h, kv], false);
            want(b("attn_v.bias"), &[kv], true);
            want(b("attn_output.weight"), &[h, h], false);
            want(b("ffn_norm.weight"), &[h], true);
            want(b("ffn_gate.weight"), &[h, ffn], false);
            want(b("ffn_up.weight"), &[h, ffn], false);
            want(b("ffn_down.weight"), &[ffn, h], false);
        }
        let model_error = |msg: String| Error::Model {
            path: g.path().to_path_buf(),
            msg,
        };
        for (name, shape, f32_only) in expected {
            let t = g
                .tensor(&name)
                .map_err(|_| model_error(format!("missing tensor '{name}' required by {ARCH}")))?;
            if !t
                .shape
                .iter()
                .map(|&d| d as usize)
                .eq(shape.iter().copied())
            {
                return Err(model_error(format!(
                    "tensor '{name}' has shape {:?}, expected {shape:?}",
                    t.shape
                )));
            }
            if f32_only && t.ty != GgmlType::F32 {
                return Err(model_error(format!(
                    "tensor '{name}' has type {}, expected f32",
                    t.ty.name()
                )));
            }
        }
        Ok(())
    }
}
