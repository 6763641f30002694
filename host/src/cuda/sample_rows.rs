//! Launch helper of the batched sampler (gpu-kernels/src/sample_rows.rs): each row of a
//! logits matrix sampled with its own parameters, penalties and draw.
use cudarc::driver::{CudaSlice, DevicePtrMut, LaunchConfig};
use kernel_abi::sampling::{
    GREEDY_SLICE, ROW_PARAM_WORDS as PARAM_WORDS, SAMPLE_ROWS_SHARED_WORDS, SAMPLE_ROWS_THREADS,
};

use super::kernels::{DevPtr, DevPtrMut, SampleRows};
use super::{Device, Overlap, allow_shared, check, u32_of};
use crate::Result;

/// How one row is sampled: `sampling::SamplingParams`' temperature, top-k (0 = off), top-p
/// and min-p, the draw `uniform(seed, draw)`, and the penalties as `(id, scale, sub)` of
/// distinct ids: the logit is divided by `scale` if >= 0 (else multiplied), then `sub`
/// subtracted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowSampling {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    pub draw: u64,
    pub penalties: Vec<(u32, f32, f32)>,
}

/// Blocks of `sample_rows` that the greedy rows of a launch fill, about two per SM: rows split
/// their arg-max until there are this many (or every block has `GREEDY_SLICE` logits).
const GREEDY_BLOCKS: usize = 256;

/// The device buffers `sample_rows` reads its rows' parameters and penalties from (and where
/// a greedy row's blocks meet); they grow when a batch needs more, and `generation` counts
/// the times they moved (a CUDA graph that captured a launch reads the old addresses).
#[derive(Default)]
pub struct RowSamplerInputs {
    params: Option<CudaSlice<u32>>,
    ids: Option<CudaSlice<u32>>,
    scale: Option<CudaSlice<f32>>,
    sub: Option<CudaSlice<f32>>,
    scratch: Option<CudaSlice<u64>>,
    pub generation: u64,
}

/// `buf` with room for `len` values (at least one), reallocated if it has less; true if it was.
fn room<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    dev: &Device,
    buf: &mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<bool> {
    if buf.as_ref().is_none_or(|b| b.len() < len.max(1)) {
        *buf = Some(dev.zeros(len.max(1).next_power_of_two())?);
        return Ok(true);
    }
    Ok(false)
}

impl RowSamplerInputs {
    /// Writes `rows`' parameters and penalties to the device, for the next `sample_rows_launch`.
    pub fn upload(&mut self, dev: &Device, rows: &[RowSampling]) -> Result<()> {
        let mut params = Vec::with_capacity(rows.len() * PARAM_WORDS);
        let (mut ids, mut scale, mut sub) = (vec![], vec![], vec![]);
        for r in rows {
            params.extend([
                r.temperature.to_bits(),
                r.top_k,
                r.top_p.to_bits(),
                r.min_p.to_bits(),
                r.seed as u32,
                (r.seed >> 32) as u32,
                r.draw as u32,
                (r.draw >> 32) as u32,
                u32_of(ids.len(), "sample_rows: penalties")?,
                u32_of(r.penalties.len(), "sample_rows: penalties")?,
            ]);
            for &(id, s, d) in &r.penalties {
                ids.push(id);
                scale.push(s);
                sub.push(d);
            }
        }
        let moved = room(dev, &mut self.params, params.len())?
            | room(dev, &mut self.ids, ids.len())?
            | room(dev, &mut self.scale, scale.len())?
            | room(dev, &mut self.sub, sub.len())?
            | room(dev, &mut self.scratch, 2 * rows.len())?;
        self.generation += u64::from(moved);
        let (Some(pd), Some(idd), Some(sd), Some(dd)) = (
            &mut self.params,
            &mut self.ids,
            &mut self.scale,
            &mut self.sub,
        ) else {
            unreachable!("room allocated every buffer")
        };
        dev.copy_to(pd, &params)?;
        dev.copy_to(idd, &ids)?;
        dev.copy_to(sd, &scale)?;
        dev.copy_to(dd, &sub)
    }
}

impl Device {
    /// `out[r]`: the next token of row `r` of `logits = [rows.len(), vocab]` (penalised in
    /// place) as `sampling::sample` picks it for the same penalised logits and parameters
    /// (its twin), but for last-bit differences at a boundary.
    pub fn sample_rows(
        &self,
        out: &mut impl DevicePtrMut<u32>,
        logits: &mut impl DevicePtrMut<f32>,
        vocab: usize,
        rows: &[RowSampling],
        inputs: &mut RowSamplerInputs,
    ) -> Result<()> {
        inputs.upload(self, rows)?;
        self.sample_rows_launch(out, logits, vocab, rows.len(), inputs)
    }

    /// The launch of `sample_rows` over `n_rows` rows whose parameters `inputs` holds already
    /// (`RowSamplerInputs::upload`): what a CUDA graph captures.
    pub fn sample_rows_launch(
        &self,
        out: &mut impl DevicePtrMut<u32>,
        logits: &mut impl DevicePtrMut<f32>,
        vocab: usize,
        n_rows: usize,
        inputs: &mut RowSamplerInputs,
    ) -> Result<()> {
        let (Some(pd), Some(idd), Some(sd), Some(dd), Some(scratch)) = (
            &inputs.params,
            &inputs.ids,
            &inputs.scale,
            &inputs.sub,
            &mut inputs.scratch,
        ) else {
            return Err(crate::Error::Invalid(
                "sample_rows: no rows uploaded".into(),
            ));
        };
        check(
            n_rows > 0
                && vocab > 0
                && out.len() >= n_rows
                && logits.len() >= n_rows * vocab
                && pd.len() >= n_rows * PARAM_WORDS
                && scratch.len() >= 2 * n_rows,
            "sample_rows: shapes",
        )?;
        // A greedy row's blocks: from the row count alone, so that a graph's launch fits
        // every step it replays (an arg-max is the same however it is split).
        let slices = (GREEDY_BLOCKS / n_rows).clamp(1, vocab.div_ceil(GREEDY_SLICE as usize));
        let shared = (SAMPLE_ROWS_SHARED_WORDS * 4) as u32;
        allow_shared(self.function(SampleRows::sample_rows), shared)?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(n_rows, "sample_rows: rows")?, slices as u32, 1),
            block_dim: (SAMPLE_ROWS_THREADS, 1, 1),
            shared_mem_bytes: shared,
        };
        let n = u32_of(vocab, "sample_rows: vocab")?;
        let s = self.stream();
        let (out, _o) = DevPtrMut::of(out, s);
        let (logits, _l) = DevPtrMut::of(logits, s);
        let (params, _p) = DevPtr::of(pd, s);
        let (pen_ids, _i) = DevPtr::of(idd, s);
        let (pen_scale, _s) = DevPtr::of(sd, s);
        let (pen_sub, _d) = DevPtr::of(dd, s);
        let (scratch, _x) = DevPtrMut::of(scratch, s);
        let p = SampleRows {
            out,
            logits,
            n,
            params,
            pen_ids,
            pen_scale,
            pen_sub,
            scratch,
        };
        // SAFETY: each block reads its row's PARAM_WORDS words (uploaded for at least n_rows
        // rows, their penalties inside the buffers) and its row of logits, writes out[r] and
        // uses its row's two scratch words (checked).
        unsafe { p.launch(self, SampleRows::sample_rows, cfg, Overlap::Serial) }
    }
}
