//! The GPU layout of quantized weight matrices ("packed"): the same bits as the file's blocks,
//! rearranged at load so that a GPU lane reads the 32 weights of a chunk with a few aligned
//! loads (16 bytes of low bits, then the high bits and scales), instead of the halfword loads
//! that blocks of 18, 22, 34 or 210 bytes allow. Lossless: every weight dequantizes to the
//! bit-identical f32 of `quant::dequantize` (a test checks it for every type).
//!
//! A matrix of `rows` rows of `n_in` elements is `rows · n_in / 32` chunks of 32 consecutive
//! elements of a row, chunk `c` = row `c / (n_in / 32)`. Each element has an unsigned quant
//! `q` of `4 + BITS` bits and the weight is `s·(q - ZERO) - m`, where `s` is the scale of the
//! element's half of the chunk and `m` its min (per type, see `Packing`). Four sections,
//! each starting 16-byte aligned, in this order:
//!
//! - `lo`: 16 bytes per chunk, byte `i` = `q[i] & 15 | (q[i + 16] & 15) << 4`.
//! - `hi`: `4·BITS` bytes per chunk, the quants' bits from 4 on, laid out for the GPU's byte
//!   lanes: for the `lo` word `j` (bytes `4j..4j + 4`, elements `4j + b` and `16 + 4j + b`,
//!   `b` in 0..4), byte `b` of hi word `j·BITS / 4` holds `q[4j + b] >> 4` at bit
//!   `s = 2·BITS·j % 8` and `q[16 + 4j + b] >> 4` at bit `s + BITS`.
//! - `sc`: a u16 per chunk: the f16 scale `d` (q4_0, q5_0, q8_0); the 6-bit scale and min of
//!   the sub-block (q4_K, q5_K: low byte, high byte); the two i8 scales of its halves (q6_K).
//! - `sup`: the k-quants' super-block of 8 chunks (256 elements), a u32: `d | dmin << 16`
//!   (f16 bits; q4_K, q5_K) or `d` (q6_K); empty for the other types.
//!
//! The plain float types (f32, f16, bf16) are their bytes as they are. The kernels compute the
//! same offsets (`gpu-kernels/src/quant.rs`, `Packed::new`).
use std::borrow::Cow;

use half::f16;
use rayon::prelude::*;

use crate::quant::GgmlType;
use crate::{Error, Result};

/// Elements per chunk.
pub const CHUNK: usize = 32;

/// Byte offsets of the four sections of a packed matrix, and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub hi: usize,
    pub sc: usize,
    pub sup: usize,
    pub bytes: usize,
}

/// How a quantized type packs: bits above the low 4 (`BITS`), the zero point, and whether it
/// has super-block words.
#[derive(Clone, Copy)]
struct Packing {
    bits: usize,
    zero: u32,
    sup: bool,
}

fn packing(ty: GgmlType) -> Option<Packing> {
    use GgmlType::*;
    let (bits, zero, sup) = match ty {
        F32 | F16 | BF16 => return None,
        Q4_0 => (0, 8, false),
        Q5_0 => (1, 16, false),
        Q8_0 => (4, 128, false),
        Q4K => (0, 0, true),
        Q5K => (1, 0, true),
        Q6K => (2, 32, true),
    };
    Some(Packing { bits, zero, sup })
}

fn align16(n: usize) -> usize {
    n.next_multiple_of(16)
}

/// The packed layout of `rows` rows of `n_in` elements of `ty`, or `None` if rows are not whole
/// blocks. Plain float types: one section, their bytes.
pub fn layout(ty: GgmlType, rows: usize, n_in: usize) -> Option<Layout> {
    let row_bytes = ty.row_bytes(n_in)?;
    let Some(p) = packing(ty) else {
        let bytes = rows.checked_mul(row_bytes)?;
        return Some(Layout {
            hi: bytes,
            sc: bytes,
            sup: bytes,
            bytes,
        });
    };
    let chunks = rows.checked_mul(n_in / CHUNK)?;
    let hi = align16(chunks.checked_mul(16)?);
    let sc = hi.checked_add(align16(chunks * 4 * p.bits))?;
    let sup = sc.checked_add(align16(chunks * 2))?;
    let sup_bytes = if p.sup { align16(chunks / 8 * 4) } else { 0 };
    Some(Layout {
        hi,
        sc,
        sup,
        bytes: sup.checked_add(sup_bytes)?,
    })
}

/// One block's quants (unsigned, `4 + BITS` bits) and its chunks' `sc` words.
struct Unpacked {
    q: [u8; 256],
    sc: [u16; 8],
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The quants and scales of block `b` of `ty` (a quantized type), in element order.
fn unpack_block(ty: GgmlType, b: &[u8]) -> Unpacked {
    use GgmlType::*;
    let mut u = Unpacked {
        q: [0; 256],
        sc: [0; 8],
    };
    match ty {
        Q4_0 | Q5_0 => {
            let (qh, qs) = if ty == Q5_0 {
                (u32::from_le_bytes(b[2..6].try_into().unwrap()), &b[6..22])
            } else {
                (0, &b[2..18])
            };
            for (j, &q) in qs.iter().enumerate() {
                u.q[j] = q & 15 | ((qh >> j & 1) << 4) as u8;
                u.q[j + 16] = q >> 4 | ((qh >> (j + 16) & 1) << 4) as u8;
            }
            u.sc[0] = u16_at(b, 0);
        }
        Q8_0 => {
            for (q, &v) in u.q.iter_mut().zip(&b[2..34]) {
                *q = v ^ 0x80;
            }
            u.sc[0] = u16_at(b, 0);
        }
        Q4K | Q5K => {
            let scales: &[u8; 12] = b[4..16].try_into().unwrap();
            let (qh, qs) = if ty == Q5K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for sub in 0..8 {
                let (sc, m) = crate::quant::scale_min_k4(sub, scales);
                u.sc[sub] = u16::from(sc) | u16::from(m) << 8;
                for l in 0..32 {
                    let high = qh.map_or(0, |qh| (qh[l] >> sub & 1) << 4);
                    u.q[32 * sub + l] = qs[32 * (sub / 2) + l] >> (4 * (sub % 2)) & 15 | high;
                }
            }
        }
        Q6K => {
            for h in 0..2 {
                for k in 0..4 {
                    for l in 0..32 {
                        let lo = b[64 * h + l + 32 * (k & 1)] >> (4 * (k >> 1)) & 15;
                        u.q[128 * h + 32 * k + l] = lo | (b[128 + 32 * h + l] >> (2 * k) & 3) << 4;
                    }
                }
            }
            for (c, sc) in u.sc.iter_mut().enumerate() {
                *sc = u16::from(b[192 + 2 * c]) | u16::from(b[193 + 2 * c]) << 8;
            }
        }
        F32 | F16 | BF16 => unreachable!("plain types are not unpacked"),
    }
    u
}

/// The `sup` word of k-quant block `b`.
fn sup_word(ty: GgmlType, b: &[u8]) -> u32 {
    if ty == GgmlType::Q6K {
        u32::from(u16_at(b, 208))
    } else {
        u32::from(u16_at(b, 0)) | u32::from(u16_at(b, 2)) << 16
    }
}

/// The chunk's 32 quants into its `lo` bytes and `hi` bytes (`4·bits` of them).
fn pack_chunk(q: &[u8], bits: usize, lo: &mut [u8], hi: &mut [u8]) {
    for i in 0..16 {
        lo[i] = q[i] & 15 | (q[i + 16] & 15) << 4;
    }
    if bits == 0 {
        return;
    }
    hi.fill(0);
    for j in 0..4 {
        let (word, s) = (j * bits / 4, 2 * bits * j % 8);
        for b in 0..4 {
            let byte = &mut hi[4 * word + b];
            *byte |= (q[4 * j + b] >> 4) << s | (q[16 + 4 * j + b] >> 4) << (s + bits);
        }
    }
}

/// `data`, whole rows of `n_in` elements of `ty` as stored in the file, in the packed layout
/// (plain float types: `data` itself, borrowed).
pub fn pack(ty: GgmlType, data: &[u8], n_in: usize) -> Result<Cow<'_, [u8]>> {
    let bad = || {
        Error::Invalid(format!(
            "pack {}: {} bytes are not whole rows of {n_in}",
            ty.name(),
            data.len()
        ))
    };
    let row_bytes = ty.row_bytes(n_in).filter(|&b| b > 0).ok_or_else(bad)?;
    if !data.len().is_multiple_of(row_bytes) {
        return Err(bad());
    }
    let rows = data.len() / row_bytes;
    let Some(p) = packing(ty) else {
        return Ok(Cow::Borrowed(data));
    };
    let l = layout(ty, rows, n_in).ok_or_else(bad)?;
    let mut out = vec![0u8; l.bytes];
    let (lo, rest) = out.split_at_mut(l.hi);
    let (hi, rest) = rest.split_at_mut(l.sc - l.hi);
    let (sc, sup) = rest.split_at_mut(l.sup - l.sc);
    let (elems, bytes) = (ty.block_elems(), ty.block_bytes());
    let per = elems / CHUNK;
    let hb = 4 * p.bits;
    // Without high bits, a stand-in section so that every block gets its (empty) share.
    let mut no_hi = vec![0u8; if hb == 0 { data.len() / bytes * per } else { 0 }];
    let hi = if hb == 0 { &mut no_hi[..] } else { hi };
    // Blocks in parallel: each writes its own chunks' bytes.
    data.par_chunks(bytes)
        .zip(lo.par_chunks_mut(16 * per))
        .zip(hi.par_chunks_mut(hb.max(1) * per))
        .zip(sc.par_chunks_mut(2 * per))
        .for_each(|(((b, lo), hi), sc)| {
            let u = unpack_block(ty, b);
            for c in 0..per {
                let hi = &mut hi[hb * c..hb * (c + 1)];
                pack_chunk(&u.q[CHUNK * c..], p.bits, &mut lo[16 * c..16 * (c + 1)], hi);
                sc[2 * c..2 * c + 2].copy_from_slice(&u.sc[c].to_le_bytes());
            }
        });
    if p.sup {
        for (b, w) in data.chunks(bytes).zip(sup.chunks_mut(4)) {
            w.copy_from_slice(&sup_word(ty, b).to_le_bytes());
        }
    }
    Ok(Cow::Owned(out))
}

/// The f32 weights of a packed matrix, decoded from the packed bytes alone: the CPU twin of the
/// kernels' decoding, for tests (`dequantize_packed(pack(x)) == quant::dequantize(x)`).
pub fn dequantize_packed(ty: GgmlType, packed: &[u8], rows: usize, n_in: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * n_in];
    let Some(p) = packing(ty) else {
        crate::quant::dequantize(ty, packed, &mut out).expect("plain sizes");
        return out;
    };
    let l = layout(ty, rows, n_in).expect("whole blocks");
    let hb = 4 * p.bits;
    for (c, y) in out.chunks_mut(CHUNK).enumerate() {
        let lo = &packed[16 * c..16 * c + 16];
        let hi = &packed[l.hi + hb * c..l.hi + hb * (c + 1)];
        let sc = u16_at(packed, l.sc + 2 * c);
        let sup = if p.sup {
            u32::from_le_bytes(packed[l.sup + 4 * (c / 8)..][..4].try_into().unwrap())
        } else {
            0
        };
        let (s0, s1, m) = scales(ty, sc, sup);
        for (i, y) in y.iter_mut().enumerate() {
            let (j, b, upper) = (i % 16 / 4, i % 4, i >= 16);
            let mut q = u32::from(lo[i % 16] >> (4 * upper as usize) & 15);
            if p.bits > 0 {
                let (word, s) = (j * p.bits / 4, 2 * p.bits * j % 8 + p.bits * upper as usize);
                q |= u32::from(hi[4 * word + b] >> s & ((1 << p.bits) - 1) as u8) << 4;
            }
            let s = if upper { s1 } else { s0 };
            // The CPU's operations, in its order: `(q - zero)·d`, `scale·q - min`, `scale·(q - 32)`.
            *y = match ty {
                GgmlType::Q4K | GgmlType::Q5K => s * q as f32 - m,
                GgmlType::Q6K => s * (q as i32 - p.zero as i32) as f32,
                _ => (q as i32 - p.zero as i32) as f32 * s,
            };
        }
    }
    out
}

/// A chunk's (scale of elements 0..16, scale of 16..32, min) from its `sc` and `sup` words.
fn scales(ty: GgmlType, sc: u16, sup: u32) -> (f32, f32, f32) {
    let half = |bits: u32| f16::from_bits(bits as u16).to_f32();
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => {
            let s = half(sup) * f32::from(sc as u8);
            (s, s, half(sup >> 16) * f32::from((sc >> 8) as u8))
        }
        GgmlType::Q6K => {
            let d = half(sup);
            (
                d * f32::from(sc as u8 as i8),
                d * f32::from((sc >> 8) as u8 as i8),
                0.0,
            )
        }
        _ => (half(sc.into()), half(sc.into()), 0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_to_vec;

    /// Random bytes with every f16 field finite (scales, mins).
    fn random_blocks(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u8
        };
        let mut data: Vec<u8> = (0..n * ty.block_bytes()).map(|_| next()).collect();
        let f16_fields: &[usize] = match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[],
        };
        for b in data.chunks_mut(ty.block_bytes()) {
            for &at in f16_fields {
                // Exponent below 31: finite.
                b[at + 1] &= 0xbb;
            }
        }
        data
    }

    #[test]
    fn packed_weights_dequantize_bit_identically() {
        for ty in GgmlType::ALL {
            let n_in = 2 * ty.block_elems().max(CHUNK) * 3;
            let rows = 5;
            let data = random_blocks(ty, rows * n_in / ty.block_elems(), ty as u64 + 1);
            let want = dequantize_to_vec(ty, &data).unwrap();
            let packed = pack(ty, &data, n_in).unwrap();
            assert_eq!(
                packed.len(),
                layout(ty, rows, n_in).unwrap().bytes,
                "{}",
                ty.name()
            );
            let got = dequantize_packed(ty, &packed, rows, n_in);
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{}: packed weights differ from the file's", ty.name());
        }
    }

    /// The packed q8_0 `hi` section holds each quant's high nibble where the greedy arg-max's
    /// first pass reads it (gpu-kernels' `quant::Packed::bound`): byte `k` of word `j` of a
    /// chunk, low nibble for element `4j + k`, high for `16 + 4j + k`.
    #[test]
    fn q8_0_high_nibbles_lie_where_the_bounds_read_them() {
        let (rows, n_in) = (3, 64);
        let data = random_blocks(GgmlType::Q8_0, rows * n_in / 32, 9);
        let packed = pack(GgmlType::Q8_0, &data, n_in).unwrap();
        let hi = &packed[layout(GgmlType::Q8_0, rows, n_in).unwrap().hi..];
        for (c, b) in data.chunks(34).enumerate() {
            for i in 0..32 {
                let (j, k, upper) = (i % 16 / 4, i % 4, i / 16);
                let nibble = hi[16 * c + 4 * j + k] >> (4 * upper) & 15;
                assert_eq!(nibble, (b[2 + i] ^ 0x80) >> 4, "chunk {c} element {i}");
            }
        }
    }

    #[test]
    fn sections_are_aligned_and_sized() {
        let l = layout(GgmlType::Q6K, 3, 256).unwrap();
        // 24 chunks: lo 384, hi 8 each, sc 2 each (48 -> 48), sup 3 words (12 -> 16).
        assert_eq!(
            l,
            Layout {
                hi: 384,
                sc: 384 + 192,
                sup: 384 + 192 + 48,
                bytes: 384 + 192 + 48 + 16
            }
        );
        let l = layout(GgmlType::Q5_0, 1, 32).unwrap();
        assert_eq!(
            l,
            Layout {
                hi: 16,
                sc: 32,
                sup: 48,
                bytes: 48
            }
        );
        assert_eq!(layout(GgmlType::Q4_0, 1, 33), None);
    }

    #[test]
    fn bad_sizes_are_errors() {
        let e = pack(GgmlType::Q8_0, &[0; 35], 32).unwrap_err().to_string();
        assert_eq!(e, "pack q8_0: 35 bytes are not whole rows of 32");
        assert!(pack(GgmlType::Q8_0, &[0; 34], 33).is_err());
    }
}
