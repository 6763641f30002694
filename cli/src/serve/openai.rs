//! The OpenAI API: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` and
//! `GET /v1/models/{id}`, with OpenAI's request and response shapes and vLLM's sampling
//! extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`).
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use orcd::batch::{BatchEngine, Request, Sampling, TokenLogprob, Usage};
use orcd::chat::Message;
use orcd::sampling::SamplingParams;
use orcd::tokenizer::Tokenizer;
use serde_json::{Value, json};

use super::error::ApiError;
use super::generation::{Failure, Generation, Refused, Step, fresh_seed};
use super::params::{FieldError, Fields, kind};
use super::{Server, read_body, shutting_down};

/// Which endpoint a request came to: they differ in prompt, logprobs and response shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
}

/// What to generate from.
#[derive(Debug, PartialEq)]
enum Prompt {
    Chat(Vec<Message>),
    Text(String),
    Ids(Vec<u32>),
}

/// A request, checked, before its prompt is tokenized.
#[derive(Debug)]
struct Parsed {
    prompt: Prompt,
    /// `None`: as many as the context leaves (chat) or 16 (completions, OpenAI's default).
    max_tokens: Option<usize>,
    sampling: Sampling,
    stop: Vec<String>,
    ignore_eos: bool,
    stream: bool,
    include_usage: bool,
    /// Top alternatives per token (chat: `top_logprobs`, completions: `logprobs`).
    logprobs: Option<usize>,
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> ApiError {
        let mut err = ApiError::bad_request(e.message);
        err.param = e.param;
        if e.unsupported {
            err.code = Some("unsupported_parameter");
        }
        err
    }
}

pub async fn chat(State(s): State<Arc<Server>>, body: Body) -> Response {
    respond(s, Api::Chat, body).await
}

pub async fn completions(State(s): State<Arc<Server>>, body: Body) -> Response {
    respond(s, Api::Completions, body).await
}

pub async fn models(State(s): State<Arc<Server>>) -> Result<Response, ApiError> {
    Ok(axum::Json(json!({"object": "list", "data": [model_card(&s)?]})).into_response())
}

/// `GET /v1/models/{id}`: the served model's card, 404 for any other id. The id may hold
/// slashes (`Qwen/Qwen2-7B`), hence a wildcard route.
pub async fn model(
    State(s): State<Arc<Server>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    // An id that is not UTF-8 once percent-decoded names no model either.
    let id = id
        .map_err(|e| ApiError::new(StatusCode::NOT_FOUND, e.body_text()))?
        .0;
    if id != s.model_name {
        return Err(model_not_found(&s, &id));
    }
    Ok(axum::Json(model_card(&s)?).into_response())
}

/// The served model as `/v1/models` lists it; `max_model_len` is vLLM's.
fn model_card(s: &Server) -> Result<Value, ApiError> {
    Ok(json!({
        "id": s.model_name,
        "object": "model",
        "created": unix_time(SystemTime::now() - s.started.elapsed()),
        "owned_by": "orcd",
        "max_model_len": s.ready()?.engine.ctx_len(),
    }))
}

fn model_not_found(s: &Server, model: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "the model `{model}` does not exist; this server serves `{}`",
            s.model_name
        ),
    )
    .param("model")
    .code("model_not_found")
}

async fn respond(s: Arc<Server>, api: Api, body: Body) -> Response {
    let arrived = Instant::now();
    match start(&s, api, body, arrived).await {
        Ok((reply, generation)) if reply.stream => reply.stream(generation).into_response(),
        Ok((reply, generation)) => reply.whole(generation).await.into_response(),
        Err(e) => e.into_response(),
    }
}

/// Reads, checks and submits a request.
async fn start(
    s: &Arc<Server>,
    api: Api,
    body: Body,
    arrived: Instant,
) -> Result<(Reply, Generation), ApiError> {
    let bytes = read_body(body)
        .await
        .map_err(|e| ApiError::new(e.status(), e.message()))?;
    let fields = Fields::parse(&bytes)?;
    if let Some(model) = fields.string("model")?
        && model != s.model_name
    {
        return Err(model_not_found(s, model));
    }
    let p = parse(api, &fields)?;
    if s.is_draining() {
        return Err(shutting_down());
    }
    let engine = &s.ready()?.engine;
    let prompt = prompt_ids(engine.tokenizer(), &p.prompt)?;
    let max_tokens = max_tokens(api, prompt.len(), p.max_tokens, engine.ctx_len())?;
    let req = Request {
        prompt,
        sampling: p.sampling,
        max_tokens,
        stop_ids: Vec::new(),
        stop_strings: p.stop,
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs,
    };
    let generation = Generation::start(
        engine,
        &s.registry,
        &s.metrics,
        req,
        None,
        s.request_timeout,
        arrived,
    )
    .map_err(|e| match e {
        Refused::Invalid(msg) => ApiError::bad_request(msg),
        Refused::Busy(msg) => ApiError::unavailable(msg, 1),
        Refused::DuplicateJob => ApiError::bad_request("duplicate request"),
    })?;
    let reply = Reply {
        api,
        engine: engine.clone(),
        id: format!(
            "{}-{:016x}",
            if api == Api::Chat { "chatcmpl" } else { "cmpl" },
            fresh_seed()
        ),
        created: unix_time(SystemTime::now()),
        model: s.model_name.clone(),
        stream: p.stream,
        include_usage: p.include_usage,
        logprobs: p.logprobs.is_some(),
    };
    Ok((reply, generation))
}

/// Checks every field this endpoint knows; the prompt is tokenized later, by the engine's
/// tokenizer.
fn parse(api: Api, f: &Fields) -> Result<Parsed, FieldError> {
    let empty_array = |v: &Value| v.as_array().is_some_and(|a| a.is_empty());
    let empty_object = |v: &Value| v.as_object().is_some_and(|o| o.is_empty());
    f.unsupported("n", |v| v == 1)?;
    f.unsupported("logit_bias", empty_object)?;
    let prompt = match api {
        Api::Chat => {
            f.unsupported("tools", empty_array)?;
            f.unsupported("tool_choice", |v| v == "none" || v == "auto")?;
            f.unsupported("functions", empty_array)?;
            f.unsupported("function_call", |v| v == "none" || v == "auto")?;
            f.unsupported("response_format", |v| v == &json!({"type": "text"}))?;
            f.unsupported("audio", |_| false)?;
            f.unsupported("prediction", |_| false)?;
            f.unsupported("web_search_options", |_| false)?;
            f.unsupported("modalities", |v| v == &json!(["text"]))?;
            Prompt::Chat(messages(f)?)
        }
        Api::Completions => {
            f.unsupported("best_of", |v| v == 1)?;
            f.unsupported("echo", |v| v == false)?;
            f.unsupported("suffix", |v| v == "")?;
            completion_prompt(f)?
        }
    };
    let logprobs = match api {
        Api::Chat => {
            let top = f.integer("top_logprobs", 0, 20)?;
            match (f.boolean("logprobs", false)?, top) {
                (true, top) => Some(top.unwrap_or(0) as usize),
                (false, None) => None,
                (false, Some(_)) => {
                    return Err(FieldError::new(
                        "top_logprobs",
                        "`top_logprobs` needs `logprobs: true`".into(),
                    ));
                }
            }
        }
        Api::Completions => f.integer("logprobs", 0, 5)?.map(|n| n as usize),
    };
    let max_tokens = match f.integer("max_completion_tokens", 1, u32::MAX as i128)? {
        Some(n) => Some(n),
        None => f.integer("max_tokens", 1, u32::MAX as i128)?,
    };
    let stream = f.boolean("stream", false)?;
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(FieldError::new(
                    "stream_options.include_usage",
                    format!(
                        "`stream_options.include_usage` must be true or false, not {}",
                        kind(v)
                    ),
                ));
            }
        },
        Some(v) => {
            return Err(FieldError::new(
                "stream_options",
                format!("`stream_options` must be an object, not {}", kind(v)),
            ));
        }
    };
    // As OpenAI and vLLM: stream options without a stream are a client's mistake.
    if !stream && matches!(f.get("stream_options"), Some(Value::Object(_))) {
        return Err(FieldError::new(
            "stream_options",
            "`stream_options` is only allowed with `stream: true`".into(),
        ));
    }
    Ok(Parsed {
        prompt,
        max_tokens: max_tokens.map(|n| n as usize),
        sampling: sampling(f)?,
        stop: f.stop("stop", 4)?,
        ignore_eos: f.boolean("ignore_eos", false)?,
        stream,
        include_usage,
        logprobs,
    })
}

/// OpenAI's defaults where a field is absent: temperature 1, top-p 1, no top-k, no min-p, no
/// penalties, a fresh seed.
fn sampling(f: &Fields) -> Result<Sampling, FieldError> {
    let top_k = match f.integer("top_k", -1, u32::MAX as i128)? {
        None | Some(-1) => 0,
        Some(k) => k as usize,
    };
    let seed = match f.integer("seed", i64::MIN as i128, u64::MAX as i128)? {
        // Negative seeds (OpenAI's are int64) map onto u64 one to one.
        Some(n) => n as u64,
        None => fresh_seed(),
    };
    Ok(Sampling {
        params: SamplingParams {
            temperature: f.number("temperature", 1.0, 0.0, 2.0)?,
            top_k,
            // top_p 0 keeps the single most likely token, as the smallest positive value does.
            top_p: f.number("top_p", 1.0, 0.0, 1.0)?.max(f32::MIN_POSITIVE),
            min_p: f.number("min_p", 0.0, 0.0, 1.0)?,
            repeat_penalty: f.number("repetition_penalty", 1.0, f32::MIN_POSITIVE, f32::MAX)?,
            seed,
            ..SamplingParams::default()
        },
        frequency_penalty: f.number("frequency_penalty", 0.0, -2.0, 2.0)?,
        presence_penalty: f.number("presence_penalty", 0.0, -2.0, 2.0)?,
    })
}

/// `messages`: roles system, developer (as system), user and assistant; content a string or
/// an array of text parts (joined by newlines, as vLLM does).
fn messages(f: &Fields) -> Result<Vec<Message>, FieldError> {
    let Some(list) = f.get("messages") else {
        return Err(FieldError::new("messages", "`messages` is required".into()));
    };
    let Some(list) = list.as_array().filter(|l| !l.is_empty()) else {
        return Err(FieldError::new(
            "messages",
            "`messages` must be a non-empty array of messages".into(),
        ));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = |field: &str| format!("messages[{i}].{field}");
        let Some(m) = m.as_object() else {
            return Err(FieldError::new(
                &format!("messages[{i}]"),
                format!("`messages[{i}]` must be an object, not {}", kind(m)),
            ));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some("developer") => "system",
            Some(r @ ("system" | "user" | "assistant")) => r,
            Some(r @ ("tool" | "function")) => {
                return Err(FieldError {
                    unsupported: true,
                    ..FieldError::new(&at("role"), format!("`{r}` messages are not supported"))
                });
            }
            Some(r) => {
                return Err(FieldError::new(
                    &at("role"),
                    format!(
                        "`{}` must be system, developer, user or assistant, not `{r}`",
                        at("role")
                    ),
                ));
            }
            None => {
                return Err(FieldError::new(
                    &at("role"),
                    format!("`{}` is required and must be a string", at("role")),
                ));
            }
        };
        if m.get("tool_calls").is_some_and(|t| !t.is_null()) {
            return Err(FieldError {
                unsupported: true,
                ..FieldError::new(&at("tool_calls"), "tool calls are not supported".into())
            });
        }
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => text_parts(parts, &at("content"))?,
            // An assistant turn may have no content.
            None | Some(Value::Null) if role == "assistant" => String::new(),
            Some(v) => {
                return Err(FieldError::new(
                    &at("content"),
                    format!(
                        "`{}` must be a string or an array of text parts, not {}",
                        at("content"),
                        kind(v)
                    ),
                ));
            }
            None => {
                return Err(FieldError::new(
                    &at("content"),
                    format!("`{}` is required", at("content")),
                ));
            }
        };
        out.push(Message::new(role, &content));
    }
    Ok(out)
}

fn text_parts(parts: &[Value], at: &str) -> Result<String, FieldError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{at}[{j}]");
        match part.get("type").and_then(Value::as_str) {
            Some("text") => match part.get("text") {
                Some(Value::String(t)) => texts.push(t.as_str()),
                _ => {
                    return Err(FieldError::new(
                        &format!("{at}.text"),
                        format!("`{at}.text` must be a string"),
                    ));
                }
            },
            Some(other) => {
                return Err(FieldError {
                    unsupported: true,
                    ..FieldError::new(
                        &format!("{at}.type"),
                        format!("`{other}` parts are not supported: this model reads text only"),
                    )
                });
            }
            None => {
                return Err(FieldError::new(
                    &format!("{at}.type"),
                    format!("`{at}` must be an object with a `type`"),
                ));
            }
        }
    }
    Ok(texts.join("\n"))
}

/// `prompt`: a string or token ids, or an array of one of those (one prompt per request).
fn completion_prompt(f: &Fields) -> Result<Prompt, FieldError> {
    let bad = |msg: &str| FieldError::new("prompt", msg.to_string());
    let ids = |items: &[Value]| -> Result<Vec<u32>, FieldError> {
        items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| bad("`prompt` must be a string, an array of token ids, or an array of one of those"))
            })
            .collect()
    };
    let prompt = match f.get("prompt") {
        None => return Err(bad("`prompt` is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => return Err(bad("`prompt` must not be empty")),
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(inner)] => Prompt::Ids(ids(inner)?),
            [Value::Number(_), ..] => Prompt::Ids(ids(items)?),
            many => {
                return Err(FieldError {
                    unsupported: true,
                    ..bad(&format!(
                        "`prompt` holds {} prompts; send one per request",
                        many.len()
                    ))
                });
            }
        },
        Some(v) => {
            return Err(bad(&format!(
                "`prompt` must be a string or an array of token ids, not {}",
                kind(v)
            )));
        }
    };
    if matches!(&prompt, Prompt::Text(t) if t.is_empty()) || prompt == Prompt::Ids(Vec::new()) {
        return Err(bad("`prompt` must not be empty"));
    }
    Ok(prompt)
}

fn prompt_ids(tok: &Tokenizer, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    let (ids, param) = match prompt {
        Prompt::Chat(messages) => (tok.chat_prompt(messages), "messages"),
        Prompt::Text(text) => (tok.encode(text), "prompt"),
        Prompt::Ids(ids) => {
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= tok.vocab_size()) {
                return Err(ApiError::bad_request(format!(
                    "token id {bad} is out of range (vocabulary size {})",
                    tok.vocab_size()
                ))
                .param("prompt"));
            }
            (Ok(ids.clone()), "prompt")
        }
    };
    ids.map_err(|e| ApiError::bad_request(e.to_string()).param(param))
}

/// The tokens to generate at most: as asked if prompt and answer fit the context, else 400
/// with the numbers.
fn max_tokens(
    api: Api,
    prompt: usize,
    asked: Option<usize>,
    ctx: usize,
) -> Result<usize, ApiError> {
    let param = if api == Api::Chat {
        "messages"
    } else {
        "prompt"
    };
    if prompt > ctx {
        return Err(ApiError::bad_request(format!(
            "the prompt has {prompt} tokens but the context holds {ctx}"
        ))
        .param(param)
        .code("context_length_exceeded"));
    }
    let room = ctx - prompt;
    match (asked, api) {
        (Some(n), _) if n > room => Err(ApiError::bad_request(format!(
            "max_tokens is {n} but the prompt has {prompt} tokens and the context holds {ctx}: \
             at most {room} can follow"
        ))
        .param("max_tokens")
        .code("context_length_exceeded")),
        (Some(n), _) => Ok(n),
        (None, _) if room == 0 => Err(ApiError::bad_request(format!(
            "the prompt has {prompt} tokens and fills the context ({ctx}): no room for an answer"
        ))
        .param(param)
        .code("context_length_exceeded")),
        (None, Api::Chat) => Ok(room),
        (None, Api::Completions) => Ok(room.min(16)),
    }
}

fn unix_time(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// How to answer one request: its id and the shapes its endpoint wants.
struct Reply {
    api: Api,
    engine: BatchEngine,
    id: String,
    created: u64,
    model: String,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
}

/// Logprobs gathered for one chunk or a whole answer, in the endpoint's shape.
#[derive(Default)]
struct Logprobs {
    /// Chat: `logprobs.content[]`.
    content: Vec<Value>,
    /// Completions: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`.
    tokens: Vec<Value>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl Reply {
    /// Adds one token's entry; `offset`: characters of the answer before it.
    fn add_logprob(
        &self,
        lp: &mut Logprobs,
        entry: &(TokenLogprob, Vec<TokenLogprob>),
        offset: usize,
    ) {
        let tok = self.engine.tokenizer();
        let (chosen, top) = entry;
        let bytes = |id: u32| tok.token_bytes(id).unwrap_or_default();
        let text = |id: u32| String::from_utf8_lossy(bytes(id)).into_owned();
        match self.api {
            Api::Chat => {
                let alt = |t: &TokenLogprob| json!({"token": text(t.id), "logprob": t.logprob, "bytes": bytes(t.id)});
                let mut e = alt(chosen);
                e["top_logprobs"] = top.iter().map(alt).collect();
                lp.content.push(e);
            }
            Api::Completions => {
                lp.tokens.push(text(chosen.id).into());
                lp.token_logprobs.push(chosen.logprob);
                // OpenAI's map holds the top ones and the chosen token.
                let mut map = serde_json::Map::new();
                for t in top.iter().chain([chosen]) {
                    map.insert(text(t.id), t.logprob.into());
                }
                lp.top_logprobs.push(map.into());
                lp.text_offset.push(offset);
            }
        }
    }

    fn logprobs_json(&self, lp: Logprobs) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.api {
            Api::Chat => json!({ "content": lp.content }),
            Api::Completions => json!({
                "tokens": lp.tokens,
                "token_logprobs": lp.token_logprobs,
                "top_logprobs": lp.top_logprobs,
                "text_offset": lp.text_offset,
            }),
        }
    }

    fn usage(usage: &Usage) -> Value {
        json!({
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        })
    }

    /// A failure, as the status and body a whole answer gets.
    fn failure(f: Failure) -> ApiError {
        match f {
            Failure::Timeout(_) => {
                ApiError::new(StatusCode::GATEWAY_TIMEOUT, f.message()).code("timeout")
            }
            Failure::Cancelled | Failure::ShuttingDown => shutting_down(),
            Failure::Engine(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, f.message()),
        }
    }

    /// The whole answer in one response.
    async fn whole(self, mut g: Generation) -> Result<axum::Json<Value>, ApiError> {
        let mut text = String::new();
        let mut lp = Logprobs::default();
        let (finish, usage) = loop {
            match g.next().await.map_err(Reply::failure)? {
                Step::Token {
                    text: t, logprob, ..
                } => {
                    if let Some(entry) = &logprob {
                        self.add_logprob(&mut lp, entry, text.chars().count());
                    }
                    text += &t;
                }
                Step::Done {
                    finish,
                    usage,
                    text: t,
                } => {
                    text += &t;
                    break (finish, usage);
                }
            }
        };
        let logprobs = self.logprobs_json(lp);
        let choice = match self.api {
            Api::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            Api::Completions => json!({
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        Ok(axum::Json(json!({
            "id": self.id,
            "object": if self.api == Api::Chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": Reply::usage(&usage),
        })))
    }

    /// One chunk of a stream; `choice` is `None` for the usage chunk.
    fn chunk(&self, choice: Option<Value>, usage: Option<&Usage>) -> Event {
        let mut c = json!({
            "id": self.id,
            "object": if self.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choice.map_or(vec![], |c| vec![c]),
        });
        if self.include_usage {
            c["usage"] = usage.map_or(Value::Null, Reply::usage);
        }
        Event::default().data(c.to_string())
    }

    /// A chunk's choice: new text, its logprobs, and the finish reason on the last one.
    fn choice(&self, text: &str, lp: Option<Logprobs>, finish: Option<&str>) -> Value {
        let logprobs = lp.map_or(Value::Null, |lp| self.logprobs_json(lp));
        match self.api {
            Api::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Api::Completions => {
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }

    /// The answer as server-sent events: chunks as tokens come, the finish reason, the usage
    /// if asked for, then `[DONE]`. An error after the stream began is a chunk `{"error": …}`.
    fn stream(self, g: Generation) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
        let mut first = Vec::new();
        if self.api == Api::Chat {
            let role = json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": null, "finish_reason": null});
            first.push(self.chunk(Some(role), None));
        }
        struct Streaming {
            reply: Reply,
            g: Generation,
            chars: usize,
        }
        let state = Streaming {
            reply: self,
            g,
            chars: 0,
        };
        let rest = stream::unfold(Some(state), |state| async move {
            let mut st = state?;
            let r = &st.reply;
            let done = |events: Vec<Event>| Some((events, None));
            match st.g.next().await {
                Ok(Step::Token { text, logprob, .. }) => {
                    let lp = logprob.map(|entry| {
                        let mut lp = Logprobs::default();
                        r.add_logprob(&mut lp, &entry, st.chars);
                        lp
                    });
                    st.chars += text.chars().count();
                    let events = if text.is_empty() && lp.is_none() {
                        Vec::new()
                    } else {
                        vec![r.chunk(Some(r.choice(&text, lp, None)), None)]
                    };
                    Some((events, Some(st)))
                }
                Ok(Step::Done {
                    finish,
                    usage,
                    text,
                }) => {
                    let mut events = Vec::new();
                    if r.api == Api::Chat && !text.is_empty() {
                        events.push(r.chunk(Some(r.choice(&text, None, None)), None));
                        events.push(r.chunk(Some(r.choice("", None, Some(finish))), None));
                    } else {
                        events.push(r.chunk(Some(r.choice(&text, None, Some(finish))), None));
                    }
                    if r.include_usage {
                        events.push(r.chunk(None, Some(&usage)));
                    }
                    events.push(Event::default().data("[DONE]"));
                    done(events)
                }
                Err(f) => done(vec![
                    Event::default().data(Reply::failure(f).body().to_string()),
                    Event::default().data("[DONE]"),
                ]),
            }
        });
        let events = stream::iter(first)
            .chain(rest.flat_map(stream::iter))
            .map(Ok);
        Sse::new(events).keep_alive(KeepAlive::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_json(api: Api, body: &str) -> Result<Parsed, FieldError> {
        parse(api, &Fields::parse(body.as_bytes()).unwrap())
    }

    fn error(api: Api, body: &str) -> (String, String) {
        let e = parse_json(api, body).unwrap_err();
        (e.param.unwrap_or_default(), e.message)
    }

    const HI: &str = r#""messages": [{"role": "user", "content": "hi"}]"#;

    #[test]
    fn chat_defaults_are_openai_s() {
        let p = parse_json(Api::Chat, &format!("{{{HI}}}")).unwrap();
        assert_eq!(p.prompt, Prompt::Chat(vec![Message::new("user", "hi")]));
        let s = &p.sampling.params;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p, s.repeat_penalty),
            (1.0, 1.0, 0, 0.0, 1.0)
        );
        assert_eq!(
            (p.sampling.frequency_penalty, p.sampling.presence_penalty),
            (0.0, 0.0)
        );
        assert_eq!(
            (p.max_tokens, p.stream, p.include_usage, p.logprobs),
            (None, false, false, None)
        );
        assert!(p.stop.is_empty() && !p.ignore_eos);
        // A fresh seed each time.
        let again = parse_json(Api::Chat, &format!("{{{HI}}}")).unwrap();
        assert_ne!(s.seed, again.sampling.params.seed);
    }

    #[test]
    fn every_sampling_field_is_read() {
        let body = format!(
            r#"{{{HI}, "temperature": 0, "top_p": 0.5, "top_k": 7, "min_p": 0.1,
                "repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": -1,
                "seed": -1, "stop": ["a"], "ignore_eos": true, "max_completion_tokens": 9,
                "max_tokens": 3, "stream": true, "stream_options": {{"include_usage": true}},
                "logprobs": true, "top_logprobs": 20, "user": "x", "logit_bias": {{}}, "n": 1,
                "tools": [], "response_format": {{"type": "text"}}, "unknown": [1, 2]}}"#
        );
        let p = parse_json(Api::Chat, &body).unwrap();
        let s = &p.sampling.params;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p, s.repeat_penalty),
            (0.0, 0.5, 7, 0.1, 1.2)
        );
        assert_eq!(
            (p.sampling.frequency_penalty, p.sampling.presence_penalty),
            (0.5, -1.0)
        );
        assert_eq!(s.seed, u64::MAX);
        assert_eq!(p.stop, ["a"]);
        assert_eq!(
            (p.max_tokens, p.stream, p.include_usage, p.logprobs),
            (Some(9), true, true, Some(20))
        );
        assert!(p.ignore_eos);
    }

    #[test]
    fn unsupported_features_are_named() {
        for (field, value) in [
            ("n", "2"),
            ("tools", r#"[{"type": "function"}]"#),
            ("tool_choice", r#""required""#),
            ("response_format", r#"{"type": "json_object"}"#),
            ("logit_bias", r#"{"1": 5}"#),
            ("audio", "{}"),
        ] {
            let (param, msg) = error(Api::Chat, &format!("{{{HI}, \"{field}\": {value}}}"));
            assert_eq!(param, field, "{msg}");
        }
        for (field, value) in [("best_of", "2"), ("echo", "true"), ("suffix", r#""x""#)] {
            let (param, _) = error(
                Api::Completions,
                &format!("{{\"prompt\": \"a\", \"{field}\": {value}}}"),
            );
            assert_eq!(param, field);
        }
    }

    #[test]
    fn bad_values_name_their_field() {
        for (body, param) in [
            (r#""temperature": -0.5"#, "temperature"),
            (r#""temperature": "hot""#, "temperature"),
            (r#""top_p": 1.5"#, "top_p"),
            (r#""top_k": -2"#, "top_k"),
            (r#""max_tokens": 0"#, "max_tokens"),
            (r#""max_tokens": 1.5"#, "max_tokens"),
            (r#""top_logprobs": 21, "logprobs": true"#, "top_logprobs"),
            (r#""top_logprobs": 2"#, "top_logprobs"),
            (r#""stream": "yes""#, "stream"),
            (r#""stream_options": 1"#, "stream_options"),
            (
                r#""stream_options": {"include_usage": true}"#,
                "stream_options",
            ),
            (r#""presence_penalty": 3"#, "presence_penalty"),
            (r#""repetition_penalty": 0"#, "repetition_penalty"),
            (r#""stop": [1]"#, "stop"),
            (r#""seed": 1e30"#, "seed"),
        ] {
            let (p, msg) = error(Api::Chat, &format!("{{{HI}, {body}}}"));
            assert_eq!(p, param, "{body}: {msg}");
        }
    }

    #[test]
    fn messages_take_text_in_strings_or_parts() {
        let p = parse_json(
            Api::Chat,
            r#"{"messages": [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}]}"#,
        )
        .unwrap();
        assert_eq!(
            p.prompt,
            Prompt::Chat(vec![
                Message::new("system", "be brief"),
                Message::new("user", "a\nb"),
                Message::new("assistant", ""),
            ])
        );
        for (messages, param) in [
            (r#"[]"#, "messages"),
            (r#""hi""#, "messages"),
            (r#"[1]"#, "messages[0]"),
            (r#"[{"content": "x"}]"#, "messages[0].role"),
            (r#"[{"role": "robot", "content": "x"}]"#, "messages[0].role"),
            (r#"[{"role": "tool", "content": "x"}]"#, "messages[0].role"),
            (r#"[{"role": "user"}]"#, "messages[0].content"),
            (r#"[{"role": "user", "content": 5}]"#, "messages[0].content"),
            (
                r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]"#,
                "messages[0].content[0].type",
            ),
        ] {
            let (p, msg) = error(Api::Chat, &format!("{{\"messages\": {messages}}}"));
            assert_eq!(p, param, "{messages}: {msg}");
        }
        let (p, _) = error(Api::Chat, "{}");
        assert_eq!(p, "messages");
    }

    #[test]
    fn completion_prompts_are_text_or_ids() {
        let prompt = |body: &str| parse_json(Api::Completions, body).map(|p| p.prompt);
        assert_eq!(prompt(r#"{"prompt": "a"}"#), Ok(Prompt::Text("a".into())));
        assert_eq!(prompt(r#"{"prompt": ["a"]}"#), Ok(Prompt::Text("a".into())));
        assert_eq!(prompt(r#"{"prompt": [1, 2]}"#), Ok(Prompt::Ids(vec![1, 2])));
        assert_eq!(prompt(r#"{"prompt": [[3]]}"#), Ok(Prompt::Ids(vec![3])));
        for body in [
            r#"{}"#,
            r#"{"prompt": ""}"#,
            r#"{"prompt": []}"#,
            r#"{"prompt": ["a", "b"]}"#,
            r#"{"prompt": [1, -2]}"#,
            r#"{"prompt": {"text": "a"}}"#,
        ] {
            assert_eq!(error(Api::Completions, body).0, "prompt", "{body}");
        }
        let p = parse_json(Api::Completions, r#"{"prompt": "a", "logprobs": 5}"#).unwrap();
        assert_eq!(p.logprobs, Some(5));
        assert_eq!(
            error(Api::Completions, r#"{"prompt": "a", "logprobs": 6}"#).0,
            "logprobs"
        );
        assert_eq!(
            error(Api::Completions, r#"{"prompt": "a", "logprobs": true}"#).0,
            "logprobs"
        );
    }

    #[test]
    fn max_tokens_must_fit_the_context() {
        assert_eq!(max_tokens(Api::Chat, 10, None, 100).unwrap(), 90);
        assert_eq!(max_tokens(Api::Completions, 10, None, 100).unwrap(), 16);
        assert_eq!(max_tokens(Api::Completions, 95, None, 100).unwrap(), 5);
        assert_eq!(max_tokens(Api::Chat, 10, Some(90), 100).unwrap(), 90);
        let e = max_tokens(Api::Chat, 10, Some(91), 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(
            e.message.contains("91")
                && e.message.contains("10 tokens")
                && e.message.contains("holds 100")
        );
        let e = max_tokens(Api::Chat, 100, None, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = max_tokens(Api::Completions, 101, None, 100).unwrap_err();
        assert_eq!(
            e.message,
            "the prompt has 101 tokens but the context holds 100"
        );
        assert_eq!(e.code, Some("context_length_exceeded"));
    }
}
