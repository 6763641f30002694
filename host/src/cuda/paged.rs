//! Launch helpers of the paged family (gpu-kernels/src/paged.rs): the KV cache of batched
//! steps, kept in fixed-size blocks of f16 rows, and what ends a batched step.
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::{BLOCK, Device, allow_shared, check, u32_of};
use crate::Result;

/// Query rows of one sequence a block of `paged_attention` takes (gpu-kernels' `ITEM_ROWS`).
pub const ITEM_ROWS: usize = 8;
/// Keys of the kernel's tiles and its warps, for the size of its shared memory.
const TILE: usize = 32;
const WARPS: usize = 8;

/// One layer's paged KV cache: `slots = blocks * block_tokens` rows of `kv_dim` f16 for keys
/// and for values. Cache row `b * block_tokens + i` is token `i` of block `b`.
pub struct PagedKv {
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
}

/// Up to `ITEM_ROWS` consecutive rows of one sequence: the unit of work of `paged_attention`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionItem {
    /// The item's first row in the step's batch.
    pub row: u32,
    pub rows: u32,
    /// The position of its first row in its sequence.
    pub pos: u32,
    /// Where its sequence's block table starts in the step's tables.
    pub table: u32,
}

impl AttentionItem {
    /// The items of `rows` consecutive rows of one sequence from batch row `row`, the first at
    /// position `pos`.
    pub fn split(row: usize, rows: usize, pos: usize, table: usize) -> Vec<AttentionItem> {
        (0..rows)
            .step_by(ITEM_ROWS)
            .map(|i| AttentionItem {
                row: (row + i) as u32,
                rows: ITEM_ROWS.min(rows - i) as u32,
                pos: (pos + i) as u32,
                table: table as u32,
            })
            .collect()
    }

    /// The items as the kernel reads them: four u32 each.
    pub fn flatten(items: &[AttentionItem]) -> Vec<u32> {
        items
            .iter()
            .flat_map(|i| [i.row, i.rows, i.pos, i.table])
            .collect()
    }
}

/// Shared memory of a `paged_attention` block (gpu-kernels' `attention_shared_floats`).
fn attention_shared_bytes(head_dim: usize, group: usize) -> u32 {
    let vectors = ITEM_ROWS * group;
    (4 * (TILE * (2 * head_dim + 1) + 2 * vectors * head_dim + 2 * vectors + WARPS * TILE)) as u32
}

impl Device {
    /// A zeroed paged KV cache of `slots` rows of `kv_dim`.
    pub fn paged_kv(&self, slots: usize, kv_dim: usize) -> Result<PagedKv> {
        u32_of(slots * kv_dim, "paged_kv: slots")?;
        Ok(PagedKv {
            k: self.zeros(slots * kv_dim)?,
            v: self.zeros(slots * kv_dim)?,
        })
    }

    /// Per row `r` of `q = [rows, n_heads * head_dim]` and `k, v = [rows, kv_dim]`: NeoX RoPE at
    /// `positions[r]` on q (in place) and k, then k and v stored as f16 in cache row
    /// `slots[r]` of `kv`. Twin: `cpu::rope_neox` of each row at its position, rounded to f16.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv_paged(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        kv: &mut PagedKv,
        positions: &impl DevicePtr<u32>,
        slots: &impl DevicePtr<u32>,
        table: &impl DevicePtr<f32>,
        rows: usize,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
    ) -> Result<()> {
        let kv_dim = n_kv * head_dim;
        check(
            rows > 0
                && head_dim.is_multiple_of(2)
                && q.len() >= rows * n_heads * head_dim
                && k.len() >= rows * kv_dim
                && v.len() >= rows * kv_dim
                && positions.len() >= rows
                && slots.len() >= rows
                && kv.k.len() == kv.v.len()
                && table.len().is_multiple_of(head_dim),
            "rope_kv_paged: shapes",
        )?;
        let max_pos = u32_of(table.len() / head_dim, "rope_kv_paged: table")?;
        let (n_heads, n_kv, half) = (n_heads as u32, n_kv as u32, (head_dim / 2) as u32);
        let cfg = LaunchConfig {
            grid_dim: (u32_of(rows, "rope_kv_paged: rows")?, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = self.stream();
        let (qp, _q) = q.device_ptr_mut(s);
        let (kp, _k) = k.device_ptr(s);
        let (vp, _v) = v.device_ptr(s);
        let (kc, _kc) = kv.k.device_ptr_mut(s);
        let (vc, _vc) = kv.v.device_ptr_mut(s);
        let (pp, _p) = positions.device_ptr(s);
        let (sp, _s) = slots.device_ptr(s);
        let (tp, _t) = table.device_ptr(s);
        let mut l = self.launch("rope_kv_paged");
        l.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&kc)
            .arg(&vc)
            .arg(&pp)
            .arg(&sp)
            .arg(&tp);
        l.arg(&n_heads).arg(&n_kv).arg(&half).arg(&max_pos);
        // SAFETY: parameters (f32*, const f32*, const f32*, u16*, u16*, const u32*, const u32*,
        // const f32*, u32, u32, u32, u32); each block reads its row of q, k, v, positions and
        // slots (checked above) and writes cache row slots[r], which the caller keeps below
        // the cache's rows; positions at or past max_pos trap.
        unsafe { l.run(cfg, false) }?;
        Ok(())
    }

    /// Causal GQA attention of the rows of `q = [rows, n_heads * head_dim]` over the paged
    /// cache `kv`, each item's rows over their sequence's keys `0..=position` read through its
    /// block table in `tables`, into `out` (q's shape). `items` as `AttentionItem::flatten`
    /// writes them; every row of `q` in one item. Twin: `cpu::attention` per sequence.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        q: &impl DevicePtr<f32>,
        kv: &PagedKv,
        items: &impl DevicePtr<u32>,
        n_items: usize,
        tables: &impl DevicePtr<u32>,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        block_tokens: usize,
    ) -> Result<()> {
        check(
            n_items > 0
                && items.len() >= 4 * n_items
                && n_kv > 0
                && n_heads.is_multiple_of(n_kv)
                && head_dim.is_multiple_of(32)
                && head_dim <= 128
                && block_tokens > 0
                && out.len() == q.len()
                && q.len().is_multiple_of(n_heads * head_dim),
            "paged_attention: shapes",
        )?;
        let shared = attention_shared_bytes(head_dim, n_heads / n_kv);
        let f = self.kernel("paged_attention");
        allow_shared(f, shared)?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(n_items, "paged_attention: items")?, n_kv as u32, 1),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: shared,
        };
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (n_heads, n_kv, hd, bt) = (
            n_heads as u32,
            n_kv as u32,
            head_dim as u32,
            u32_of(block_tokens, "paged_attention: block_tokens")?,
        );
        let s = self.stream();
        let (op, _o) = out.device_ptr_mut(s);
        let (qp, _q) = q.device_ptr(s);
        let (kc, _kc) = kv.k.device_ptr(s);
        let (vc, _vc) = kv.v.device_ptr(s);
        let (ip, _i) = items.device_ptr(s);
        let (tp, _t) = tables.device_ptr(s);
        let mut l = self.launch("paged_attention");
        l.arg(&op).arg(&qp).arg(&kc).arg(&vc).arg(&ip).arg(&tp);
        l.arg(&n_heads).arg(&n_kv).arg(&hd).arg(&bt).arg(&scale);
        // SAFETY: parameters (f32*, const f32*, const u16*, const u16*, const u32*, const u32*,
        // u32, u32, u32, u32, f32). The items' rows lie in q and out and their block tables in
        // tables, covering every key up to each row's position, with block ids inside the
        // cache: the batch's builder (`cuda::batch`) guarantees it.
        unsafe { l.run(cfg, false) }?;
        Ok(())
    }

    /// `out[r] = x[rows[r]]` for `n_out` rows of `n` floats.
    pub fn gather_rows(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        rows: &impl DevicePtr<u32>,
        n_out: usize,
        n: usize,
    ) -> Result<()> {
        check(
            n_out > 0 && rows.len() >= n_out && out.len() >= n_out * n && x.len() >= n,
            "gather_rows: shapes",
        )?;
        let n = u32_of(n, "gather_rows: n")?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(n_out, "gather_rows: rows")?, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = self.stream();
        let (op, _o) = out.device_ptr_mut(s);
        let (xp, _x) = x.device_ptr(s);
        let (rp, _r) = rows.device_ptr(s);
        let mut l = self.launch("gather_rows");
        l.arg(&op).arg(&xp).arg(&rp).arg(&n);
        // SAFETY: parameters (f32*, const f32*, const u32*, u32); reads n_out row indices,
        // which the caller keeps inside x, and writes n_out rows of out (checked).
        unsafe { l.run(cfg, false) }?;
        Ok(())
    }
}
