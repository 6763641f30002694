//! rms_norm, argmax and the f16 GEMV against their CPU twins.
use half::f16;
use orcd::cpu;
use orcd::quant::GgmlType;
use orcd_tests::{Rng, gpu};

/// Model sizes (hidden, FFN, vocab) and odd ones that break any power-of-two assumption.
const SIZES: [usize; 7] = [896, 4864, 151936, 1, 33, 1000, 4097];

#[test]
fn rms_norm_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(1);
    for n in SIZES {
        for rows in [1, 3] {
            let x: Vec<f32> = rng.vec(rows * n).iter().map(|v| v * 4.0).collect();
            let w = rng.vec(n);
            let mut want = vec![0.0; rows * n];
            cpu::rms_norm(&mut want, &x, &w, 1e-6);
            let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
            let mut out = dev.zeros::<f32>(rows * n).unwrap();
            dev.rms_norm(&mut out, &xd, &wd, 1e-6).unwrap();
            let got = dev.download(&out).unwrap();
            // Only the order of the sum of n squares differs; its rounding grows with n
            // (measured 1.0e-5 at n = 151936).
            let err = max_rel_err(&got, &want, 1e-6);
            println!("rms_norm n={n} rows={rows}: max rel err {err:.2e}");
            assert!(err < 3e-5, "rms_norm n={n} rows={rows}: max rel err {err}");
        }
    }
}

#[test]
fn argmax_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(2);
    let mut out = dev.zeros::<u32>(1).unwrap();
    let mut check = |x: &[f32], what: &str| {
        let want = cpu::argmax(x);
        dev.argmax(&mut out, &dev.upload(x).unwrap()).unwrap();
        let got = dev.download(&out).unwrap()[0];
        assert_eq!(got, want, "argmax {what} n={}", x.len());
    };
    for n in SIZES {
        let mut x = rng.vec(n);
        check(&x, "random");
        // A tie between a late and an early index: the first must win.
        let (early, late) = (n / 3, n - 1);
        x[early] = 2.0;
        x[late] = 2.0;
        check(&x, "tie");
        assert_eq!(cpu::argmax(&x), early as u32);
    }
    check(&vec![f32::NEG_INFINITY; 151936], "all -inf");
    let mut x = vec![f32::NAN; 1000];
    x[999] = -5.0;
    check(&x, "NaN never wins");
    assert_eq!(cpu::argmax(&x), 999);
}

#[test]
fn gemv_f16_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(3);
    let shapes = [
        (896, 896),
        (4864, 896),
        (896, 4864),
        (151936, 896),
        (7, 33),
        (1, 1),
        (33, 1023),
        (5, 4097),
    ];
    for (rows, cols) in shapes {
        let w: Vec<f16> = rng
            .vec(rows * cols)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        let x = rng.vec(cols);
        let mut want = vec![0.0; rows];
        cpu::gemv_f16(&mut want, &w, &x);
        let mut y = dev.zeros::<f32>(rows).unwrap();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let wd = dev.upload_matrix(GgmlType::F16, &bytes, cols).unwrap();
        dev.matmul(&mut y, &dev.upload(&x).unwrap(), &wd, None, 1)
            .unwrap();
        let got = dev.download(&y).unwrap();
        // Both sum the same f32 products in a different order: the error is bounded by
        // ~cols * eps * sum|w*x|; scale by the row's sum of absolute products.
        let mut worst = 0.0f64;
        for r in 0..rows {
            let mag: f32 = (0..cols)
                .map(|c| (w[r * cols + c].to_f32() * x[c]).abs())
                .sum();
            let err = ((got[r] - want[r]).abs() / mag.max(1e-30)) as f64;
            worst = worst.max(err);
        }
        println!("gemv_f16 {rows}x{cols}: max err / sum|w*x| = {worst:.2e}");
        assert!(worst < 1e-5, "gemv_f16 {rows}x{cols}: {worst}");
    }
}

/// Largest |a-b| / max(|b|, floor) over two slices.
fn max_rel_err(a: &[f32], b: &[f32], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs() / b.abs().max(floor))
        .fold(0.0, f32::max)
}
