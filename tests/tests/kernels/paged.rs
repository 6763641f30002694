//! The paged family against its CPU twins: rope_kv_paged (RoPE per row, the cache store in
//! f16), paged_attention over block tables mixing decode rows and prefill chunks, short and
//! thousands of keys long (against `cpu::attention` over each sequence gathered from its
//! blocks; a row's bits the same in any batch), gather_rows and kv_copy_paged.
use half::f16;
use orcd::cpu;
use orcd::cuda::Device;
use orcd::cuda::paged::{AttentionItem, KvCopy, SPLIT_KEYS};
use orcd_tests::{Rng, gpu};

const THETA: f32 = 1e6;

/// Uniform in [-scale, scale).
fn rand(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    rng.vec(n).into_iter().map(|v| v * scale).collect()
}

fn to_f16(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| f16::from_f32(v).to_bits()).collect()
}

fn from_f16(x: &[u16]) -> Vec<f32> {
    x.iter().map(|&v| f16::from_bits(v).to_f32()).collect()
}

/// max |got - want| / (1 + |want|).
fn max_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(
            0.0,
            |a: f32, e| if e.is_nan() { f32::NAN } else { a.max(e) },
        )
}

#[test]
fn rope_kv_paged_matches_cpu_rows() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(41);
    for (n_heads, n_kv, hd) in [(14, 2, 64), (12, 2, 128), (40, 8, 128)] {
        let (q_dim, kv_dim, rows, slots) = (n_heads * hd, n_kv * hd, 5, 64);
        let positions = [0u32, 7, 4000, 3, 1];
        let slot_of = [9u32, 0, 63, 17, 40];
        let (q, k, v) = (
            rand(&mut rng, rows * q_dim, 3.5),
            rand(&mut rng, rows * kv_dim, 3.5),
            rand(&mut rng, rows * kv_dim, 3.5),
        );
        let table = dev.rope_table(4096, hd, THETA).unwrap();
        let mut qd = dev.upload(&q).unwrap();
        let mut kv = dev.paged_kv(slots, kv_dim).unwrap();
        dev.rope_kv_paged(
            &mut qd,
            &dev.upload(&k).unwrap(),
            &dev.upload(&v).unwrap(),
            &mut kv,
            &dev.upload(&positions).unwrap(),
            &dev.upload(&slot_of).unwrap(),
            &table,
            rows,
            n_heads,
            n_kv,
            hd,
        )
        .unwrap();
        let (got_q, got_k, got_v) = (
            dev.download(&qd).unwrap(),
            dev.download(&kv.k).unwrap(),
            dev.download(&kv.v).unwrap(),
        );
        for r in 0..rows {
            let p = positions[r] as usize;
            let mut want_q = q[r * q_dim..][..q_dim].to_vec();
            cpu::rope_neox(&mut want_q, q_dim, p, hd, THETA);
            let mut want_k = k[r * kv_dim..][..kv_dim].to_vec();
            cpu::rope_neox(&mut want_k, kv_dim, p, hd, THETA);
            let s = slot_of[r] as usize * kv_dim;
            // Same table, same products (no FMA contraction, as rope_neox's test checks), then
            // the store's f16 rounding to nearest even on both sides.
            assert!(
                max_err(&got_q[r * q_dim..][..q_dim], &want_q) <= 1e-6,
                "q row {r}"
            );
            assert_eq!(&got_k[s..s + kv_dim], &to_f16(&want_k)[..], "k row {r}");
            assert_eq!(
                &got_v[s..s + kv_dim],
                &to_f16(&v[r * kv_dim..][..kv_dim])[..],
                "v {r}"
            );
        }
        // Rows no write touched stay zero.
        assert!(got_k[kv_dim..9 * kv_dim].iter().all(|&b| b == 0));
    }
}

/// A sequence of a batched step: its keys so far (this step's included), its block table, and
/// the rows it runs this step (the last `rows` positions).
struct Seq {
    len: usize,
    rows: usize,
    blocks: Vec<u32>,
}

/// The attention inputs of a batched step: sequences whose blocks are scattered over a pool of
/// random keys and values, and the query rows of all of them, sequence by sequence.
struct Step {
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    bt: usize,
    seqs: Vec<Seq>,
    k_pool: Vec<u16>,
    v_pool: Vec<u16>,
    q: Vec<f32>,
}

impl Step {
    /// A step of sequences `(keys, rows)` with random contents.
    fn new(
        rng: &mut Rng,
        (n_heads, n_kv, hd, bt): (usize, usize, usize, usize),
        shapes: &[(usize, usize)],
    ) -> Step {
        let n_blocks: usize = shapes
            .iter()
            .map(|&(len, _)| len.div_ceil(bt))
            .sum::<usize>()
            + 3;
        // Blocks handed out in a scrambled order, so tables are not contiguous.
        let mut free: Vec<u32> = (0..n_blocks as u32).collect();
        for i in (1..free.len()).rev() {
            let j = (rng.next_f32().abs() * (i + 1) as f32) as usize % (i + 1);
            free.swap(i, j);
        }
        let seqs: Vec<Seq> = shapes
            .iter()
            .map(|&(len, rows)| Seq {
                len,
                rows,
                blocks: (0..len.div_ceil(bt)).map(|_| free.pop().unwrap()).collect(),
            })
            .collect();
        let (slots, kv_dim) = (n_blocks * bt, n_kv * hd);
        let rows: usize = seqs.iter().map(|s| s.rows).sum();
        Step {
            k_pool: to_f16(&rand(rng, slots * kv_dim, 2.0)),
            v_pool: to_f16(&rand(rng, slots * kv_dim, 2.0)),
            q: rand(rng, rows * n_heads * hd, 1.5),
            n_heads,
            n_kv,
            hd,
            bt,
            seqs,
        }
    }

    /// The first row of sequence `i` in `q`.
    fn first_row(&self, i: usize) -> usize {
        self.seqs[..i].iter().map(|s| s.rows).sum()
    }

    /// The items and block tables of all the sequences, each sequence's rows cut into items
    /// from its first row.
    fn items(&self) -> (Vec<AttentionItem>, Vec<u32>) {
        let (mut items, mut tables) = (vec![], vec![]);
        for (i, s) in self.seqs.iter().enumerate() {
            items.extend(AttentionItem::split(
                self.first_row(i),
                s.rows,
                s.len - s.rows,
                tables.len(),
            ));
            tables.extend(&s.blocks);
        }
        (items, tables)
    }

    /// `cpu::attention` of every sequence's rows over its keys gathered from its blocks.
    fn want(&self) -> Vec<f32> {
        let (q_dim, kv_dim, bt) = (self.n_heads * self.hd, self.n_kv * self.hd, self.bt);
        let mut want = vec![];
        for (i, s) in self.seqs.iter().enumerate() {
            let first = s.len - s.rows;
            let gather = |pool: &[u16]| -> Vec<f32> {
                (0..s.len)
                    .flat_map(|j| {
                        let slot = s.blocks[j / bt] as usize * bt + j % bt;
                        from_f16(&pool[slot * kv_dim..][..kv_dim])
                    })
                    .collect()
            };
            let mut out = vec![0.0; s.rows * q_dim];
            let (kc, vc) = (gather(&self.k_pool), gather(&self.v_pool));
            let qs = &self.q[self.first_row(i) * q_dim..][..s.rows * q_dim];
            cpu::attention(
                &mut out,
                qs,
                &kc,
                &vc,
                first,
                self.n_heads,
                self.n_kv,
                self.hd,
            );
            want.extend(out);
        }
        want
    }
}

/// `paged_attention` of the query rows `q` of `step`'s pool over `items` and `tables`.
fn run(dev: &Device, step: &Step, q: &[f32], items: &[AttentionItem], tables: &[u32]) -> Vec<f32> {
    let kv = orcd::cuda::paged::PagedKv {
        k: dev.upload(&step.k_pool).unwrap(),
        v: dev.upload(&step.v_pool).unwrap(),
    };
    let rows = q.len() / (step.n_heads * step.hd);
    let mut scratch = dev
        .paged_scratch(rows, items.len(), step.n_heads, step.n_kv, step.hd)
        .unwrap();
    let mut out = dev.zeros::<f32>(q.len()).unwrap();
    let flat = AttentionItem::flatten(items);
    dev.paged_attention(
        &mut out,
        &dev.upload(q).unwrap(),
        &kv,
        &dev.upload(&flat).unwrap(),
        items.len(),
        &dev.upload(tables).unwrap(),
        &mut scratch,
        step.n_heads,
        step.n_kv,
        step.hd,
        step.bt,
    )
    .unwrap();
    dev.download(&out).unwrap()
}

/// `step`'s rows on the GPU against the CPU, within `tol`.
fn check_against_cpu(dev: &Device, step: &Step, what: &str, tol: f32) {
    let (items, tables) = step.items();
    let got = run(dev, step, &step.q, &items, &tables);
    let err = max_err(&got, &step.want());
    let (n_heads, n_kv, hd, bt) = (step.n_heads, step.n_kv, step.hd, step.bt);
    println!("paged_attention {what} heads {n_heads}/{n_kv} hd {hd} block {bt}: err {err:.2e}");
    assert!(err <= tol, "{what} heads {n_heads}/{n_kv} hd {hd}: {err}");
}

#[test]
fn paged_attention_matches_cpu_over_gathered_sequences() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(42);
    for dims in [(14, 2, 64, 16), (12, 2, 128, 32), (16, 2, 128, 16)] {
        // Decode rows at short and long contexts, a prefill chunk from 0, a chunk after an
        // earlier one, a chunk of one row, and a chunk longer than an item.
        let shapes = [
            (1, 1),
            (300, 1),
            (37, 37),
            (100, 60),
            (5, 1),
            (1000, 1),
            (20, 20),
        ];
        let step = Step::new(&mut rng, dims, &shapes);
        // As the contiguous kernels' tolerance (attention.rs's TOL): the order of the dot
        // products and softmax sums, and ex2.approx.
        check_against_cpu(&dev, &step, "mixed", 2e-5);
    }
}

/// Long sequences, whose keys take every split several tiles each (and some splits one more
/// than others), and many rows: decode rows of thousands of keys, prefill chunks deep into a
/// sequence, and a hundred short and long decode rows side by side.
#[test]
fn paged_attention_matches_cpu_over_long_sequences_and_many_rows() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(44);
    let split_keys = SPLIT_KEYS;
    for dims in [(14, 2, 64, 16), (16, 4, 128, 32)] {
        let mut shapes = vec![
            (4 * split_keys + 17, 1),
            (split_keys, 1),
            (split_keys + 1, 1),
            (3000, 24),
            (6000, 3),
            (33, 1),
        ];
        for i in 0..100 {
            let len = 1 + (rng.next_f32().abs() * 2500.0) as usize;
            shapes.push((len.max(1), 1 + (i % 7 == 0) as usize));
        }
        let step = Step::new(&mut rng, dims, &shapes);
        check_against_cpu(&dev, &step, "long", 2e-5);
    }
}

/// A row's result has the same bits whoever shares its launch: alone, beside other sequences,
/// and with its prefill chunk cut into items at another row.
#[test]
fn paged_attention_rows_do_not_depend_on_the_batch() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(45);
    let dims = (14, 2, 64, 16);
    let shapes = [(2000, 1), (40, 1), (1500, 13), (700, 1), (9, 9)];
    let step = Step::new(&mut rng, dims, &shapes);
    let (items, tables) = step.items();
    let all = run(&dev, &step, &step.q, &items, &tables);
    let q_dim = step.n_heads * step.hd;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, s) in step.seqs.iter().enumerate() {
        let (row, first) = (step.first_row(i), s.len - s.rows);
        let q = &step.q[row * q_dim..][..s.rows * q_dim];
        let want = &all[row * q_dim..][..s.rows * q_dim];
        let alone = AttentionItem::split(0, s.rows, first, 0);
        assert_eq!(
            bits(&run(&dev, &step, q, &alone, &s.blocks)),
            bits(want),
            "sequence {i} alone"
        );
        if s.rows > 3 {
            // Items from the chunk's third row on: every row in another item, beside others.
            let mut cut = AttentionItem::split(0, 3, first, 0);
            cut.extend(AttentionItem::split(3, s.rows - 3, first + 3, 0));
            assert_eq!(
                bits(&run(&dev, &step, q, &cut, &s.blocks)),
                bits(want),
                "sequence {i} cut"
            );
        }
    }
}

#[test]
fn gather_rows_copies_the_rows_asked_for() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(43);
    let (n, rows) = (896, 6);
    let mut x = rand(&mut rng, rows * n, 10.0);
    x[4 * n + 5] = f32::NAN;
    let pick = [5u32, 3, 0, 4, 3];
    let mut g = dev.zeros::<f32>(pick.len() * n).unwrap();
    dev.gather_rows(
        &mut g,
        &dev.upload(&x).unwrap(),
        &dev.upload(&pick).unwrap(),
        pick.len(),
        n,
    )
    .unwrap();
    let gathered = dev.download(&g).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, &r) in pick.iter().enumerate() {
        assert_eq!(
            bits(&gathered[i * n..][..n]),
            bits(&x[r as usize * n..][..n]),
            "row {r}"
        );
    }
}

/// kv_copy_paged: contiguous rows rounded into a sequence's scattered blocks, bit for bit as
/// `f16::from_f32`, and back widened exactly; the rest of both caches untouched.
#[test]
fn kv_copy_paged_round_trips_through_a_block_table() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(44);
    let (kv_dim, bt, blocks, len) = (256, 16, 12, 150);
    // The sequence's 10 blocks, out of order in a pool of 12.
    let table = [7u32, 2, 11, 0, 5, 9, 1, 10, 3, 8];
    let (k, v) = (
        rand(&mut rng, len * kv_dim, 30.0),
        rand(&mut rng, len * kv_dim, 30.0),
    );
    let (mut kd, mut vd) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    let mut kv = dev.paged_kv(blocks * bt, kv_dim).unwrap();
    let td = dev.upload(&table).unwrap();
    // Positions 40..150 into the blocks, then all 150 back into zeroed contiguous caches.
    let (first, n) = (40, len - 40);
    dev.kv_copy_paged(
        KvCopy::ToPaged,
        &mut kd,
        &mut vd,
        &mut kv,
        &td,
        first,
        n,
        kv_dim,
        bt,
    )
    .unwrap();
    let (kp, vp) = (dev.download(&kv.k).unwrap(), dev.download(&kv.v).unwrap());
    for (cache, src) in [(&kp, &k), (&vp, &v)] {
        for p in 0..len {
            let slot = table[p / bt] as usize * bt + p % bt;
            let row = &cache[slot * kv_dim..][..kv_dim];
            let want = match p >= first {
                true => to_f16(&src[p * kv_dim..][..kv_dim]),
                false => vec![0; kv_dim],
            };
            assert_eq!(row, &want[..], "position {p}");
        }
    }
    let (mut k2, mut v2) = (
        dev.zeros(len * kv_dim).unwrap(),
        dev.zeros(len * kv_dim).unwrap(),
    );
    dev.kv_copy_paged(
        KvCopy::FromPaged,
        &mut k2,
        &mut v2,
        &mut kv,
        &td,
        0,
        len,
        kv_dim,
        bt,
    )
    .unwrap();
    for (got, cache) in [
        (dev.download(&k2).unwrap(), &kp),
        (dev.download(&v2).unwrap(), &vp),
    ] {
        for p in 0..len {
            let slot = table[p / bt] as usize * bt + p % bt;
            let want = from_f16(&cache[slot * kv_dim..][..kv_dim]);
            assert_eq!(&got[p * kv_dim..][..kv_dim], &want[..], "position {p}");
        }
    }
}
