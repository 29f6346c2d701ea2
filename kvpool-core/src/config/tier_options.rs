//! A tier's backend-owned options: kept unparsed by core, read with typed getters by the
//! backend that owns the tier's scheme.
//!
//! Core knows no backend. A `[[tier]]` table's keys other than `url` and `timeout_ms` land in
//! [`TierOptions`]; the backend opening the tier reads the ones it understands through a
//! [`TierOptionsReader`], and [`TierOptionsReader::finish`] turns any key it did not read into
//! an error that names the key and lists the ones the scheme takes.
//!
//! ```
//! use kvpool_core::{ByteSize, TierOptions};
//! let options: TierOptions = toml::from_str("capacity = \"8GiB\"\nadmit = true").unwrap();
//! let mut reader = options.reader("file:///var/cache/kvpool");
//! assert_eq!(reader.bytes("capacity").unwrap(), Some(ByteSize::gib(8)));
//! assert_eq!(reader.bool("admit").unwrap(), Some(true));
//! reader.finish().unwrap();
//! ```

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::config::byte_size::ByteSize;
use crate::error::ConfigError;

/// `url` with any password (`scheme://user:password@host`) replaced by `***`, for logs, `Debug`
/// output and error messages.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}***@{}", &url[..s + 3], &url[at + 1..]),
        (None, Some(at)) => format!("***@{}", &url[at + 1..]),
        _ => url.to_string(),
    }
}

/// One option's value as written in the config (TOML or JSON).
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TierOptionValue {
    /// `true` / `false`.
    Bool(bool),
    /// A whole number.
    Integer(i64),
    /// A number with a fraction.
    Float(f64),
    /// Text (also sizes such as `"8GiB"`).
    Text(String),
}

impl fmt::Debug for TierOptionValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TierOptionValue::Bool(b) => write!(f, "{b}"),
            TierOptionValue::Integer(i) => write!(f, "{i}"),
            TierOptionValue::Float(x) => write!(f, "{x}"),
            TierOptionValue::Text(s) => write!(f, "{:?}", redact_url(s)),
        }
    }
}

impl TierOptionValue {
    fn kind(&self) -> &'static str {
        match self {
            TierOptionValue::Bool(_) => "a boolean",
            TierOptionValue::Integer(_) => "an integer",
            TierOptionValue::Float(_) => "a number",
            TierOptionValue::Text(_) => "text",
        }
    }
}

/// Whether an option named `key` holds a secret, and so prints as `***`: its name contains
/// `secret`, `password`, `token` or `credential`. Backends name their secret options so.
pub fn is_secret_option(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["secret", "password", "token", "credential"]
        .iter()
        .any(|word| key.contains(word))
}

/// The options of one tier other than `url` and `timeout_ms`, in key order. Secret options
/// (see [`is_secret_option`]) and passwords inside URLs print as `***`.
#[derive(Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TierOptions(BTreeMap<String, TierOptionValue>);

impl fmt::Debug for TierOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (key, value) in &self.0 {
            if is_secret_option(key) {
                map.entry(key, &"***");
            } else {
                map.entry(key, value);
            }
        }
        map.finish()
    }
}

impl TierOptions {
    /// No options.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` (replacing any earlier value); chainable.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<TierOptionValue>) -> Self {
        self.set(key, value);
        self
    }

    /// Sets `key`, replacing any earlier value.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<TierOptionValue>) {
        self.0.insert(key.into(), value.into());
    }

    /// The raw value of `key`.
    pub fn get(&self, key: &str) -> Option<&TierOptionValue> {
        self.0.get(key)
    }

    /// Whether there are no options.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Option names, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// A reader for the backend opening the tier at `url` (used in error messages).
    pub fn reader<'a>(&'a self, url: &'a str) -> TierOptionsReader<'a> {
        TierOptionsReader {
            options: self,
            url,
            read: Vec::new(),
        }
    }
}

impl From<bool> for TierOptionValue {
    fn from(v: bool) -> Self {
        TierOptionValue::Bool(v)
    }
}
impl From<i64> for TierOptionValue {
    fn from(v: i64) -> Self {
        TierOptionValue::Integer(v)
    }
}
impl From<u64> for TierOptionValue {
    fn from(v: u64) -> Self {
        i64::try_from(v)
            .map(TierOptionValue::Integer)
            .unwrap_or_else(|_| TierOptionValue::Text(v.to_string()))
    }
}
impl From<f64> for TierOptionValue {
    fn from(v: f64) -> Self {
        TierOptionValue::Float(v)
    }
}
impl From<&str> for TierOptionValue {
    fn from(v: &str) -> Self {
        TierOptionValue::Text(v.to_string())
    }
}
impl From<String> for TierOptionValue {
    fn from(v: String) -> Self {
        TierOptionValue::Text(v)
    }
}
impl From<ByteSize> for TierOptionValue {
    fn from(v: ByteSize) -> Self {
        TierOptionValue::Text(v.to_string())
    }
}

/// Reads a tier's options with types, remembering which keys were asked for so that
/// [`TierOptionsReader::finish`] can reject the rest (a typo is an error, not a silent default).
pub struct TierOptionsReader<'a> {
    options: &'a TierOptions,
    url: &'a str,
    read: Vec<&'static str>,
}

impl TierOptionsReader<'_> {
    fn error(&self, key: &str, reason: String) -> ConfigError {
        ConfigError::TierOption {
            tier: redact_url(self.url),
            key: key.to_string(),
            reason,
        }
    }

    fn value(&mut self, key: &'static str) -> Option<&TierOptionValue> {
        if !self.read.contains(&key) {
            self.read.push(key);
        }
        self.options.0.get(key)
    }

    fn wrong_type(&self, key: &str, value: &TierOptionValue, expected: &str) -> ConfigError {
        self.error(key, format!("expected {expected}, found {}", value.kind()))
    }

    /// `key` as a boolean.
    pub fn bool(&mut self, key: &'static str) -> Result<Option<bool>, ConfigError> {
        match self.value(key).cloned() {
            None => Ok(None),
            Some(TierOptionValue::Bool(b)) => Ok(Some(b)),
            Some(other) => Err(self.wrong_type(key, &other, "true or false")),
        }
    }

    /// `key` as a non-negative whole number (an integer, or text holding one).
    pub fn u64(&mut self, key: &'static str) -> Result<Option<u64>, ConfigError> {
        match self.value(key).cloned() {
            None => Ok(None),
            Some(TierOptionValue::Integer(i)) => u64::try_from(i)
                .map(Some)
                .map_err(|_| self.error(key, format!("{i} is negative"))),
            Some(TierOptionValue::Text(s)) => s
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| self.error(key, format!("`{s}` is not a whole number"))),
            Some(other) => Err(self.wrong_type(key, &other, "a whole number")),
        }
    }

    /// `key` as a byte count: an integer, or text such as `"8GiB"` or `"512MiB"`.
    pub fn bytes(&mut self, key: &'static str) -> Result<Option<ByteSize>, ConfigError> {
        match self.value(key).cloned() {
            None => Ok(None),
            Some(TierOptionValue::Integer(i)) => u64::try_from(i)
                .map(|n| Some(ByteSize(n)))
                .map_err(|_| self.error(key, format!("{i} is negative"))),
            Some(TierOptionValue::Text(s)) => {
                s.parse().map(Some).map_err(|e: String| self.error(key, e))
            }
            Some(other) => Err(self.wrong_type(key, &other, "a size such as \"8GiB\"")),
        }
    }

    /// `key` as text.
    pub fn string(&mut self, key: &'static str) -> Result<Option<String>, ConfigError> {
        match self.value(key).cloned() {
            None => Ok(None),
            Some(TierOptionValue::Text(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong_type(key, &other, "text")),
        }
    }

    /// An error about `key` (a value of the right type that the backend cannot use).
    pub fn invalid(&self, key: &str, reason: impl Into<String>) -> ConfigError {
        self.error(key, reason.into())
    }

    /// Fails on the first option that was never asked for, naming it and the options this
    /// tier's scheme takes.
    pub fn finish(self) -> Result<(), ConfigError> {
        match self
            .options
            .keys()
            .find(|key| !self.read.iter().any(|r| r == key))
        {
            None => Ok(()),
            Some(unknown) => {
                let known = if self.read.is_empty() {
                    "this scheme takes no options besides url and timeout_ms".to_string()
                } else {
                    format!(
                        "this scheme takes url, timeout_ms, {}",
                        self.read.join(", ")
                    )
                };
                Err(self.error(unknown, format!("unknown option; {known}")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_reads_and_clear_errors_naming_the_key() {
        let options: TierOptions = toml::from_str(
            "capacity = 4096\nttl = \"60\"\nflag = \"yes\"\nsize = \"3 parsecs\"\nneg = -1",
        )
        .unwrap();
        let mut r = options.reader("redis://:hunter2@h:1");
        assert_eq!(r.bytes("capacity").unwrap(), Some(ByteSize(4096)));
        assert_eq!(r.u64("ttl").unwrap(), Some(60));
        assert_eq!(r.u64("absent").unwrap(), None);
        let err = r.bool("flag").unwrap_err().to_string();
        assert!(
            err.contains("`flag`") && err.contains("true or false"),
            "{err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
        let err = r.bytes("size").unwrap_err().to_string();
        assert!(err.contains("`size`"), "{err}");
        let err = r.u64("neg").unwrap_err().to_string();
        assert!(err.contains("negative"), "{err}");
        r.finish().unwrap();
    }

    #[test]
    fn an_option_nobody_reads_is_an_error_listing_the_known_ones() {
        let options: TierOptions = toml::from_str("capacity = 1\ncapasity = 2").unwrap();
        let mut r = options.reader("file:///x");
        r.bytes("capacity").unwrap();
        let err = r.finish().unwrap_err().to_string();
        assert!(
            err.contains("`capasity`") && err.contains("url, timeout_ms, capacity"),
            "{err}"
        );
        let err = options
            .reader("memory://")
            .finish()
            .unwrap_err()
            .to_string();
        assert!(err.contains("takes no options"), "{err}");
    }

    #[test]
    fn secrets_print_as_stars() {
        let options = TierOptions::new()
            .with("secret_access_key", "hunter2")
            .with("password", "hunter2")
            .with("endpoint", "http://u:hunter2@h:9000")
            .with("region", "us-east-1");
        let shown = format!("{options:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("us-east-1"), "{shown}");
    }
}
