//! The paged KV cache of batched steps: RoPE and the cache store for rows at their own
//! positions, attention of each row over its sequence read through the sequence's block table,
//! and the row gather that ends a batched step. CPU twins: `orcd::cpu::rope_neox`
//! (per row) with the cache's f16 rounding, `orcd::cpu::attention` over a sequence gathered
//! from its blocks.
use core::arch::nvptx;

use crate::util::{
    WARP, block, block_dim, count_last, exp, fence_gpu, load_l2, shared, sync_threads, thread,
    warp_max, warp_sum,
};

use kernel_abi::paged::{ITEM_ROWS, WARPS, partial_floats};

use crate::params::{GatherRows, KvCopyPaged, PagedAttention, RopeKvPaged};

/// Keys of a tile.
const TILE: usize = kernel_abi::paged::TILE as usize;
/// Blocks that share an item's tiles.
const SPLITS: usize = kernel_abi::paged::SPLITS as usize;

/// Per row `r`: NeoX RoPE at position `positions[r]` on q's `n_heads` heads (in place) and on
/// k's `n_kv` heads, then k (rotated) and v stored as f16 in row `slots[r]` of `k_cache,
/// v_cache = [slots, n_kv * 2 * half]`. Angles from `table = [max_pos, half, 2]` (cos, sin), as
/// `rope_neox`; a position outside it traps.
/// Grid: one block per row; block: any multiple of 32 threads; no shared memory.
#[inline(always)]
pub(crate) unsafe fn rope_kv_paged(p: RopeKvPaged) {
    let RopeKvPaged {
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
    } = p;
    let r = block() as usize;
    let (p, slot) = unsafe { (*positions.add(r), *slots.add(r) as usize) };
    if p >= max_pos {
        unsafe { nvptx::trap() };
    }
    let (half_, hd) = (half as usize, 2 * half as usize);
    let (q_dim, kv_dim) = (n_heads as usize * hd, n_kv as usize * hd);
    let (q, k, v) = unsafe { (q.add(r * q_dim), k.add(r * kv_dim), v.add(r * kv_dim)) };
    let (kc, vc) = unsafe { (k_cache.add(slot * kv_dim), v_cache.add(slot * kv_dim)) };
    let mut idx = thread();
    while idx < (n_heads + n_kv) * half {
        let (head, i) = ((idx / half) as usize, (idx % half) as usize);
        let (cos, sin) = unsafe {
            let t = table.add(2 * (p as usize * half_ + i));
            (*t, *t.add(1))
        };
        if head < n_heads as usize {
            unsafe {
                let a = q.add(head * hd + i);
                let b = a.add(half_);
                let (va, vb) = (*a, *b);
                *a = va * cos - vb * sin;
                *b = va * sin + vb * cos;
            }
        } else {
            let at = (head - n_heads as usize) * hd + i;
            unsafe {
                let (va, vb) = (*k.add(at), *k.add(at + half_));
                *kc.add(at) = ((va * cos - vb * sin) as f16).to_bits();
                *kc.add(at + half_) = ((va * sin + vb * cos) as f16).to_bits();
            }
        }
        idx += block_dim();
    }
    let mut i = thread() as usize;
    while i < kv_dim {
        unsafe { *vc.add(i) = (*v.add(i) as f16).to_bits() };
        i += block_dim() as usize;
    }
}

/// Causal GQA attention over a paged KV cache, for a batch of query rows of many sequences.
/// Work item `w` (grid x) is `items[4w..4w + 4] = (first row, rows, position of the first
/// row, offset of the sequence's block table in tables)`: up to `ITEM_ROWS` consecutive rows
/// of one sequence. Row `r` at position `p` attends over keys `0..=p` of its sequence, key `j`
/// in cache row `tables[offset + j / block_tokens] * block_tokens + j % block_tokens` of
/// `k_cache, v_cache = [slots, n_kv * hd]` (f16). Query head `h` of `q, out = [rows, n_heads
/// * hd]` reads kv head `h / (n_heads / n_kv)` (grid y). Scores are scaled by `scale`.
///
/// Flash-decoding: the item's keys are tiles of `TILE`, and block `z` (grid z) runs the
/// online softmax over tiles `z, z + SPLITS, ...` alone; blocks past the item's tiles leave at
/// once. With more than one block at work, each writes its partial (output, max, sum) per
/// query vector to `part`, and the last to finish (`counts`) adds them up in split order. A
/// row's tiles, their split and that order follow from its position alone, so its result does
/// not depend on the rows beside it, in its item or in the batch.
/// Grid: (items, n_kv, `SPLITS`); block: `WARPS` warps; shared: `attention_shared_bytes(hd,
/// group)`. `hd` <= 128, a multiple of 32.
#[inline(always)]
pub(crate) unsafe fn paged_attention(p: PagedAttention) {
    let PagedAttention {
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
        block_tokens,
        scale,
    } = p;
    let kvh = unsafe { nvptx::_block_idx_y() } as usize;
    let split = unsafe { nvptx::_block_idx_z() } as usize;
    let item = unsafe { items.add(4 * block() as usize) };
    let (row0, rows, pos0, table) = unsafe {
        (
            *item as usize,
            *item.add(1) as usize,
            *item.add(2) as usize,
            tables.add(*item.add(3) as usize),
        )
    };
    let keys = pos0 + rows;
    let splits = keys.div_ceil(TILE).min(SPLITS);
    if split >= splits {
        return;
    }
    let group = (n_heads / n_kv) as usize;
    let (hd, vectors) = (hd as usize, rows * group);
    let (q_dim, kv_dim) = (n_heads as usize * hd, n_kv as usize * hd);
    let (lane, warp) = ((thread() % WARP) as usize, (thread() / WARP) as usize);

    let smem = shared::<f32>();
    let ks = smem;
    let vs = unsafe { ks.add(TILE * (hd + 1)) };
    let qs = unsafe { vs.add(TILE * hd) };
    let os = unsafe { qs.add(ITEM_ROWS as usize * group * hd) };
    let ms = unsafe { os.add(ITEM_ROWS as usize * group * hd) };
    let ls = unsafe { ms.add(ITEM_ROWS as usize * group) };
    let ps = unsafe { ls.add(ITEM_ROWS as usize * group).add(warp * TILE) };

    // Vector `v` is row `v / group`, head `kvh * group + v % group`.
    let q_at = |v: usize| (row0 + v / group) * q_dim + (kvh * group + v % group) * hd;
    let mut i = thread() as usize;
    while i < vectors * hd {
        let (v, d) = (i / hd, i % hd);
        unsafe {
            *qs.add(i) = *q.add(q_at(v) + d);
            *os.add(i) = 0.0;
        }
        i += block_dim() as usize;
    }
    let mut v = thread() as usize;
    while v < vectors {
        unsafe {
            *ms.add(v) = f32::NEG_INFINITY;
            *ls.add(v) = 0.0;
        }
        v += block_dim() as usize;
    }

    let bt = block_tokens as usize;
    let mut t0 = split * TILE;
    while t0 < keys {
        // Everyone is done with the last tile (and the set-up above) before it is replaced.
        sync_threads();
        let mut i = thread() as usize;
        while i < TILE * hd / 2 {
            let (key, d) = (i / (hd / 2), 2 * (i % (hd / 2)));
            let j = t0 + key;
            let (kv, vv) = if j < keys {
                let slot = unsafe { *table.add(j / bt) } as usize * bt + j % bt;
                let at = slot * kv_dim + kvh * hd + d;
                unsafe {
                    (
                        *(k_cache.add(at) as *const u32),
                        *(v_cache.add(at) as *const u32),
                    )
                }
            } else {
                (0, 0)
            };
            unsafe {
                *ks.add(key * (hd + 1) + d) = half_lo(kv);
                *ks.add(key * (hd + 1) + d + 1) = half_hi(kv);
                *vs.add(key * hd + d) = half_lo(vv);
                *vs.add(key * hd + d + 1) = half_hi(vv);
            }
            i += block_dim() as usize;
        }
        sync_threads();

        let mut v = warp;
        while v < vectors {
            let p = pos0 + v / group;
            let j = t0 + lane;
            let s = if j <= p {
                let (qv, kv) = unsafe { (qs.add(v * hd), ks.add(lane * (hd + 1))) };
                let mut dot = 0.0f32;
                for d in 0..hd {
                    dot += unsafe { *qv.add(d) * *kv.add(d) };
                }
                dot * scale
            } else {
                f32::NEG_INFINITY
            };
            let tile_max = warp_max(s);
            // A row before this tile's first key sees none of it.
            if tile_max != f32::NEG_INFINITY {
                let m_old = unsafe { *ms.add(v) };
                let m = m_old.max(tile_max);
                let w = exp(s - m);
                let corr = exp(m_old - m);
                let sum = warp_sum(w);
                unsafe { *ps.add(lane) = w };
                sync_warp();
                let o = unsafe { os.add(v * hd) };
                let mut d = lane;
                while d < hd {
                    let mut acc = unsafe { *o.add(d) } * corr;
                    for key in 0..TILE {
                        acc += unsafe { *ps.add(key) * *vs.add(key * hd + d) };
                    }
                    unsafe { *o.add(d) = acc };
                    d += WARP as usize;
                }
                sync_warp();
                if lane == 0 {
                    unsafe {
                        *ms.add(v) = m;
                        *ls.add(v) = *ls.add(v) * corr + sum;
                    }
                }
                sync_warp();
            }
            v += WARPS as usize;
        }
        t0 += SPLITS * TILE;
    }
    sync_threads();
    if splits == 1 {
        let mut i = thread() as usize;
        while i < vectors * hd {
            let (v, d) = (i / hd, i % hd);
            unsafe { *out.add(q_at(v) + d) = *os.add(i) / *ls.add(v) };
            i += block_dim() as usize;
        }
        return;
    }

    // This block's partials, then the last block of the item's splits adds them up.
    let rec = partial_floats(hd as u32) as usize;
    let part_at = |v: usize, z: usize| {
        (((row0 + v / group) * n_heads as usize + kvh * group + v % group) * SPLITS + z) * rec
    };
    let mut i = thread() as usize;
    while i < vectors * hd {
        let (v, d) = (i / hd, i % hd);
        unsafe { *part.add(part_at(v, split) + d) = *os.add(i) };
        i += block_dim() as usize;
    }
    let mut v = thread() as usize;
    while v < vectors {
        unsafe {
            *part.add(part_at(v, split) + hd) = *ms.add(v);
            *part.add(part_at(v, split) + hd + 1) = *ls.add(v);
        }
        v += block_dim() as usize;
    }
    fence_gpu();
    sync_threads();
    // The tiles are done with: word 0 tells the block whether it is the last.
    let last = smem as *mut u32;
    if thread() == 0 {
        let count = unsafe { counts.add(block() as usize * n_kv as usize + kvh) };
        unsafe { *last = count_last(count, splits as u32) as u32 };
    }
    sync_threads();
    if unsafe { *last } == 0 {
        return;
    }
    // Row `r`'s own splits: those that hold its keys, each scaled to the largest max.
    let splits_of = |v: usize| (pos0 + v / group + 1).div_ceil(TILE).min(SPLITS);
    let max_of = |v: usize| {
        let mut m = f32::NEG_INFINITY;
        for z in 0..splits_of(v) {
            m = m.max(load_l2(unsafe { part.add(part_at(v, z) + hd) }));
        }
        m
    };
    let factor = |v: usize, z: usize, m: f32| {
        let mz = load_l2(unsafe { part.add(part_at(v, z) + hd) });
        if mz == m { 1.0 } else { exp(mz - m) }
    };
    let mut v = thread() as usize;
    while v < vectors {
        let m = max_of(v);
        let mut l = 0.0f32;
        for z in 0..splits_of(v) {
            l += load_l2(unsafe { part.add(part_at(v, z) + hd + 1) }) * factor(v, z, m);
        }
        unsafe {
            *ms.add(v) = m;
            *ls.add(v) = l;
        }
        v += block_dim() as usize;
    }
    sync_threads();
    let mut i = thread() as usize;
    while i < vectors * hd {
        let (v, d) = (i / hd, i % hd);
        let m = unsafe { *ms.add(v) };
        let mut o = 0.0f32;
        for z in 0..splits_of(v) {
            o += load_l2(unsafe { part.add(part_at(v, z) + d) }) * factor(v, z, m);
        }
        unsafe { *out.add(q_at(v) + d) = o / *ls.add(v) };
        i += block_dim() as usize;
    }
}

/// `out[r] = x[rows[r]]` for rows of `n` floats. Grid: one block per output row.
#[inline(always)]
pub(crate) unsafe fn gather_rows(p: GatherRows) {
    let GatherRows { out, x, rows, n } = p;
    let r = block() as usize;
    let (out, x) = unsafe {
        (
            out.add(r * n as usize),
            x.add(*rows.add(r) as usize * n as usize),
        )
    };
    let mut i = thread() as usize;
    while i < n as usize {
        unsafe { *out.add(i) = *x.add(i) };
        i += block_dim() as usize;
    }
}

/// One position of a sequence between the contiguous and the paged caches (the declaration's
/// contract); `DIR` is `paged::FROM_PAGED` or `paged::TO_PAGED`. Grid: one block per position.
#[inline(always)]
pub(crate) unsafe fn kv_copy_paged<const DIR: u32>(p: KvCopyPaged) {
    let KvCopyPaged {
        k,
        v,
        k_paged,
        v_paged,
        table,
        first,
        kv_dim,
        block_tokens,
    } = p;
    let (pos, bt, n) = (
        (first + block()) as usize,
        block_tokens as usize,
        kv_dim as usize,
    );
    let slot = unsafe { *table.add(pos / bt) } as usize * bt + pos % bt;
    let (c, pg) = (pos * n, slot * n);
    let mut i = thread() as usize;
    while i < n {
        unsafe {
            if DIR == kernel_abi::paged::TO_PAGED {
                *k_paged.add(pg + i) = (*k.add(c + i) as f16).to_bits();
                *v_paged.add(pg + i) = (*v.add(c + i) as f16).to_bits();
            } else {
                *k.add(c + i) = f16::from_bits(*k_paged.add(pg + i)) as f32;
                *v.add(c + i) = f16::from_bits(*v_paged.add(pg + i)) as f32;
            }
        }
        i += block_dim() as usize;
    }
}

fn half_lo(bits: u32) -> f32 {
    f16::from_bits(bits as u16) as f32
}

fn half_hi(bits: u32) -> f32 {
    f16::from_bits((bits >> 16) as u16) as f32
}

fn sync_warp() {
    unsafe { core::arch::asm!("bar.warp.sync -1;", options(nostack)) };
}
