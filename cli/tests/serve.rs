//! `orcd serve` as a client meets it: the real binary on a free port, the real model on the
//! CPU (small context, a few tokens per request), spoken to over HTTP.
//!
//! Most tests share one server (started once, with an API key) and take turns on it, so that
//! each can read the engine's KV use without the others' requests in it. The drain tests
//! start servers of their own, since those exit.
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::channel;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const KEY: &str = "test-key";
const MODEL: &str = "test-model";
const CTX: usize = 256;

/// The CLI that cargo built with this test or, in a GPU bundle, the bundle's `bin/orcd`.
fn orcd() -> Command {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_orcd"));
    if built.exists() {
        return Command::new(built);
    }
    let exe = std::env::current_exe().unwrap();
    Command::new(exe.parent().unwrap().join("../bin/orcd"))
}

fn model() -> String {
    orcd_tests::model_path().to_str().unwrap().to_string()
}

/// A running server and what it said before it was ready.
struct Server {
    child: Mutex<Child>,
    base: String,
    key: Option<&'static str>,
    /// Status, body and Retry-After of a request sent while the model loaded.
    while_loading: (u16, Value, Option<String>),
}

/// Starts `orcd serve` on a free port with `extra` options and waits until it listens.
fn start(extra: &[&str], key: Option<&'static str>) -> Server {
    let mut args: Vec<String> = [
        "serve",
        "--device",
        "cpu",
        "--port",
        "0",
        "--served-model-name",
        MODEL,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--model".into(), model(), "--ctx".into(), CTX.to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    if let Some(key) = key {
        args.extend(["--api-key".into(), key.into()]);
    }
    // The child is spawned by a thread that lives as long as this process, and told to get
    // SIGTERM when that thread ends: a server shared by the tests ends with them.
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let mut cmd = orcd();
        cmd.args(&args).stdout(Stdio::null()).stderr(Stdio::piped());
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        tx.send(cmd.spawn().expect("starting orcd serve")).unwrap();
        loop {
            std::thread::park();
        }
    });
    let mut child: Child = rx.recv().unwrap();
    let (lines_tx, lines) = channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[server] {line}");
            // Read on after the test stops listening: a full pipe would block the server.
            let _ = lines_tx.send(line);
        }
    });
    let next_line = |what: &str| {
        lines
            .recv_timeout(Duration::from_secs(180))
            .unwrap_or_else(|_| panic!("the server ended or hung before {what}"))
    };
    // "note: loading …; http://127.0.0.1:PORT answers 503 until it is ready"
    let note = next_line("binding");
    let base = note
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {note:?}"))
        .to_string();
    let r = send(&base, key, "GET", "/v1/models", None);
    let while_loading = (r.status, r.json(), r.retry_after);
    loop {
        let line = next_line("listening");
        if line.starts_with("listening on ") {
            assert_eq!(line, format!("listening on {base}"));
            break;
        }
    }
    Server {
        child: Mutex::new(child),
        base,
        key,
        while_loading,
    }
}

/// The server most tests share, and the turn to use it.
fn shared() -> (&'static Server, MutexGuard<'static, ()>) {
    static SERVER: OnceLock<Server> = OnceLock::new();
    static TURN: Mutex<()> = Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let server = SERVER.get_or_init(|| {
        start(
            &[
                "--kv-tokens",
                "4096",
                "--max-running",
                "8",
                "--max-queue",
                "64",
            ],
            Some(KEY),
        )
    });
    (server, turn)
}

/// An HTTP answer.
struct Reply {
    status: u16,
    body: String,
    retry_after: Option<String>,
    content_type: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

fn agent(timeout: Option<Duration>) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(timeout.or(Some(Duration::from_secs(300))))
        .build()
        .into()
}

/// Sends `body` (raw bytes) with `method` to `path`; `key`: the bearer token, if any.
fn send(base: &str, key: Option<&str>, method: &str, path: &str, body: Option<&[u8]>) -> Reply {
    let url = format!("{base}{path}");
    let mut builder = ureq::http::Request::builder().method(method).uri(&url);
    if let Some(key) = key {
        builder = builder.header("Authorization", format!("Bearer {key}"));
    }
    let agent = agent(None);
    let result = match body {
        Some(b) => agent.run(builder.body(b.to_vec()).unwrap()),
        None => agent.run(builder.body(()).unwrap()),
    };
    let mut resp = result.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (retry_after, content_type) = (header("retry-after"), header("content-type"));
    Reply {
        status: resp.status().as_u16(),
        retry_after,
        content_type: content_type.unwrap_or_default(),
        body: resp.body_mut().read_to_string().unwrap_or_default(),
    }
}

impl Server {
    fn post(&self, path: &str, body: &Value) -> Reply {
        send(
            &self.base,
            self.key,
            "POST",
            path,
            Some(body.to_string().as_bytes()),
        )
    }

    fn get(&self, path: &str) -> Reply {
        send(&self.base, self.key, "GET", path, None)
    }

    /// Opens a streamed request; its server-sent events come line by line.
    fn stream(&self, path: &str, body: &Value) -> Events {
        let mut req = agent(None).post(format!("{}{path}", self.base));
        if let Some(key) = self.key {
            req = req.header("Authorization", &format!("Bearer {key}"));
        }
        let resp = req.send_json(body).unwrap();
        assert_eq!(resp.status(), 200, "{path} {body}");
        let ct = resp
            .headers()
            .get("content-type")
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        Events(BufReader::new(Box::new(resp.into_body().into_reader())))
    }

    fn health(&self) -> Value {
        let r = send(&self.base, None, "GET", "/health", None);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    }

    /// A metric's value (the first sample line of that name and labels).
    fn metric(&self, sample: &str) -> f64 {
        let text = self.get("/metrics").body;
        text.lines()
            .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {sample} in\n{text}"))
            .parse()
            .unwrap()
    }

    /// Waits (up to 30 s) until the engine runs nothing and holds no KV block.
    fn wait_idle(&self) -> Value {
        let t0 = Instant::now();
        loop {
            let h = self.health();
            if h["kv_blocks_used"] == 0 && h["requests_running"] == 0 && h["requests_waiting"] == 0
            {
                return h;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "never idle: {h}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A server-sent event stream.
struct Events(BufReader<Box<dyn Read + Send>>);

impl Events {
    /// The next event as (name, data); `None` at the end of the stream.
    fn next(&mut self) -> Option<(String, String)> {
        let (mut name, mut data) = (String::new(), String::new());
        loop {
            let mut line = String::new();
            if self.0.read_line(&mut line).ok()? == 0 {
                return None;
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if !data.is_empty() {
                    return Some((name, data));
                }
                continue;
            }
            if let Some(v) = line.strip_prefix("event:") {
                name = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data = v.trim_start().to_string();
            }
        }
    }

    /// Every OpenAI chunk up to `[DONE]` (which must come, and come last).
    fn chunks(mut self) -> Vec<Value> {
        let mut chunks = Vec::new();
        while let Some((_, data)) = self.next() {
            if data == "[DONE]" {
                assert!(self.next().is_none(), "events after [DONE]");
                return chunks;
            }
            chunks.push(serde_json::from_str(&data).unwrap());
        }
        panic!("the stream ended without [DONE] after {chunks:?}");
    }
}

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

fn with(mut body: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

// ---- Start-up and the OpenAI API ----

#[test]
fn answers_503_while_loading_then_lists_the_model() {
    let (s, _turn) = shared();
    let (status, body, retry) = &s.while_loading;
    assert_eq!(*status, 503, "{body}");
    assert_eq!(body["error"]["message"], "the model is loading", "{body}");
    assert!(retry.is_some());
    let r = s.get("/v1/models");
    assert_eq!(r.status, 200);
    let m = r.json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["data"][0]["object"], "model");
    assert_eq!(m["data"][0]["max_model_len"], CTX);

    // Retrieve: the same card by its id; any other id is OpenAI's 404 (slashes too, as in
    // `org/name` ids); the key is needed as everywhere.
    let r = s.get(&format!("/v1/models/{MODEL}"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), m["data"][0]);
    for id in ["other-model", "org/test-model", "test%2Dmodel%FF"] {
        let r = s.get(&format!("/v1/models/{id}"));
        assert_eq!(r.status, 404, "{id}: {}", r.body);
        let e = &r.json()["error"];
        assert!(e["message"].is_string(), "{id}: {e}");
    }
    let e = s.get("/v1/models/other-model").json()["error"].clone();
    assert_eq!(e["type"], "invalid_request_error", "{e}");
    assert_eq!(e["param"], "model", "{e}");
    assert_eq!(e["code"], "model_not_found", "{e}");
    let r = send(&s.base, None, "GET", &format!("/v1/models/{MODEL}"), None);
    assert_eq!(r.status, 401, "{}", r.body);
}

/// The same greedy answer as `orcd run` for the same prompt and length, whole and streamed.
#[test]
fn greedy_chat_equals_run() {
    let prompt = "Name three colors.";
    let n = 8;
    let out = orcd()
        .args([
            "run",
            "--quiet",
            "--json",
            "--device",
            "cpu",
            "--model",
            &model(),
        ])
        .args([
            "--ctx",
            &CTX.to_string(),
            "--temperature",
            "0",
            "--repeat-penalty",
            "1",
        ])
        .args(["--max-tokens", &n.to_string(), "--prompt", prompt])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: Value = serde_json::from_slice(&out.stdout).unwrap();
    let expected = run["text"].as_str().unwrap();
    let generated = run["tokens"].as_array().unwrap().len();

    let (s, _turn) = shared();
    let r = s.post("/v1/chat/completions", &chat(prompt, n));
    assert_eq!(r.status, 200, "{}", r.body);
    let c = r.json();
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["model"], MODEL);
    assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert!(c["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    assert_eq!(c["choices"][0]["message"]["content"], expected);
    let finish = if generated == n { "length" } else { "stop" };
    assert_eq!(c["choices"][0]["finish_reason"], finish);
    let usage = &c["usage"];
    assert_eq!(
        usage["prompt_tokens"],
        run["prompt_tokens"].as_array().unwrap().len()
    );
    assert_eq!(usage["completion_tokens"], generated);
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap() + generated as u64)
    );

    let body = with(
        chat(prompt, n),
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let chunks = s.stream("/v1/chat/completions", &body).chunks();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, expected);
    let last = &chunks[chunks.len() - 1];
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], generated);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        finish
    );
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"])
    );
    s.wait_idle();
}

#[test]
fn completions_whole_streamed_and_with_logprobs() {
    let (s, _turn) = shared();
    let body = json!({"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 5,
                      "temperature": 0, "logprobs": 2});
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let c = r.json();
    assert_eq!(c["object"], "text_completion");
    let choice = &c["choices"][0];
    let text = choice["text"].as_str().unwrap();
    let lp = &choice["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(
        tokens.len(),
        c["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    assert_eq!(tokens.concat(), text);
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        // The two most likely, and the chosen token (one of them, greedy).
        assert_eq!(top.len(), 2, "{top:?}");
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (best - chosen).abs() < 1e-6,
            "greedy picks the best: {top:?} {chosen}"
        );
    }

    // Streamed, the same text; a prompt of token ids gives the same answer as its text.
    let streamed = with(body.clone(), json!({"stream": true, "logprobs": null}));
    let chunks = s.stream("/v1/completions", &streamed).chunks();
    let text2: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text2, text);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        choice["finish_reason"]
    );
    let out = orcd()
        .args([
            "tokenize",
            "--model",
            &model(),
            "--text",
            "def fibonacci(n):",
        ])
        .output()
        .unwrap();
    let prompt_ids: Value = serde_json::from_slice(&out.stdout).unwrap();
    let r = s.post(
        "/v1/completions",
        &with(
            body.clone(),
            json!({"prompt": prompt_ids, "logprobs": null}),
        ),
    );
    assert_eq!(r.json()["choices"][0]["text"], text);

    // Chat logprobs: the chosen token and its top alternatives, with bytes.
    let body = with(chat("Hi", 2), json!({"logprobs": true, "top_logprobs": 3}));
    let c = s.post("/v1/chat/completions", &body).json();
    let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 2, "{c}");
    for e in content {
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            e["token"].as_str().unwrap()
        );
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 3);
        assert_eq!(e["top_logprobs"][0]["token"], e["token"]);
    }
    s.wait_idle();
}

/// Stop strings end the answer and are not part of it.
#[test]
fn stop_strings_are_not_emitted() {
    let (s, _turn) = shared();
    let body = json!({"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0});
    let full = s.post("/v1/completions", &body).json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let stop = full
        .trim_start()
        .split(',')
        .next()
        .unwrap()
        .trim()
        .to_string();
    assert!(!stop.is_empty(), "{full:?}");
    let c = s
        .post(
            "/v1/completions",
            &with(body, json!({"stop": [stop.clone()]})),
        )
        .json();
    let text = c["choices"][0]["text"].as_str().unwrap();
    assert_eq!(c["choices"][0]["finish_reason"], "stop", "{c}");
    assert!(
        !text.contains(&stop) && full.starts_with(text),
        "{text:?} vs {full:?}"
    );
}

// ---- The worker API ----

#[test]
fn execute_streams_started_tokens_metrics_end() {
    let (s, _turn) = shared();
    let prompt = "The capital of France is";
    let mut events = s.stream(
        "/execute",
        &json!({"job_id": "job-a", "prompt": prompt, "max_tokens": 4, "temperature": 0}),
    );
    let mut names = Vec::new();
    let mut text = String::new();
    let mut end = Value::Null;
    while let Some((name, data)) = events.next() {
        let data: Value = serde_json::from_str(&data).unwrap();
        match name.as_str() {
            "started" => {
                assert_eq!(data["job_id"], "job-a");
                assert_eq!(data["model"], MODEL);
                assert!(data["started_at"].as_str().unwrap().ends_with('Z'));
                // No seed asked for: the one the worker picked.
                assert!(data["seed"].is_u64(), "{data}");
            }
            "token" => {
                let i = names.iter().filter(|n| *n == "token").count();
                assert_eq!(data["i"], i, "{data}");
                text += data["t"].as_str().unwrap();
            }
            "metrics" => assert_eq!(data["tokens_out"], 4),
            "end" => end = data,
            other => panic!("unexpected event {other}: {data}"),
        }
        names.push(name);
    }
    assert_eq!(names.first().map(String::as_str), Some("started"));
    assert_eq!(&names[names.len() - 2..], ["metrics", "end"], "{names:?}");
    assert_eq!(end["tokens_out"], 4);
    // The raw prompt, greedy: as /v1/completions answers it.
    let c = s.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(c.json()["choices"][0]["text"], text);
    // A seed asked for is the one reported.
    let mut events = s.stream(
        "/execute",
        &json!({"job_id": "job-s", "prompt": prompt, "max_tokens": 1, "seed": 42}),
    );
    let (name, data) = events.next().unwrap();
    assert_eq!(name, "started");
    assert_eq!(serde_json::from_str::<Value>(&data).unwrap()["seed"], 42);
    while events.next().is_some() {}

    let h = s.wait_idle();
    for field in [
        "status",
        "model",
        "resident",
        "quant_kind",
        "vram_bytes_used",
        "tokenizer_kind",
        "vocab_size",
        "context_length",
        "uptime_seconds",
    ] {
        assert!(h.get(field).is_some(), "{field} missing from {h}");
    }
    assert_eq!(h["status"], "healthy");
    assert_eq!(h["quant_kind"], "Q4_K_M");
    assert_eq!(h["tokenizer_kind"], "gguf-bpe");
    assert_eq!(h["context_length"], CTX);
    // No GPU memory on the CPU.
    assert_eq!(h["vram_bytes_used"], 0);
}

/// `/cancel` ends a job with `CANCELLED`, a client that disconnects ends its request, and both
/// give their KV blocks back.
#[test]
fn cancel_and_disconnect_free_the_kv_blocks() {
    let (s, _turn) = shared();
    s.wait_idle();
    let cancelled = s.metric("orcd_requests_total{outcome=\"cancelled\"}");
    // Greedy: a sampled job could end at an end-of-sequence token before the checks below.
    let long = |job: &str| json!({"job_id": job, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0});
    let mut events = s.stream("/execute", &long("job-c"));
    assert_eq!(events.next().unwrap().0, "started");
    assert_eq!(events.next().unwrap().0, "token");
    assert!(s.health()["kv_blocks_used"].as_u64().unwrap() > 0);
    // Idempotent: twice, and for a job that never was.
    for job in ["job-c", "job-c", "no-such-job"] {
        assert_eq!(s.post("/cancel", &json!({"job_id": job})).status, 202);
    }
    let last = std::iter::from_fn(|| events.next()).last().unwrap();
    assert_eq!(last.0, "error");
    let err: Value = serde_json::from_str(&last.1).unwrap();
    assert_eq!(err["code"], "CANCELLED", "{err}");
    s.wait_idle();

    // A streamed client that goes away after its first token.
    let mut events = s.stream(
        "/v1/chat/completions",
        &with(
            chat("Tell a long story.", 200),
            json!({"stream": true, "ignore_eos": true}),
        ),
    );
    let first = [events.next().unwrap(), events.next().unwrap()];
    let h = s.health();
    assert!(
        h["kv_blocks_used"].as_u64().unwrap() > 0,
        "{h} after {first:?}"
    );
    drop(events);
    s.wait_idle();

    // A client of a whole answer that gives up.
    let generated = s.metric("orcd_generation_tokens_total");
    let mut req = agent(Some(Duration::from_secs(2))).post(format!("{}/v1/completions", s.base));
    req = req.header("Authorization", &format!("Bearer {KEY}"));
    let r =
        req.send_json(json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}));
    assert!(r.is_err(), "200 tokens in 2 s on the CPU?");
    s.wait_idle();
    let after = s.metric("orcd_generation_tokens_total");
    assert!(after - generated < 200.0, "{generated} -> {after}");
    assert_eq!(
        s.metric("orcd_requests_total{outcome=\"cancelled\"}"),
        cancelled + 3.0
    );
}

#[test]
fn eight_concurrent_clients_all_complete() {
    let (s, _turn) = shared();
    let clients: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let body = json!({"prompt": format!("Count from {i}:"), "max_tokens": 3,
                                  "temperature": 0.7, "ignore_eos": true, "stream": i % 2 == 0});
                let r = s.post("/v1/completions", &body);
                assert_eq!(r.status, 200, "{}", r.body);
                if i % 2 == 0 {
                    assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
                } else {
                    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
                }
            })
        })
        .collect();
    let failed = clients
        .into_iter()
        .map(|c| c.join())
        .filter(Result::is_err)
        .count();
    assert_eq!(failed, 0);
    s.wait_idle();
}

#[test]
fn metrics_are_prometheus_text() {
    let (s, _turn) = shared();
    let before = s.metric("orcd_generation_tokens_total");
    s.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
    );
    let r = s.get("/metrics");
    assert_eq!(r.status, 200);
    assert_eq!(r.content_type, "text/plain; version=0.0.4");
    for name in [
        "# TYPE orcd_requests_running gauge",
        "# TYPE orcd_requests_waiting gauge",
        "# TYPE orcd_prompt_tokens_total counter",
        "# TYPE orcd_generation_tokens_total counter",
        "# TYPE orcd_time_to_first_token_seconds histogram",
        "# TYPE orcd_inter_token_latency_seconds histogram",
        "# TYPE orcd_e2e_request_latency_seconds histogram",
        "# TYPE orcd_kv_blocks_used gauge",
        "# TYPE orcd_requests_total counter",
        "orcd_time_to_first_token_seconds_bucket{le=\"+Inf\"}",
        "orcd_e2e_request_latency_seconds_count",
        "orcd_requests_total{outcome=\"length\"}",
    ] {
        assert!(r.body.contains(name), "{name} missing:\n{}", r.body);
    }
    assert_eq!(s.metric("orcd_generation_tokens_total"), before + 2.0);
    assert_eq!(
        s.metric("orcd_kv_blocks_total"),
        4096.0 / s.metric("orcd_kv_block_tokens")
    );
}

// ---- Hostile requests ----

#[test]
fn malformed_and_hostile_requests_get_4xx_with_an_error_body() {
    let (s, _turn) = shared();
    let long_prompt = "hello ".repeat(CTX * 2);
    let hi = chat("hi", 2);
    let c = |extra: Value| with(hi.clone(), extra).to_string().into_bytes();
    let p = |extra: Value| {
        with(json!({"prompt": "hi", "max_tokens": 2}), extra)
            .to_string()
            .into_bytes()
    };
    let raw = |s: &str| s.as_bytes().to_vec();
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(10 << 20)).into_bytes();
    let chat_path = "/v1/chat/completions";
    let comp = "/v1/completions";
    // (method, path, key, body, status, the error's param where it names one)
    type Case = (
        &'static str,
        &'static str,
        Option<&'static str>,
        Vec<u8>,
        u16,
        Option<&'static str>,
    );
    let cases: Vec<Case> = vec![
        ("POST", chat_path, Some(KEY), raw("{bad json"), 400, None),
        ("POST", chat_path, Some(KEY), raw("[1, 2]"), 400, None),
        ("POST", chat_path, Some(KEY), raw(""), 400, None),
        (
            "POST",
            chat_path,
            Some(KEY),
            vec![0xff, 0xfe, 0x00],
            400,
            None,
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            raw("{}"),
            400,
            Some("messages"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"messages": []})),
            400,
            Some("messages"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"messages": "hi"})),
            400,
            Some("messages"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"messages": [{"role": "wizard", "content": "x"}]})),
            400,
            Some("messages[0].role"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"messages": [{"role": "user", "content": 7}]})),
            400,
            Some("messages[0].content"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            ),
            400,
            Some("messages[0].content[0].type"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"temperature": -1})),
            400,
            Some("temperature"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"temperature": "hot"})),
            400,
            Some("temperature"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"top_p": 2})),
            400,
            Some("top_p"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"max_tokens": 1_000_000_000})),
            400,
            Some("max_tokens"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"max_tokens": -5})),
            400,
            Some("max_tokens"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"max_tokens": 2.5})),
            400,
            Some("max_tokens"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"n": 2})),
            400,
            Some("n"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})),
            400,
            Some("tools"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"response_format": {"type": "json_object"}})),
            400,
            Some("response_format"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"logprobs": true, "top_logprobs": 21})),
            400,
            Some("top_logprobs"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"frequency_penalty": 5})),
            400,
            Some("frequency_penalty"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"seed": "abc"})),
            400,
            Some("seed"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"stop": ["a", "b", "c", "d", "e"]})),
            400,
            Some("stop"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"stream_options": "yes"})),
            400,
            Some("stream_options"),
        ),
        (
            "POST",
            chat_path,
            Some(KEY),
            c(json!({"model": "gpt-4o"})),
            404,
            Some("model"),
        ),
        (
            "POST",
            comp,
            Some(KEY),
            p(json!({"prompt": long_prompt})),
            400,
            Some("prompt"),
        ),
        (
            "POST",
            comp,
            Some(KEY),
            raw("{\"max_tokens\": 2}"),
            400,
            Some("prompt"),
        ),
        (
            "POST",
            comp,
            Some(KEY),
            p(json!({"prompt": [1, -1]})),
            400,
            Some("prompt"),
        ),
        (
            "POST",
            comp,
            Some(KEY),
            p(json!({"prompt": [99_999_999]})),
            400,
            Some("prompt"),
        ),
        (
            "POST",
            comp,
            Some(KEY),
            p(json!({"logprobs": 6})),
            400,
            Some("logprobs"),
        ),
        (
            "POST",
            comp,
            Some(KEY),
            p(json!({"echo": true})),
            400,
            Some("echo"),
        ),
        ("POST", comp, Some(KEY), big, 413, None),
        ("POST", comp, None, p(json!({})), 401, None),
        ("POST", comp, Some("wrong-key"), p(json!({})), 401, None),
        ("GET", "/metrics", None, vec![], 401, None),
        ("GET", "/v1/nothing-here", Some(KEY), vec![], 404, None),
        ("GET", comp, Some(KEY), vec![], 405, None),
        (
            "POST",
            "/execute",
            Some(KEY),
            raw("{\"job_id\": \"\", \"prompt\": \"x\"}"),
            400,
            None,
        ),
        (
            "POST",
            "/execute",
            Some(KEY),
            raw("{\"job_id\": \"j\", \"prompt\": \"x\", \"temperature\": 3}"),
            400,
            None,
        ),
        (
            "POST",
            "/execute",
            Some(KEY),
            raw("{\"job_id\": \"j\", \"prompt\": \"x\", \"max_tokens\": 5000}"),
            400,
            None,
        ),
        (
            "POST",
            "/execute",
            Some(KEY),
            raw("{\"job_id\": 5, \"prompt\": \"x\"}"),
            400,
            None,
        ),
        ("POST", "/cancel", Some(KEY), raw("{}"), 400, None),
    ];
    assert!(cases.len() >= 25);
    let mut failures = Vec::new();
    for (method, path, key, body, status, param) in cases {
        let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
        let r = send(
            &s.base,
            key,
            method,
            path,
            (method == "POST").then_some(&body[..]),
        );
        let ok = match serde_json::from_str::<Value>(&r.body) {
            // The worker API's body.
            Ok(b) if path == "/execute" || path == "/cancel" => {
                b["code"] == "INVALID_REQUEST"
                    && b["message"].as_str().is_some_and(|m| !m.is_empty())
            }
            Ok(b) => {
                let e = &b["error"];
                e["message"].as_str().is_some_and(|m| !m.is_empty())
                    && e["type"].is_string()
                    && param.is_none_or(|p| e["param"] == p)
            }
            Err(_) => false,
        };
        if r.status != status || !ok {
            failures.push(format!("{method} {path} {shown}: {} {}", r.status, r.body));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Still serving, and /health needs no key.
    let r = s.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 1}));
    assert_eq!(r.status, 200, "{}", r.body);
    s.wait_idle();
}

/// The prompt over the context names both numbers.
#[test]
fn a_prompt_over_the_context_says_both_lengths() {
    let (s, _turn) = shared();
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": "hello ".repeat(300), "max_tokens": 1}),
    );
    assert_eq!(r.status, 400);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    let n: usize = msg
        .strip_prefix("the prompt has ")
        .and_then(|m| m.strip_suffix(&format!(" tokens but the context holds {CTX}")))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{msg}"));
    assert!(n > CTX, "{msg}");
}

// ---- Queue, timeout and drain: servers of their own ----

/// A full queue is 503 with Retry-After; /shutdown refuses new requests, lets running ones
/// finish and exits 0.
#[test]
fn full_queue_then_shutdown_drains() {
    let s = start(
        &[
            "--max-running",
            "1",
            "--max-queue",
            "1",
            "--kv-tokens",
            "1024",
        ],
        None,
    );
    let job = |id: &str, n: usize| json!({"job_id": id, "prompt": "Once upon a time", "max_tokens": n, "temperature": 0});
    let mut first = s.stream("/execute", &job("first", 12));
    assert_eq!(first.next().unwrap().0, "started");
    assert_eq!(first.next().unwrap().0, "token");
    let mut second = s.stream("/execute", &job("second", 2));
    assert_eq!(second.next().unwrap().0, "started");
    let full = s.post("/execute", &job("third", 2));
    assert_eq!(full.status, 503, "{}", full.body);
    assert_eq!(full.json()["code"], "QUEUE_FULL");
    assert!(full.retry_after.is_some());
    let full = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    assert_eq!(full.status, 503, "{}", full.body);
    assert!(full.retry_after.is_some() && full.json()["error"]["message"].is_string());
    assert_eq!(s.metric("orcd_requests_total{outcome=\"rejected\"}"), 2.0);

    assert_eq!(s.post("/shutdown", &json!({})).status, 202);
    let r = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(s.health()["draining"] == true);
    for events in [&mut first, &mut second] {
        let last = std::iter::from_fn(|| events.next()).last().unwrap();
        assert_eq!(last.0, "end", "{last:?}");
    }
    let status = s.child.lock().unwrap().wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

/// The per-request timeout ends a request with `INFERENCE_TIMEOUT` (worker) or 504 (OpenAI);
/// SIGTERM drains, and a drain past its timeout cancels what still runs.
#[test]
fn timeout_and_sigterm_with_a_short_drain() {
    let s = start(
        &[
            "--request-timeout",
            "3",
            "--drain-timeout",
            "1",
            "--kv-tokens",
            "1024",
        ],
        None,
    );
    let long = |id: &str| json!({"job_id": id, "prompt": "Once upon a time", "max_tokens": 500});
    let mut events = s.stream("/execute", &long("slow"));
    let last = std::iter::from_fn(|| events.next()).last().unwrap();
    assert_eq!(last.0, "error");
    assert_eq!(
        serde_json::from_str::<Value>(&last.1).unwrap()["code"],
        "INFERENCE_TIMEOUT"
    );
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 250}),
    );
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(s.metric("orcd_requests_total{outcome=\"timeout\"}"), 2.0);
    s.wait_idle();

    let mut events = s.stream("/execute", &long("drained"));
    events.next().unwrap();
    events.next().unwrap();
    let pid = s.child.lock().unwrap().id() as i32;
    // SAFETY: signals our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let last = std::iter::from_fn(|| events.next()).last().unwrap();
    assert_eq!(last.0, "error");
    assert_eq!(
        serde_json::from_str::<Value>(&last.1).unwrap()["code"],
        "CANCELLED"
    );
    let status = s.child.lock().unwrap().wait().unwrap();
    assert_eq!(status.code(), Some(0));
}
