//! A config that does not fit its schema, said in a user's words: the key path and the line
//! (serde_yaml loses both inside `kind:`-tagged sections), the type a value should have in
//! words ("an integer", not `i64`), and the forms a duration takes.

use serde::de::DeserializeOwned;

/// Where a config does not fit its schema, and what was expected there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", self.place())]
pub struct SchemaError {
    /// The key's path (`retry.max_attempts`), or `None` for the document as a whole.
    pub key: Option<String>,
    /// The key's line, where known.
    pub line: Option<usize>,
    /// What is wrong, with types said in words.
    pub message: String,
}

impl SchemaError {
    fn place(&self) -> String {
        match (&self.key, self.line) {
            (None, Some(line)) => format!("line {line}: "),
            (None, None) => String::new(),
            (Some(key), Some(line)) => format!("`{key}` (line {line}): "),
            (Some(key), None) => format!("`{key}`: "),
        }
    }
}

/// Parses `text`; an error names the key, its line and what was expected.
pub(crate) fn parse<T: DeserializeOwned>(text: &str) -> Result<T, SchemaError> {
    serde_path_to_error::deserialize(serde_yaml::Deserializer::from_str(text)).map_err(|e| describe(text, e))
}

fn describe(text: &str, error: serde_path_to_error::Error<serde_yaml::Error>) -> SchemaError {
    let path = error.path().to_string();
    let inner = error.into_inner();
    let message = bare_message(&inner.to_string(), &path);
    // Inside a tagged section the path and position are the section's: find the key whose
    // value the message names.
    let (path, line) = match (locate(text, &path, &message), inner.location()) {
        (Some((path, line)), _) => (path, line),
        (None, location) => (path, location.map(|l| l.line())),
    };
    SchemaError { key: (path != ".").then_some(path), line, message: in_words(&message) }
}

/// serde_yaml's message without the key path in front and the position after (both are
/// said once, in front).
fn bare_message(message: &str, path: &str) -> String {
    let message = message.strip_prefix(&format!("{path}: ")).unwrap_or(message);
    match message.rfind(" at line ") {
        Some(at) if message[at..].contains(" column ") => message[..at].to_string(),
        _ => message.to_string(),
    }
}

/// Where an error about a value inside the mapping at `path` is: the key that holds the value
/// the message names (`string "one"`), and that key's line.
fn locate(text: &str, path: &str, message: &str) -> Option<(String, Option<usize>)> {
    let value = offending_value(message)?;
    let doc: serde_yaml::Value = serde_yaml::from_str(text).ok()?;
    let mapping = at_path(&doc, path)?.as_mapping()?;
    let key = mapping.iter().find(|(_, v)| scalar_text(v).as_deref() == Some(value)).and_then(|(k, _)| k.as_str())?;
    let line = text
        .lines()
        .position(|l| l.split(&format!("{key}:")).skip(1).any(|after| after.trim_start().trim_start_matches(['"', '\'']).starts_with(value)));
    let path = if path == "." { key.to_string() } else { format!("{path}.{key}") };
    Some((path, line.map(|l| l + 1)))
}

/// The value a serde message names: `string "one"`, `integer `5``, `floating point `2.5``,
/// `boolean `true``.
fn offending_value(message: &str) -> Option<&str> {
    if let Some(rest) = message.split("string \"").nth(1) {
        return rest.split('"').next();
    }
    ["integer `", "floating point `", "boolean `"].iter().find_map(|kind| message.split(kind).nth(1).and_then(|rest| rest.split('`').next()))
}

fn at_path<'a>(doc: &'a serde_yaml::Value, path: &str) -> Option<&'a serde_yaml::Value> {
    if path == "." {
        return Some(doc);
    }
    path.split('.').try_fold(doc, |value, segment| {
        let (key, index) = match segment.split_once('[') {
            Some((key, rest)) => (key, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (segment, None),
        };
        let value = if key.is_empty() { value } else { value.get(key)? };
        match index {
            Some(i) => value.get(i),
            None => Some(value),
        }
    })
}

fn scalar_text(value: &serde_yaml::Value) -> Option<String> {
    match value {
        serde_yaml::Value::String(s) => Some(s.clone()),
        serde_yaml::Value::Number(n) => Some(n.to_string()),
        serde_yaml::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Rust's type names said in words, and the forms of a duration.
fn in_words(message: &str) -> String {
    const WORDS: [(&str, &str); 13] = [
        ("i8", "an integer"),
        ("i16", "an integer"),
        ("i32", "an integer"),
        ("i64", "an integer"),
        ("isize", "an integer"),
        ("u8", "a whole number (0 or more)"),
        ("u16", "a whole number (0 or more)"),
        ("u32", "a whole number (0 or more)"),
        ("u64", "a whole number (0 or more)"),
        ("usize", "a whole number (0 or more)"),
        ("f32", "a number"),
        ("f64", "a number"),
        ("a duration", "a duration with its unit, like 30s, 500ms or 2m"),
    ];
    let Some((before, expected)) = message.rsplit_once("expected ") else {
        return message.to_string();
    };
    match WORDS.iter().find(|(rust, _)| expected == *rust) {
        Some((_, words)) => format!("{before}expected {words}"),
        None => message.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Config {
        batch_size: Option<i64>,
        #[serde(default, with = "humantime_serde")]
        request_timeout: Option<Duration>,
        retry: Option<Retry>,
        input: Option<Input>,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Retry {
        max_attempts: u32,
    }

    #[derive(Debug, Deserialize)]
    #[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
    #[allow(dead_code)]
    enum Input {
        Synthetic { seed: Option<i64> },
    }

    fn error(text: &str) -> String {
        parse::<Config>(text).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_key_and_line_and_say_the_type_in_words() {
        assert_eq!(
            error("batch_size: 8\nretry: {max_attempts: -1}\n"),
            "`retry.max_attempts` (line 2): invalid type: integer `-1`, expected a whole number (0 or more)"
        );
        assert_eq!(error("batch_size: \"8\"\n"), "`batch_size` (line 1): invalid type: string \"8\", expected an integer");
        assert_eq!(
            error("batch_size: 8\nrequest_timeout: 30\n"),
            "`request_timeout` (line 2): invalid value: string \"30\", expected a duration with its unit, like 30s, 500ms or 2m"
        );
        assert_eq!(
            error("batch_size: 8\nbatch: 3\n"),
            "`batch` (line 2): unknown field `batch`, expected one of `batch_size`, `request_timeout`, `retry`, `input`"
        );
    }

    #[test]
    fn inside_a_tagged_section_the_key_and_line_are_found_again() {
        assert_eq!(
            error("batch_size: 8\ninput: {kind: synthetic, seed: one}\n"),
            "`input.seed` (line 2): invalid type: string \"one\", expected an integer"
        );
        assert_eq!(
            error("input:\n  kind: synthetic\n  seed: 2.5\n"),
            "`input.seed` (line 3): invalid type: floating point `2.5`, expected an integer"
        );
        assert!(parse::<Config>("input: {kind: synthetic, seed: 4}\nrequest_timeout: 2m\n").is_ok());
        let error = parse::<Config>("input:\n  kind: synthetic\n  seed: 2.5\n").unwrap_err();
        assert_eq!((error.key.as_deref(), error.line), (Some("input.seed"), Some(3)));
        let error = parse::<Config>("- 1\n").unwrap_err();
        assert_eq!(error.key, None, "{error}");
    }
}
