//! OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, which the OpenAI
//! routes and everything in front of the routes (authentication, loading, unknown routes)
//! answer with: clients of the OpenAI API know how to show it.
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// OpenAI's machine-readable code (`model_not_found`, `context_length_exceeded`, …).
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (a full queue, a loading model).
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    /// 503: come back later (`Retry-After` seconds).
    pub fn unavailable(message: impl Into<String>, retry_after: u32) -> ApiError {
        ApiError {
            retry_after: Some(retry_after),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
        }
    }

    pub fn param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// OpenAI's `type`: what kind of failure, by status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND if self.code != Some("model_not_found") => "not_found_error",
            StatusCode::GATEWAY_TIMEOUT => "timeout_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The body alone, for an error that ends a stream already under way.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
