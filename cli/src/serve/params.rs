//! Reading a JSON request body field by field, so that a refusal names the field at fault and
//! says what it must be (serde's derive would say "invalid type at line 1 column 57"). Absent
//! and `null` fields are the same: both take the default. Fields nobody asks for are ignored.
use serde_json::{Map, Value};

/// What is wrong with a request body; `param` names the field, if one is at fault.
#[derive(Debug, PartialEq)]
pub struct FieldError {
    pub param: Option<String>,
    pub message: String,
    /// The field asks for something this server does not do (OpenAI's `unsupported_parameter`).
    pub unsupported: bool,
}

impl FieldError {
    pub fn new(param: &str, message: String) -> FieldError {
        FieldError {
            param: Some(param.to_string()),
            message,
            unsupported: false,
        }
    }
}

/// A request body: a JSON object.
pub struct Fields(Map<String, Value>);

impl Fields {
    pub fn parse(body: &[u8]) -> Result<Fields, FieldError> {
        let value: Value = serde_json::from_slice(body).map_err(|e| FieldError {
            param: None,
            message: format!("the body is not valid JSON: {e}"),
            unsupported: false,
        })?;
        match value {
            Value::Object(map) => Ok(Fields(map)),
            other => Err(FieldError {
                param: None,
                message: format!("the body must be a JSON object, not {}", kind(&other)),
                unsupported: false,
            }),
        }
    }

    /// The field's value; `None` when absent or `null`.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub fn string(&self, name: &str) -> Result<Option<&str>, FieldError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(name, "a string", v)),
        }
    }

    pub fn boolean(&self, name: &str, default: bool) -> Result<bool, FieldError> {
        match self.get(name) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(wrong_type(name, "true or false", v)),
        }
    }

    /// A number in `[lo, hi]`, or `default`.
    pub fn number(&self, name: &str, default: f32, lo: f32, hi: f32) -> Result<f32, FieldError> {
        let Some(v) = self.get(name) else {
            return Ok(default);
        };
        let x = v.as_f64().ok_or_else(|| wrong_type(name, "a number", v))?;
        if !(x >= lo as f64 && x <= hi as f64) {
            let hi = if hi == f32::MAX {
                "".to_string()
            } else {
                format!(" and at most {hi}")
            };
            return Err(FieldError::new(
                name,
                format!("`{name}` must be at least {lo}{hi}, got {x}"),
            ));
        }
        Ok(x as f32)
    }

    /// An integer in `[lo, hi]`; `None` when absent.
    pub fn integer(&self, name: &str, lo: i128, hi: i128) -> Result<Option<i128>, FieldError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let n = match (v.as_i64(), v.as_u64()) {
            (Some(n), _) => n as i128,
            (_, Some(n)) => n as i128,
            _ => return Err(wrong_type(name, "an integer", v)),
        };
        if n < lo || n > hi {
            return Err(FieldError::new(
                name,
                format!("`{name}` must be from {lo} to {hi}, got {n}"),
            ));
        }
        Ok(Some(n))
    }

    /// Stop strings: one string or an array of at most `max`, none empty.
    pub fn stop(&self, name: &str, max: usize) -> Result<Vec<String>, FieldError> {
        let stops = match self.get(name) {
            None => return Ok(Vec::new()),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    v => Err(wrong_type(name, "a string or an array of strings", v)),
                })
                .collect::<Result<_, _>>()?,
            Some(v) => return Err(wrong_type(name, "a string or an array of strings", v)),
        };
        if stops.len() > max {
            return Err(FieldError::new(
                name,
                format!(
                    "`{name}` has {} strings; at most {max} are allowed",
                    stops.len()
                ),
            ));
        }
        if stops.iter().any(String::is_empty) {
            return Err(FieldError::new(
                name,
                format!("`{name}` must not contain an empty string"),
            ));
        }
        Ok(stops)
    }

    /// Refuses a field that asks for a feature this server lacks, unless `harmless(value)`
    /// (e.g. `tools: []`, `n: 1`).
    pub fn unsupported(
        &self,
        name: &str,
        harmless: impl Fn(&Value) -> bool,
    ) -> Result<(), FieldError> {
        match self.get(name) {
            Some(v) if !harmless(v) => Err(FieldError {
                unsupported: true,
                ..FieldError::new(name, format!("`{name}` is not supported by this server"))
            }),
            _ => Ok(()),
        }
    }
}

fn wrong_type(name: &str, expected: &str, got: &Value) -> FieldError {
    FieldError::new(
        name,
        format!("`{name}` must be {expected}, not {}", kind(got)),
    )
}

/// How an error message names a JSON value's type.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> Fields {
        Fields::parse(json.as_bytes()).unwrap()
    }

    #[test]
    fn bodies_must_be_json_objects() {
        let err = |s: &str| Fields::parse(s.as_bytes()).err().unwrap().message;
        assert!(err("{\"a\":").starts_with("the body is not valid JSON"));
        assert_eq!(err("[1]"), "the body must be a JSON object, not an array");
        assert_eq!(err("\"x\""), "the body must be a JSON object, not a string");
    }

    #[test]
    fn null_is_absent() {
        let f = fields(r#"{"t": null, "s": null}"#);
        assert_eq!(f.number("t", 1.0, 0.0, 2.0), Ok(1.0));
        assert_eq!(f.string("s"), Ok(None));
        assert_eq!(f.integer("n", 0, 9), Ok(None));
    }

    #[test]
    fn numbers_are_checked_for_type_and_range() {
        let f = fields(r#"{"t": -1, "u": "0.5", "v": 0.5, "w": 1e300}"#);
        assert_eq!(
            f.number("t", 1.0, 0.0, 2.0).unwrap_err(),
            FieldError::new("t", "`t` must be at least 0 and at most 2, got -1".into())
        );
        assert_eq!(
            f.number("u", 1.0, 0.0, 2.0).unwrap_err().message,
            "`u` must be a number, not a string"
        );
        assert_eq!(f.number("v", 1.0, 0.0, 2.0), Ok(0.5));
        assert_eq!(
            f.number("w", 1.0, 0.0, f32::MAX).unwrap_err().message,
            format!("`w` must be at least 0, got {}", 1e300)
        );
    }

    #[test]
    fn integers_are_whole_and_in_range() {
        let f = fields(r#"{"a": 1.5, "b": 18446744073709551615, "c": -3, "d": true}"#);
        assert_eq!(
            f.integer("a", 0, 9).unwrap_err().message,
            "`a` must be an integer, not a number"
        );
        assert_eq!(
            f.integer("b", 0, u64::MAX as i128),
            Ok(Some(u64::MAX as i128))
        );
        assert_eq!(
            f.integer("c", 1, 5).unwrap_err().message,
            "`c` must be from 1 to 5, got -3"
        );
        assert_eq!(
            f.integer("d", 0, 1).unwrap_err().message,
            "`d` must be an integer, not a boolean"
        );
    }

    #[test]
    fn stop_is_a_string_or_a_few() {
        assert_eq!(
            fields(r#"{"stop": "x"}"#).stop("stop", 4),
            Ok(vec!["x".into()])
        );
        assert_eq!(
            fields(r#"{"stop": ["a", "b"]}"#).stop("stop", 4),
            Ok(vec!["a".into(), "b".into()])
        );
        let err = |s: &str| fields(s).stop("stop", 4).unwrap_err().message;
        assert_eq!(
            err(r#"{"stop": ["a","b","c","d","e"]}"#),
            "`stop` has 5 strings; at most 4 are allowed"
        );
        assert_eq!(
            err(r#"{"stop": [1]}"#),
            "`stop` must be a string or an array of strings, not a number"
        );
        assert_eq!(
            err(r#"{"stop": ""}"#),
            "`stop` must not contain an empty string"
        );
    }

    #[test]
    fn unsupported_fields_are_refused_unless_harmless() {
        let f = fields(r#"{"tools": [], "n": 2}"#);
        assert!(
            f.unsupported("tools", |v| v.as_array().is_some_and(|a| a.is_empty()))
                .is_ok()
        );
        let e = f.unsupported("n", |v| v == 1).unwrap_err();
        assert!(e.unsupported && e.param.as_deref() == Some("n"), "{e:?}");
    }
}
