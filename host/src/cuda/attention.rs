//! Launch helpers of the attention family: RoPE, the KV cache and causal GQA attention.
//! Every kernel reads the current position from a one-element device buffer `pos`, so a
//! captured CUDA graph replays for any position; the kernels trap (a CUDA error at the next
//! synchronisation) when `pos` puts a row past the cache or the RoPE table.
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{BLOCK, Device, check, u32_of};
use crate::{Error, Result, cpu};

/// Threads per block of both attention kernels: 8 warps.
const ATTN_THREADS: u32 = 256;
/// Query rows per block of the prefill kernel.
const PREFILL_ROWS: usize = 64;
/// Shared memory of the prefill kernel: one round of K and V tiles as f16 halves.
const PREFILL_SHARED_BYTES: u32 = 32768;
/// Shared memory of the decode kernel, for head dims padded to 128: K `[32][132]`, V
/// `[32][128]`, 8 queries of 128 and 8 × 32 weights, f32.
const DECODE_SHARED_BYTES: u32 = ((32 * 132 + 32 * 128 + 8 * 128 + 8 * 32) * 4) as u32;
/// The kernels keep a head's output dims in registers, four per lane.
const MAX_HEAD_DIM: usize = 128;
/// Key slices of the decode kernel (its grid's y, at most 64). With the model's 2 kv heads
/// that is 128 blocks, about one per SM of an H100, each slice whole tiles of 32 keys: up to
/// 2048 keys every block has one tile, at 8192 four. More slices would shorten the blocks'
/// loops but lengthen the combine, which reads `slices * head_dim` partials per head.
const DECODE_SPLITS: usize = 64;
/// Query heads of a decode block, one per warp (larger kv groups take several blocks).
const DECODE_HEADS: usize = 8;

/// Scratch of split-K decode attention (`Device::attention`): each (head, key slice)'s partial
/// softmax `[n_heads, DECODE_SPLITS, 4 + ceil4(head_dim)]` (max, sum, two unused, the
/// unnormalised output: 16-byte aligned rows) and a completion count per query head. The
/// kernel leaves the counts at zero, so one scratch serves every layer and step, one launch at
/// a time (on the device's one stream).
pub struct AttentionScratch {
    partials: CudaSlice<f32>,
    counters: CudaSlice<u32>,
    n_heads: usize,
    head_dim: usize,
}

/// `n` as a kernel's `u32` size, or an error naming `what`.
impl Device {
    /// The scratch that `attention` needs for `n_heads` query heads of `head_dim`, zeroed.
    /// Allocate it once: `attention` allocates nothing, so that it can be captured in a graph.
    pub fn attention_scratch(&self, n_heads: usize, head_dim: usize) -> Result<AttentionScratch> {
        check_head_dim(head_dim)?;
        check(n_heads > 0, "attention_scratch: n_heads")?;
        let len = n_heads * DECODE_SPLITS * partial_len(head_dim);
        u32_of(len, "attention_scratch: partials")?;
        Ok(AttentionScratch {
            partials: self.zeros(len)?,
            counters: self.zeros(n_heads)?,
            n_heads,
            head_dim,
        })
    }

    /// Cos/sin of NeoX RoPE's angles for positions `0..max_pos`, `[max_pos, head_dim/2, 2]`
    /// f32, computed on the host exactly as `cpu::rope_neox` computes them (see
    /// `cpu::rope_table`), so that GPU and CPU rotations agree bit for bit.
    pub fn rope_table(
        &self,
        max_pos: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<CudaSlice<f32>> {
        check(
            max_pos > 0 && head_dim > 0 && head_dim.is_multiple_of(2),
            "rope_table: max_pos and head_dim (even)",
        )?;
        u32_of(max_pos, "rope_table: max_pos")?;
        self.upload(&cpu::rope_table(max_pos, head_dim, theta))
    }

    /// NeoX RoPE in place on `x = [rows, n_heads * head_dim]`, row `t` at position
    /// `pos[0] + t`, with angles from `table` (from `rope_table`). Twin: `cpu::rope_neox`.
    pub fn rope_neox(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        pos: &impl DevicePtr<u32>,
        table: &impl DevicePtr<f32>,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let row_len = n_heads * head_dim;
        check(
            head_dim > 0 && head_dim.is_multiple_of(2) && n_heads > 0 && pos.len() >= 1,
            "rope_neox: n_heads, head_dim (even) and pos",
        )?;
        check(
            x.len() > 0 && x.len().is_multiple_of(row_len) && table.len().is_multiple_of(head_dim),
            "rope_neox: shapes of x and table",
        )?;
        let (rows, max_pos) = (x.len() / row_len, table.len() / head_dim);
        check(rows <= max_pos, "rope_neox: rows and the table's positions")?;
        let pairs = u32_of(x.len() / 2, "rope_neox: x")?;
        let (rows, max_pos) = (rows as u32, u32_of(max_pos, "rope_neox: table")?);
        let (n_heads, half) = (n_heads as u32, (head_dim / 2) as u32);
        let cfg = LaunchConfig {
            grid_dim: (pairs.div_ceil(BLOCK), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.stream();
        let (xp, _x) = x.device_ptr_mut(stream);
        let (pp, _p) = pos.device_ptr(stream);
        let (tp, _t) = table.device_ptr(stream);
        let mut l = stream.launch_builder(self.kernel("rope_neox"));
        l.arg(&xp)
            .arg(&pp)
            .arg(&tp)
            .arg(&rows)
            .arg(&n_heads)
            .arg(&half)
            .arg(&max_pos);
        // SAFETY: parameters (f32*, const u32*, const f32*, u32, u32, u32, u32). One thread per
        // pair of the `rows * n_heads * half` pairs of x; table rows pos[0]..pos[0] + rows are
        // below max_pos or the kernel traps.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// Copies `k, v = [rows, kv_dim]` into rows `pos[0]..pos[0] + rows` of
    /// `k_cache, v_cache = [max_pos, kv_dim]`.
    pub fn kv_append(
        &self,
        k_cache: &mut impl DevicePtrMut<f32>,
        v_cache: &mut impl DevicePtrMut<f32>,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        pos: &impl DevicePtr<u32>,
        kv_dim: usize,
    ) -> Result<()> {
        check(
            kv_dim > 0 && pos.len() >= 1 && k.len() > 0 && k.len() == v.len(),
            "kv_append: kv_dim, pos, k and v",
        )?;
        check(
            k.len().is_multiple_of(kv_dim)
                && k_cache.len() == v_cache.len()
                && k_cache.len().is_multiple_of(kv_dim)
                && k.len() <= k_cache.len(),
            "kv_append: shapes of k and the caches",
        )?;
        u32_of(k_cache.len(), "kv_append: k_cache")?;
        let (rows, max_pos) = ((k.len() / kv_dim) as u32, (k_cache.len() / kv_dim) as u32);
        let n = k.len() as u32;
        let kv_dim = kv_dim as u32;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(BLOCK), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.stream();
        let (kc, _kc) = k_cache.device_ptr_mut(stream);
        let (vc, _vc) = v_cache.device_ptr_mut(stream);
        let (kp, _k) = k.device_ptr(stream);
        let (vp, _v) = v.device_ptr(stream);
        let (pp, _p) = pos.device_ptr(stream);
        let mut l = stream.launch_builder(self.kernel("kv_append"));
        l.arg(&kc).arg(&vc).arg(&kp).arg(&vp).arg(&pp);
        l.arg(&rows).arg(&kv_dim).arg(&max_pos);
        // SAFETY: parameters (f32*, f32*, const f32*, const f32*, const u32*, u32, u32, u32).
        // Reads rows * kv_dim of k and v; writes cache rows pos[0]..pos[0] + rows, below
        // max_pos or the kernel traps.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// Causal GQA attention of `q = [rows, n_heads * head_dim]`, row `t` at position
    /// `pos[0] + t` over keys `0..=pos[0] + t` of `k_cache, v_cache = [max_pos, n_kv_heads *
    /// head_dim]` (this call's keys already appended), into `out` (the shape of q). One row
    /// runs the split-K decode kernel, which uses `scratch` (from `attention_scratch` with the
    /// same heads and head_dim); more rows the prefill kernel. head_dim <= 128. Nothing in the
    /// launch depends on `pos`'s value. The decode kernel may overlap the kernel launched
    /// before it (programmatic dependent launch), which must not write `pos` or the cache rows
    /// before `pos[0]`. Twin: `cpu::attention`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        q: &impl DevicePtr<f32>,
        k_cache: &impl DevicePtr<f32>,
        v_cache: &impl DevicePtr<f32>,
        pos: &impl DevicePtr<u32>,
        scratch: &mut AttentionScratch,
        rows: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        check_head_dim(head_dim)?;
        check(
            rows > 0
                && n_kv_heads > 0
                && n_heads.is_multiple_of(n_kv_heads)
                && n_heads >= n_kv_heads,
            "attention: rows and head counts",
        )?;
        let kv_dim = n_kv_heads * head_dim;
        check(
            pos.len() >= 1
                && q.len() == rows * n_heads * head_dim
                && out.len() == q.len()
                && k_cache.len() == v_cache.len()
                && k_cache.len().is_multiple_of(kv_dim)
                && k_cache.len() / kv_dim >= rows,
            "attention: shapes of pos, q, out and the caches",
        )?;
        check(
            scratch.n_heads == n_heads && scratch.head_dim == head_dim,
            "attention: the scratch's heads and head_dim",
        )?;
        u32_of(k_cache.len().max(q.len()), "attention: buffers")?;
        let max_pos = (k_cache.len() / kv_dim) as u32;
        let hd = head_dim;
        let scale = 1.0 / (hd as f32).sqrt();
        let stream = self.stream();
        let (op, _o) = out.device_ptr_mut(stream);
        let (qp, _q) = q.device_ptr(stream);
        let (kc, _k) = k_cache.device_ptr(stream);
        let (vc, _v) = v_cache.device_ptr(stream);
        let (pp, _p) = pos.device_ptr(stream);
        let (sp, _s) = scratch.partials.device_ptr_mut(stream);
        let (cp, _c) = scratch.counters.device_ptr_mut(stream);
        let (name, grid, shared) = if rows == 1 {
            // The group's heads, one per warp, in as few blocks as hold them (`per_kv` as the
            // kernel computes it).
            let per_kv = (n_heads / n_kv_heads).div_ceil(DECODE_HEADS);
            let grid = (n_kv_heads * per_kv, DECODE_SPLITS);
            let vec = hd == 64 && [op, qp, kc, vc, sp].iter().all(|p| p % 16 == 0);
            let name = if vec {
                "attention_decode_hd64"
            } else {
                "attention_decode"
            };
            (name, grid, DECODE_SHARED_BYTES)
        } else {
            let grid = (rows.div_ceil(PREFILL_ROWS), n_heads);
            ("attention_prefill", grid, PREFILL_SHARED_BYTES)
        };
        let cfg = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, 1),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: shared,
        };
        let (rows, n_heads, n_kv, hd) = (rows as u32, n_heads as u32, n_kv_heads as u32, hd as u32);
        let mut l = self.launch(name);
        l.arg(&op).arg(&qp).arg(&kc).arg(&vc).arg(&pp);
        if rows == 1 {
            l.arg(&sp).arg(&cp);
        } else {
            l.arg(&rows);
        }
        l.arg(&n_heads)
            .arg(&n_kv)
            .arg(&hd)
            .arg(&max_pos)
            .arg(&scale);
        // SAFETY: parameters (f32*, const f32*, const f32*, const f32*, const u32*, then
        // f32*, u32* (decode) or u32 (prefill), then u32, u32, u32, u32, f32) as the kernels
        // declare them. q and out hold rows * n_heads * head_dim; the kernels read cache rows
        // 0..pos[0] + rows, below max_pos or they trap. Decode: partials hold [n_heads,
        // DECODE_SPLITS (the grid's y, <= 64), 4 + ceil4(head_dim)] and counters one per
        // head (the scratch's shape is checked). 256 threads and the shared memory
        // the kernels' docs ask for. The decode kernel reads only `pos` and the cache rows
        // before pos[0] before it calls `wait_prior_grids`, so it may overlap a kernel before
        // it that writes neither (the decode step's attn_qkv writes row pos[0]).
        unsafe { l.run(cfg, rows == 1) }?;
        Ok(())
    }
}

/// Floats per (head, slice) row of the decode kernel's partials.
fn partial_len(head_dim: usize) -> usize {
    4 + head_dim.next_multiple_of(4)
}

fn check_head_dim(head_dim: usize) -> Result<()> {
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(Error::Invalid(format!(
            "attention: head_dim {head_dim} is not supported (1..={MAX_HEAD_DIM})"
        )));
    }
    Ok(())
}
