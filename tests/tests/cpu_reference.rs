//! The CPU reference forward pass against Hugging Face transformers (fp32) on the real model.
use std::sync::{Mutex, OnceLock};

use orcd::cpu::model::CpuModel;
use orcd::gguf::Gguf;
use orcd_tests::{model_path, ref_prompts};

/// One model for all tests of this file: loading dequantizes ~2 GB.
fn model() -> &'static Mutex<CpuModel> {
    static M: OnceLock<Mutex<CpuModel>> = OnceLock::new();
    M.get_or_init(|| {
        let g = Gguf::open(&model_path()).unwrap();
        Mutex::new(CpuModel::load(&g, 4096).unwrap())
    })
}

#[test]
fn teacher_forced_logits_match_reference() {
    let mut m = model().lock().unwrap();
    let vocab = m.cfg.vocab;
    let (mut agree, mut total) = (0, 0);
    for p in ref_prompts() {
        m.reset();
        let seq: Vec<u32> = p.ids.iter().chain(&p.generated).copied().collect();
        let logits = m.forward(&seq, true).unwrap();
        let mut worst = 0.0f32;
        for i in 0..p.generated.len() {
            // Position i of the generation is predicted by the logits after token ids.len()-1+i.
            let row = &logits[(p.ids.len() - 1 + i) * vocab..][..vocab];
            let top1 = orcd::cpu::argmax(row);
            let (want, want_logit) = (p.top5_ids[i][0], p.top5_vals[i][0]);
            total += 1;
            if top1 == want {
                agree += 1;
            } else {
                assert!(
                    p.margin(i) < 0.05,
                    "{:?} pos {i}: top-1 {top1} != reference {want} with margin {}",
                    p.text,
                    p.margin(i)
                );
            }
            let diff = (row[want as usize] - want_logit).abs();
            worst = worst.max(diff);
            assert!(
                diff <= 0.1,
                "{:?} pos {i}: logit of {want} is {} vs reference {want_logit}",
                p.text,
                row[want as usize]
            );
        }
        println!("{:?}: max |logit - reference| {worst:.4}", p.text);
    }
    println!("top-1 agreement {agree}/{total}");
    assert!(
        agree * 100 >= total * 99,
        "top-1 agreement {agree}/{total} < 99%"
    );
}

#[test]
fn greedy_generation_matches_reference() {
    let mut m = model().lock().unwrap();
    for p in ref_prompts() {
        m.reset();
        // Greedy for up to 24 tokens. Where the reference's top-2 margin is < 0.05 (a near tie
        // that summation order may flip) either of its top two is accepted and the reference's
        // token is fed on, so the comparison goes on past the tie.
        let n = p.generated.len().min(24);
        let mut logits = m.forward(&p.ids, false).unwrap();
        for i in 0..n {
            let t = orcd::cpu::argmax(&logits);
            if p.margin(i) < 0.05 {
                assert!(
                    p.top5_ids[i][..2].contains(&t),
                    "{:?} pos {i}: {t} not in the near tie",
                    p.text
                );
            } else {
                assert_eq!(t, p.generated[i], "{:?} pos {i}", p.text);
            }
            logits = m.forward(&[p.generated[i]], false).unwrap();
        }
        println!("{:?}: {n} greedy tokens compared", p.text);
    }
}
