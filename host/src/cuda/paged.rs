//! Launch helpers of the paged family (gpu-kernels/src/paged.rs): the KV cache of batched
//! steps, kept in fixed-size blocks of f16 rows, and what ends a batched step.
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use kernel_abi::paged::{SPLITS, WARPS, attention_shared_bytes, partial_floats};

use super::kernels::{DevPtr, DevPtrMut, GatherRows, KvCopyPaged, PagedAttention, RopeKvPaged};
use super::{BLOCK, Device, Overlap, SplitScratch, allow_shared, check, u32_of};
use crate::Result;

/// Query rows of one sequence a block of `paged_attention` takes.
pub const ITEM_ROWS: usize = kernel_abi::paged::ITEM_ROWS as usize;
/// Keys up to which each tile of a row's keys has a block of `paged_attention` to itself;
/// past it, blocks take several tiles.
pub const SPLIT_KEYS: usize = (SPLITS * kernel_abi::paged::TILE) as usize;

/// One layer's paged KV cache: `slots = blocks * block_tokens` rows of `kv_dim` f16 for keys
/// and for values. Cache row `b * block_tokens + i` is token `i` of block `b`.
pub struct PagedKv {
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
}

/// Which way `kv_copy_paged` copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCopy {
    /// Paged f16 rows widened into the contiguous f32 cache.
    FromPaged,
    /// Contiguous f32 rows rounded to nearest into paged f16 ones.
    ToPaged,
}

/// Floats of `paged_attention`'s partial results for `rows` rows of q.
fn attention_part_floats(rows: usize, n_heads: usize, head_dim: usize) -> usize {
    rows * n_heads * SPLITS as usize * partial_floats(head_dim as u32) as usize
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

impl Device {
    /// A zeroed paged KV cache of `slots` rows of `kv_dim`.
    pub fn paged_kv(&self, slots: usize, kv_dim: usize) -> Result<PagedKv> {
        u32_of(slots * kv_dim, "paged_kv: slots")?;
        Ok(PagedKv {
            k: self.zeros(slots * kv_dim)?,
            v: self.zeros(slots * kv_dim)?,
        })
    }

    /// The scratch of `paged_attention` for up to `rows` rows of q and `items` items: each
    /// block's partial result per (row, query head, split), and a count per (item, kv head).
    pub fn paged_scratch(
        &self,
        rows: usize,
        items: usize,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
    ) -> Result<SplitScratch> {
        self.split_scratch(attention_part_floats(rows, n_heads, head_dim), items * n_kv)
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
        let (q, _q) = DevPtrMut::of(q, s);
        let (k, _k) = DevPtr::of(k, s);
        let (v, _v) = DevPtr::of(v, s);
        let (k_cache, _kc) = DevPtrMut::of(&mut kv.k, s);
        let (v_cache, _vc) = DevPtrMut::of(&mut kv.v, s);
        let (positions, _p) = DevPtr::of(positions, s);
        let (slots, _s) = DevPtr::of(slots, s);
        let (table, _t) = DevPtr::of(table, s);
        let p = RopeKvPaged {
            q,
            k,
            v,
            k_cache,
            v_cache,
            positions,
            slots,
            table,
            n_heads,
            n_kv,
            half,
            max_pos,
        };
        // SAFETY: each block reads its row of q, k, v, positions and slots (checked above) and
        // writes cache row slots[r], which the caller keeps inside the cache; positions at or
        // past max_pos trap.
        unsafe { p.launch(self, RopeKvPaged::rope_kv_paged, cfg, Overlap::Serial) }
    }

    /// Causal GQA attention of the rows of `q = [rows, n_heads * head_dim]` over the paged
    /// cache `kv`, each item's rows over their sequence's keys `0..=position` read through its
    /// block table in `tables`, into `out` (q's shape). `items` as `AttentionItem::flatten`
    /// writes them; every row of `q` in one item. `scratch` as `paged_scratch` makes it, for at
    /// least q's rows and `n_items`. Each row's keys are split over up to `SPLITS` blocks by
    /// its position alone, so its result does not depend on the batch. Twin: `cpu::attention`
    /// per sequence.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        q: &impl DevicePtr<f32>,
        kv: &PagedKv,
        items: &impl DevicePtr<u32>,
        n_items: usize,
        tables: &impl DevicePtr<u32>,
        scratch: &mut SplitScratch,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        block_tokens: usize,
    ) -> Result<()> {
        let rows = q.len() / (n_heads * head_dim).max(1);
        let part = attention_part_floats(rows, n_heads, head_dim);
        check(
            n_items > 0
                && items.len() >= 4 * n_items
                && n_kv > 0
                && n_heads.is_multiple_of(n_kv)
                && head_dim.is_multiple_of(32)
                && head_dim <= 128
                && block_tokens > 0
                && out.len() == q.len()
                && q.len().is_multiple_of(n_heads * head_dim)
                && scratch.part.len() >= part
                && scratch.counts.len() >= n_items * n_kv,
            "paged_attention: shapes",
        )?;
        let shared = attention_shared_bytes(head_dim as u32, (n_heads / n_kv) as u32);
        allow_shared(self.function(PagedAttention::paged_attention), shared)?;
        let cfg = LaunchConfig {
            grid_dim: (
                u32_of(n_items, "paged_attention: items")?,
                n_kv as u32,
                SPLITS,
            ),
            block_dim: (WARPS * 32, 1, 1),
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
        let (out, _o) = DevPtrMut::of(out, s);
        let (q, _q) = DevPtr::of(q, s);
        let (k_cache, _kc) = DevPtr::of(&kv.k, s);
        let (v_cache, _vc) = DevPtr::of(&kv.v, s);
        let (items, _i) = DevPtr::of(items, s);
        let (tables, _t) = DevPtr::of(tables, s);
        let (part, _p) = DevPtrMut::of(&mut scratch.part, s);
        let (counts, _c) = DevPtrMut::of(&mut scratch.counts, s);
        let p = PagedAttention {
            out,
            q,
            k_cache,
            v_cache,
            items,
            tables,
            part,
            counts,
            n_heads,
            n_kv,
            hd,
            block_tokens: bt,
            scale,
        };
        // SAFETY: the items' rows lie in q and out and their block tables in tables, covering
        // every key up to each row's position, with block ids inside the cache: the batch's
        // builder (`cuda::batch`) guarantees it. The partials of q's rows and the counts of
        // n_items items fit the scratch (checked).
        unsafe { p.launch(self, PagedAttention::paged_attention, cfg, Overlap::Serial) }
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
        let (out, _o) = DevPtrMut::of(out, s);
        let (x, _x) = DevPtr::of(x, s);
        let (rows, _r) = DevPtr::of(rows, s);
        let p = GatherRows { out, x, rows, n };
        // SAFETY: reads n_out row indices, which the caller keeps inside x, and writes n_out
        // rows of out (checked).
        unsafe { p.launch(self, GatherRows::gather_rows, cfg, Overlap::Serial) }
    }

    /// Copies positions `first..first + n` of one sequence, whose block table (blocks of
    /// `block_tokens`) is `table`, between the contiguous f32 cache `k, v = [max_pos, kv_dim]`
    /// and the paged cache `kv`, the way `dir` says.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_copy_paged(
        &self,
        dir: KvCopy,
        k: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        kv: &mut PagedKv,
        table: &impl DevicePtr<u32>,
        first: usize,
        n: usize,
        kv_dim: usize,
        block_tokens: usize,
    ) -> Result<()> {
        let end = first + n;
        check(
            block_tokens > 0
                && k.len().min(v.len()) >= end * kv_dim
                && table.len() >= end.div_ceil(block_tokens),
            "kv_copy_paged: shapes",
        )?;
        if n == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (u32_of(n, "kv_copy_paged: n")?, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = self.stream();
        let (k, _k) = DevPtrMut::of(k, s);
        let (v, _v) = DevPtrMut::of(v, s);
        let (k_paged, _kp) = DevPtrMut::of(&mut kv.k, s);
        let (v_paged, _vp) = DevPtrMut::of(&mut kv.v, s);
        let (table, _t) = DevPtr::of(table, s);
        let p = KvCopyPaged {
            k,
            v,
            k_paged,
            v_paged,
            table,
            first: u32_of(first, "kv_copy_paged: first")?,
            kv_dim: u32_of(kv_dim, "kv_copy_paged: kv_dim")?,
            block_tokens: u32_of(block_tokens, "kv_copy_paged: block_tokens")?,
        };
        let entry = match dir {
            KvCopy::FromPaged => KvCopyPaged::kv_from_paged,
            KvCopy::ToPaged => KvCopyPaged::kv_to_paged,
        };
        // SAFETY: positions below first + n lie in k and v and in the table (checked); the
        // table's block ids lie in the paged cache: its builder (`cuda::batch`) guarantees it.
        unsafe { p.launch(self, entry, cfg, Overlap::Serial) }
    }
}
