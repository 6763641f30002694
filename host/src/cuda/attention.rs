//! Launch helpers of the attention family: RoPE, the KV cache and causal GQA attention.
//! Every kernel reads the current position from a one-element device buffer `pos`, so a
//! captured CUDA graph replays for any position; the kernels trap (a CUDA error at the next
//! synchronisation) when `pos` puts a row past the cache or the RoPE table.
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::kernels::{AttentionDecode, AttentionPrefill, DevPtr, DevPtrMut, KvAppend, RopeNeox};
use super::{BLOCK, Device, Overlap, check, u32_of};
use crate::{Error, Result, cpu};

// The kernels' block, rows of a prefill block, shared memory, largest head dim, the decode
// kernel's key slices (with the model's 2 kv heads, 128 blocks: about one per SM of an H100,
// each slice whole tiles of 32 keys, so up to 2048 keys every block has one tile, at 8192
// four) and its query heads per block.
use kernel_abi::attention::{
    DECODE_HEADS, DECODE_SHARED_BYTES, DECODE_SPLITS, MAX_HEAD_DIM, PREFILL_ROWS,
    PREFILL_SHARED_BYTES, THREADS,
};

/// What the decode attention (`Device::attention_decode`) adds its key slices into, for
/// `n_heads` query heads of `head_dim`: per head its unnormalised output and its softmax's
/// sum, both scaled by `e^-r` for a reference score `r` that every slice shares, `[n_heads *
/// head_dim + n_heads]` f64. The output projection (`Device::attn_output`) reads them
/// normalised; `Device::attn_qkv` zeroes them for the next token.
pub struct AttentionSums {
    pub(crate) sums: CudaSlice<f64>,
    pub(crate) n_heads: usize,
    pub(crate) head_dim: usize,
}

impl AttentionSums {
    /// The sums themselves, `[n_heads * head_dim + n_heads]` f64.
    pub fn raw(&self) -> &CudaSlice<f64> {
        &self.sums
    }

    /// The attention's output `[n_heads * head_dim]`: each head's sums over its softmax's sum,
    /// as `attn_output` reads them (f64, rounded to f32).
    pub fn output(&self, dev: &Device) -> Result<Vec<f32>> {
        let s = dev.download(&self.sums)?;
        let n = self.n_heads * self.head_dim;
        Ok((0..n)
            .map(|k| (s[k] / s[n + k / self.head_dim]) as f32)
            .collect())
    }
}

impl Device {
    /// Zeroed sums of the decode attention for `n_heads` query heads of `head_dim`. Allocate
    /// them once: `attention_decode` allocates nothing, so that it can be captured in a graph.
    pub fn attention_sums(&self, n_heads: usize, head_dim: usize) -> Result<AttentionSums> {
        check_head_dim(head_dim)?;
        check(n_heads > 0, "attention_sums: n_heads")?;
        let len = n_heads * (head_dim + 1);
        u32_of(len, "attention_sums")?;
        Ok(AttentionSums {
            sums: self.zeros(len)?,
            n_heads,
            head_dim,
        })
    }

    /// Zeroes `sums` (as `attn_qkv` does in a decode step), for another `attention_decode`.
    pub fn zero_sums(&self, sums: &mut AttentionSums) -> Result<()> {
        Ok(self.stream().memset_zeros(&mut sums.sums)?)
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
        let s = self.stream();
        let (x, _x) = DevPtrMut::of(x, s);
        let (pos, _p) = DevPtr::of(pos, s);
        let (table, _t) = DevPtr::of(table, s);
        let p = RopeNeox {
            x,
            pos,
            table,
            rows,
            n_heads,
            half,
            max_pos,
        };
        // SAFETY: one thread per pair of the `rows * n_heads * half` pairs of x; table rows
        // pos[0]..pos[0] + rows are below max_pos or the kernel traps.
        unsafe { p.launch(self, RopeNeox::rope_neox, cfg, Overlap::Serial) }
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
        let s = self.stream();
        let (k_cache, _kc) = DevPtrMut::of(k_cache, s);
        let (v_cache, _vc) = DevPtrMut::of(v_cache, s);
        let (k, _k) = DevPtr::of(k, s);
        let (v, _v) = DevPtr::of(v, s);
        let (pos, _p) = DevPtr::of(pos, s);
        let p = KvAppend {
            k_cache,
            v_cache,
            k,
            v,
            pos,
            rows,
            kv_dim,
            max_pos,
        };
        // SAFETY: reads rows * kv_dim of k and v; writes cache rows pos[0]..pos[0] + rows,
        // below max_pos or the kernel traps.
        unsafe { p.launch(self, KvAppend::kv_append, cfg, Overlap::Serial) }
    }

    /// Causal GQA attention of `q = [rows, n_heads * head_dim]`, row `t` at position
    /// `pos[0] + t` over keys `0..=pos[0] + t` of `k_cache, v_cache = [max_pos, n_kv_heads *
    /// head_dim]` (this call's keys already appended), into `out` (the shape of q), by the
    /// flash-attention prefill kernel. head_dim <= 128. Twin: `cpu::attention`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        q: &impl DevicePtr<f32>,
        k_cache: &impl DevicePtr<f32>,
        v_cache: &impl DevicePtr<f32>,
        pos: &impl DevicePtr<u32>,
        rows: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let max_pos = check_attention(
            q, k_cache, v_cache, pos, rows, n_heads, n_kv_heads, head_dim,
        )?;
        check(out.len() == q.len(), "attention: shapes of q and out")?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let s = self.stream();
        let (out, _o) = DevPtrMut::of(out, s);
        let (q, _q) = DevPtr::of(q, s);
        let (k_cache, _k) = DevPtr::of(k_cache, s);
        let (v_cache, _v) = DevPtr::of(v_cache, s);
        let (pos, _p) = DevPtr::of(pos, s);
        let cfg = LaunchConfig {
            grid_dim: ((rows as u32).div_ceil(PREFILL_ROWS), n_heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: PREFILL_SHARED_BYTES,
        };
        let p = AttentionPrefill {
            out,
            q,
            k_cache,
            v_cache,
            pos,
            rows: rows as u32,
            n_heads: n_heads as u32,
            n_kv: n_kv_heads as u32,
            head_dim: head_dim as u32,
            max_pos,
            scale,
        };
        // SAFETY: q and out hold rows * n_heads * head_dim; the kernel reads cache rows
        // 0..pos[0] + rows, below max_pos or it traps. 256 threads and the shared memory its
        // doc asks for.
        unsafe {
            p.launch(
                self,
                AttentionPrefill::attention_prefill,
                cfg,
                Overlap::Serial,
            )
        }
    }

    /// The attention of one query row `q = [n_heads * head_dim]` at position `pos[0]` over
    /// keys `0..=pos[0]` of the caches (as `attention`'s), by the split-K decode kernel: its
    /// key slices add into `sums` (`n_heads` and head_dim from there), which must be zero
    /// (from `attention_sums`, `zero_sums`, or `attn_qkv` in a decode step), and
    /// `sums.output` (or `attn_output`) normalises them. Nothing in the launch depends on
    /// `pos`'s value. The kernel may overlap the kernel launched before it (programmatic
    /// dependent launch), which must not write `pos` or the cache rows before `pos[0]`.
    /// Twin: `cpu::attention`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_decode(
        &self,
        sums: &mut AttentionSums,
        q: &impl DevicePtr<f32>,
        k_cache: &impl DevicePtr<f32>,
        v_cache: &impl DevicePtr<f32>,
        pos: &impl DevicePtr<u32>,
        n_kv_heads: usize,
    ) -> Result<()> {
        let (n_heads, hd) = (sums.n_heads, sums.head_dim);
        let max_pos = check_attention(q, k_cache, v_cache, pos, 1, n_heads, n_kv_heads, hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let s = self.stream();
        let (sums, _s) = DevPtrMut::of(&mut sums.sums, s);
        let (q, _q) = DevPtr::of(q, s);
        let (k_cache, _k) = DevPtr::of(k_cache, s);
        let (v_cache, _v) = DevPtr::of(v_cache, s);
        let (pos, _p) = DevPtr::of(pos, s);
        // The group's heads, one per warp, in as few blocks as hold them (`per_kv` as the
        // kernel computes it).
        let per_kv = (n_heads / n_kv_heads).div_ceil(DECODE_HEADS as usize);
        let aligned = sums.is_aligned(16) && [q, k_cache, v_cache].iter().all(|p| p.is_aligned(16));
        // Keyed by the head dim the kernel pads to.
        let entry = if hd == 64 && aligned {
            AttentionDecode::attention_decode_hd64
        } else {
            AttentionDecode::attention_decode
        };
        let cfg = LaunchConfig {
            grid_dim: ((n_kv_heads * per_kv) as u32, DECODE_SPLITS, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: DECODE_SHARED_BYTES,
        };
        let p = AttentionDecode {
            sums,
            q,
            k_cache,
            v_cache,
            pos,
            n_heads: n_heads as u32,
            n_kv: n_kv_heads as u32,
            head_dim: hd as u32,
            max_pos,
            scale,
        };
        // SAFETY: q holds n_heads * head_dim and sums n_heads * (head_dim + 1) (the sums'
        // shape is theirs); the kernel reads cache rows 0..=pos[0], below max_pos or it traps.
        // 256 threads and the shared memory the kernels' doc asks for. It reads only `pos` and
        // the cache rows before pos[0] before it calls `wait_prior_grids`, so it may overlap a
        // kernel before it that writes neither (the decode step's attn_qkv writes row pos[0]).
        unsafe { p.launch(self, entry, cfg, Overlap::Allowed) }
    }
}

/// Checks the shapes of an attention of `rows` query rows; the caches' positions.
#[allow(clippy::too_many_arguments)]
fn check_attention(
    q: &impl DevicePtr<f32>,
    k_cache: &impl DevicePtr<f32>,
    v_cache: &impl DevicePtr<f32>,
    pos: &impl DevicePtr<u32>,
    rows: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Result<u32> {
    check_head_dim(head_dim)?;
    check(
        rows > 0 && n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads) && n_heads >= n_kv_heads,
        "attention: rows and head counts",
    )?;
    let kv_dim = n_kv_heads * head_dim;
    check(
        pos.len() >= 1
            && q.len() == rows * n_heads * head_dim
            && k_cache.len() == v_cache.len()
            && k_cache.len().is_multiple_of(kv_dim)
            && k_cache.len() / kv_dim >= rows,
        "attention: shapes of pos, q and the caches",
    )?;
    u32_of(k_cache.len().max(q.len()), "attention: buffers")?;
    Ok((k_cache.len() / kv_dim) as u32)
}

fn check_head_dim(head_dim: usize) -> Result<()> {
    if head_dim == 0 || head_dim > MAX_HEAD_DIM as usize {
        return Err(Error::Invalid(format!(
            "attention: head_dim {head_dim} is not supported (1..={MAX_HEAD_DIM})"
        )));
    }
    Ok(())
}
