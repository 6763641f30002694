//! The whole model on the GPU: teacher-forced against Hugging Face's reference, greedy against
//! the CPU reference, and the haiku anti-cheat test. Skipped without a CUDA device.
use std::sync::{Mutex, MutexGuard, OnceLock};

use orcd::cpu::model::CpuModel;
use orcd::cuda::Device;
use orcd::cuda::model::CudaModel;
use orcd::gguf::Gguf;
use orcd::sampling::SamplingParams;
use orcd_tests::{model_path, ref_prompts};

/// Top-2 margin below which GPU and CPU may legitimately pick different tokens.
const NEAR_TIE: f32 = 0.1;

fn gguf() -> &'static Gguf {
    static G: OnceLock<Gguf> = OnceLock::new();
    G.get_or_init(|| Gguf::open(&model_path()).unwrap())
}

fn gpu_model() -> Option<MutexGuard<'static, CudaModel>> {
    static M: OnceLock<Mutex<CudaModel>> = OnceLock::new();
    if M.get().is_none() {
        let dev = orcd_tests::gpu()?;
        let _ = M.set(Mutex::new(CudaModel::load(dev, gguf(), 4096).unwrap()));
    }
    Some(M.get().unwrap().lock().unwrap())
}

fn cpu_model() -> MutexGuard<'static, CpuModel> {
    static M: OnceLock<Mutex<CpuModel>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(CpuModel::load(gguf(), 4096).unwrap()))
        .lock()
        .unwrap()
}

/// Top-1 minus top-2 of a row of logits.
fn margin(row: &[f32]) -> f32 {
    let top = orcd::cpu::argmax(row) as usize;
    let second = row
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != top)
        .map(|(_, v)| *v)
        .fold(f32::NEG_INFINITY, f32::max);
    row[top] - second
}

#[test]
fn teacher_forced_logits_match_reference() {
    let Some(mut m) = gpu_model() else { return };
    let vocab = m.cfg.vocab;
    let (mut agree, mut total, mut worst) = (0, 0, 0.0f32);
    for p in ref_prompts() {
        m.reset();
        let seq: Vec<u32> = p.ids.iter().chain(&p.generated).copied().collect();
        let logits = m.forward(&seq, true).unwrap();
        for i in 0..p.generated.len() {
            let row = &logits[(p.ids.len() - 1 + i) * vocab..][..vocab];
            let (top1, want) = (orcd::cpu::argmax(row), p.top5_ids[i][0]);
            total += 1;
            if top1 == want {
                agree += 1;
            } else {
                println!(
                    "{:?} pos {i}: top-1 {top1} vs reference {want} (reference margin {:.4})",
                    p.text,
                    p.margin(i)
                );
                assert!(
                    p.margin(i) < NEAR_TIE,
                    "{:?} pos {i}: top-1 {top1} != {want}, margin {}",
                    p.text,
                    p.margin(i)
                );
            }
            worst = worst.max((row[want as usize] - p.top5_vals[i][0]).abs());
        }
    }
    println!(
        "GPU top-1 agreement {agree}/{total}; max |logit - reference| of the reference top-1: {worst:.4}"
    );
    assert!(
        agree * 100 >= total * 99,
        "top-1 agreement {agree}/{total} < 99%"
    );
}

/// Greedy tokens of the CPU reference, with its top-2 margin at each step.
fn cpu_greedy(prompt: &[u32], n: usize) -> Vec<(u32, f32)> {
    let mut m = cpu_model();
    m.reset();
    let mut logits = m.forward(prompt, false).unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let t = orcd::cpu::argmax(&logits);
        out.push((t, margin(&logits)));
        logits = m.forward(&[t], false).unwrap();
    }
    out
}

/// Greedy tokens of the GPU, sampled on the GPU.
fn gpu_greedy(m: &mut CudaModel, prompt: &[u32], n: usize, eos: &[u32]) -> Vec<u32> {
    m.reset();
    let greedy = SamplingParams::greedy();
    let mut out = vec![m.next_token(prompt, &greedy, 0).unwrap()];
    while out.len() < n && !eos.contains(out.last().unwrap()) {
        let t = m
            .next_token(&out[out.len() - 1..], &greedy, out.len() as u64)
            .unwrap();
        out.push(t);
    }
    out
}

/// Asserts that GPU tokens equal CPU tokens up to the first CPU near tie; returns how many
/// tokens were compared.
fn assert_same_up_to_near_tie(what: &str, gpu: &[u32], cpu: &[(u32, f32)]) -> usize {
    for (i, (&g, &(c, m))) in gpu.iter().zip(cpu).enumerate() {
        if m < NEAR_TIE {
            println!("{what}: CPU near tie at token {i} (margin {m:.4}); compared {i} tokens");
            return i;
        }
        assert_eq!(
            g, c,
            "{what}: token {i}: GPU {g} vs CPU {c} (CPU margin {m})"
        );
    }
    gpu.len().min(cpu.len())
}

#[test]
fn greedy_matches_cpu() {
    let Some(mut m) = gpu_model() else { return };
    for p in ref_prompts() {
        let gpu = gpu_greedy(&mut m, &p.ids, 32, &[]);
        let cpu = cpu_greedy(&p.ids, 32);
        let n = assert_same_up_to_near_tie(&p.text, &gpu, &cpu);
        println!("{:?}: GPU greedy == CPU greedy for {n} tokens", p.text);
    }
}

/// English words for 0..=59, hyphenated as "forty-one".
fn number_word(n: u32) -> String {
    const ONES: [&str; 20] = [
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
    ];
    const TENS: [&str; 6] = ["", "", "twenty", "thirty", "forty", "fifty"];
    match n {
        0..20 => ONES[n as usize].into(),
        _ if n.is_multiple_of(10) => TENS[(n / 10) as usize].into(),
        _ => format!("{}-{}", TENS[(n / 10) as usize], ONES[(n % 10) as usize]),
    }
}

#[test]
fn number_words() {
    assert_eq!(number_word(41), "forty-one");
    assert_eq!(number_word(17), "seventeen");
    assert_eq!(number_word(30), "thirty");
    assert_eq!(number_word(0), "zero");
}

/// The predecessor's failure was one token repeated forever. The word is the current minute,
/// so the output cannot be cached or hard-coded.
#[test]
fn haiku_anti_cheat() {
    let Some(mut m) = gpu_model() else { return };
    let minute = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / 60
        % 60) as u32;
    let word = number_word(minute);
    let prompt = format!("Write a haiku about GPU computing. It must contain the word '{word}'.");
    let tok = orcd::tokenizer::Tokenizer::from_gguf(gguf()).unwrap();
    let ids = tok
        .chat_prompt(&[orcd::chat::Message::new("user", &prompt)])
        .unwrap();
    let gpu = gpu_greedy(&mut m, &ids, 64, tok.eos_ids());
    let stop = if tok.eos_ids().contains(gpu.last().unwrap()) {
        "eos"
    } else {
        "max_tokens"
    };
    let text_ids: Vec<u32> = gpu
        .iter()
        .copied()
        .filter(|t| !tok.eos_ids().contains(t))
        .collect();
    let text = tok.decode(&text_ids).unwrap();
    println!(
        "prompt: {prompt}\n--- haiku ---\n{text}\n--- stop: {stop}; '{word}' occurs exactly once: {}",
        text.to_lowercase().matches(&word).count() == 1
    );

    let longest_run = gpu.chunk_by(|a, b| a == b).map(<[u32]>::len).max().unwrap();
    assert!(
        longest_run <= 3,
        "a token repeats {longest_run} times in a row: {gpu:?}"
    );
    let distinct = gpu.iter().collect::<std::collections::HashSet<_>>().len();
    assert!(
        distinct * 10 >= gpu.len() * 6,
        "only {distinct} distinct tokens of {}",
        gpu.len()
    );
    let cpu = cpu_greedy(&ids, gpu.len());
    let n = assert_same_up_to_near_tie("haiku", &gpu, &cpu);
    println!("GPU tokens == CPU tokens for {n} of {} tokens", gpu.len());
}

#[test]
fn reports_missing_or_present_device() {
    // Device::open either works or says plainly why not; never panics.
    match Device::open(0) {
        Ok(dev) => println!("device: {}", dev.name().unwrap()),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg == "no CUDA driver found (libcuda.so could not be loaded)"
                    || msg == "no CUDA device",
                "{msg}"
            );
        }
    }
}
