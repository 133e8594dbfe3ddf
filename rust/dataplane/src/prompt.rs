//! Approximate-mode prompts from an OpenAI request body: the prompt text (or token ids) and its block
//! hashes, derived as `kvroute.prompt.ApproxPrompter` does, and the OpenAI-style 400s of invalid bodies.

use serde_json::Value;

/// What routing needs from one request (the Python `Prompt`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApproxPrompt {
    /// Sequence hashes of the full blocks.
    pub hashes: Vec<u64>,
    /// Prompt length in (approximate) tokens, the partial last block included.
    pub num_tokens: u64,
    /// `max_completion_tokens` or `max_tokens`, when given.
    pub output_tokens: Option<u64>,
}

/// The request body is not a valid OpenAI completions / chat request: the client gets a 400 with this message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

fn bad<T>(msg: impl Into<String>) -> Result<T, BadRequest> {
    Err(BadRequest(msg.into()))
}

/// Every `BYTES_PER_TOKEN` bytes of UTF-8 prompt text count as one token (ApproxPrompter's default).
pub const BYTES_PER_TOKEN: usize = 4;

/// The approximate prompt of a parsed request body, or the 400 an invalid body gets. `lora`: the
/// LoRA adapter serving it (the caller resolves the body's `model`); with the body's `cache_salt` it
/// keys the prompt's blocks (`kvroute_core::hash::identity_root`).
pub fn approx_prompt(body: &Value, chat: bool, block_size: usize, seed: u64, lora: Option<&str>) -> Result<ApproxPrompt, BadRequest> {
    approx_prompt_of(body, chat, block_size, seed, true, lora)
}

/// The identity root of a request: the LoRA adapter serving it and the body's `cache_salt` (a
/// string; empty is none, as in vLLM).
pub fn request_root(body: &serde_json::Map<String, Value>, lora: Option<&str>) -> Result<Option<u64>, BadRequest> {
    let salt = match body.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(v) => return bad(format!("cache_salt must be a string, got {}", type_name(v))),
    };
    Ok(kvroute_core::hash::identity_root(lora.map(str::as_bytes), salt.map(str::as_bytes)))
}

/// `approx_prompt`; `strict: false` (exact mode's fallback, for a body the exact prompter validated)
/// keys message contents of any JSON type by their JSON text instead of refusing them.
///
/// A chat with media (a content part other than text) is keyed only up to its first media part:
/// what follows cannot be keyed as the engine keys it (its blocks carry the media's identity), so
/// the hashes cover that text prefix while `num_tokens` estimates the whole prompt.
pub(crate) fn approx_prompt_of(
    body: &Value,
    chat: bool,
    block_size: usize,
    seed: u64,
    strict: bool,
    lora: Option<&str>,
) -> Result<ApproxPrompt, BadRequest> {
    let body = object(body)?;
    let (tokens, keyed) = if chat {
        let msgs = valid_messages(body)?;
        let mut text = String::new();
        let mut cut = None;
        for m in msgs {
            let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
            text.push_str("<|");
            text.push_str(role);
            text.push_str("|>");
            let media = message_text(m.get("content"), &mut text, strict)?;
            if cut.is_none() {
                cut = media;
            }
            text.push('\n');
        }
        let tokens = text_tokens(text.as_bytes());
        // Only whole tokens before the media part (4 bytes each) are keyed.
        let keyed = cut.map_or(tokens.len(), |c| c / BYTES_PER_TOKEN);
        (tokens, keyed)
    } else {
        let t = match completion_prompt(body)? {
            CompletionPrompt::Text(s) => text_tokens(s.as_bytes()),
            CompletionPrompt::Ids(ids) => ids,
        };
        let n = t.len();
        (t, n)
    };
    if tokens.is_empty() {
        return bad("empty prompt");
    }
    let output_tokens = output_tokens(body)?;
    let root = request_root(body, lora)?;
    let hashes = kvroute_core::hash::sequence_hashes(&tokens[..keyed], block_size, seed, root);
    Ok(ApproxPrompt { hashes, num_tokens: tokens.len() as u64, output_tokens })
}

/// Whether a chat body has a content part other than text (an image, audio, video or file).
pub(crate) fn has_media(body: &serde_json::Map<String, Value>) -> bool {
    first_media_message(body).is_some()
}

/// The index of the first message holding a content part other than text.
pub(crate) fn first_media_message(body: &serde_json::Map<String, Value>) -> Option<usize> {
    let Some(Value::Array(msgs)) = body.get("messages") else { return None };
    msgs.iter().position(|m| matches!(m.get("content"), Some(Value::Array(parts)) if parts.iter().any(|p| !is_text_part(p))))
}

fn is_text_part(p: &Value) -> bool {
    p.as_object().is_some_and(|o| o.get("type").and_then(Value::as_str) == Some("text"))
}

/// The body as a JSON object (the 400 of any other JSON value).
pub(crate) fn object(body: &Value) -> Result<&serde_json::Map<String, Value>, BadRequest> {
    body.as_object().ok_or_else(|| BadRequest("request body must be a JSON object".into()))
}

/// A completions request's (first) prompt.
pub(crate) enum CompletionPrompt<'a> {
    Text(&'a str),
    Ids(Vec<u32>),
}

/// `_messages`: a non-empty list of objects, each with a string `role`.
pub(crate) fn valid_messages(body: &serde_json::Map<String, Value>) -> Result<&Vec<Value>, BadRequest> {
    let msgs = match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        _ => return bad("chat request needs 'messages': a non-empty list of {role, content} objects"),
    };
    if let Some(i) = msgs.iter().position(|m| !m.get("role").is_some_and(Value::is_string)) {
        return bad(format!("messages[{i}] must be an object with a string 'role'"));
    }
    Ok(msgs)
}

/// `_completion_prompt`: a string, a list of token ids, or a list whose first item is one of those.
pub(crate) fn completion_prompt(body: &serde_json::Map<String, Value>) -> Result<CompletionPrompt<'_>, BadRequest> {
    const NEEDS: &str = "completions request needs 'prompt': a string, a list of token ids, or a non-empty list of those";
    match body.get("prompt") {
        Some(Value::String(s)) => Ok(CompletionPrompt::Text(s)),
        Some(Value::Array(items)) if !items.is_empty() => {
            if items.iter().all(is_int) {
                return token_ids(items).map(CompletionPrompt::Ids);
            }
            match &items[0] {
                Value::String(s) => Ok(CompletionPrompt::Text(s)),
                Value::Array(first) if !first.is_empty() && first.iter().all(is_int) => token_ids(first).map(CompletionPrompt::Ids),
                _ => bad(NEEDS),
            }
        }
        _ => bad(NEEDS),
    }
}

fn is_int(v: &Value) -> bool {
    matches!(v, Value::Number(n) if n.is_i64() || n.is_u64())
}

/// Token ids in 0..2**32.
fn token_ids(items: &[Value]) -> Result<Vec<u32>, BadRequest> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| BadRequest("token ids must be in 0..2**32".into()))
}

/// `_output_tokens`: the first of max_completion_tokens / max_tokens that is not null, a
/// non-negative integer the router accepts.
pub(crate) fn output_tokens(body: &serde_json::Map<String, Value>) -> Result<Option<u64>, BadRequest> {
    for key in ["max_completion_tokens", "max_tokens"] {
        match body.get(key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                return match v.as_u64().filter(|&n| n <= i64::MAX as u64) {
                    Some(n) => Ok(Some(n)),
                    None => bad(format!("{key} must be a non-negative integer, got {}", py_repr(v))),
                }
            }
        }
    }
    Ok(None)
}

/// A JSON value as Python's `repr` of its `json.loads` result (for error messages).
fn py_repr(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => (if *b { "True" } else { "False" }).into(),
        Value::String(s) => format!("'{s}'"),
        other => {
            let mut out = String::new();
            py_json_dumps(other, &mut out);
            out
        }
    }
}

/// `_message_text`: string content as is, text parts' text, other parts as `json.dumps(p, sort_keys=True)`.
/// Returns where in `out` the first media part (a part other than text) begins, if any.
fn message_text(content: Option<&Value>, out: &mut String, strict: bool) -> Result<Option<usize>, BadRequest> {
    let mut media = None;
    match content {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for p in parts {
                match p.as_object() {
                    Some(o) if o.get("type").and_then(Value::as_str) == Some("text") => match o.get("text") {
                        None => {}
                        Some(Value::String(t)) => out.push_str(t),
                        Some(other) if strict => {
                            return bad(format!("a text content part's 'text' must be a string, got {}", type_name(other)))
                        }
                        Some(other) => py_json_dumps(other, out),
                    },
                    _ => {
                        media.get_or_insert(out.len());
                        py_json_dumps(p, out)
                    }
                }
            }
        }
        Some(other) if strict => {
            return bad(format!("message content must be a string or a list of content parts, got {}", type_name(other)));
        }
        Some(other) => py_json_dumps(other, out),
    }
    Ok(media)
}

/// Python's type name of a JSON value after `json.loads`.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "NoneType",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "str",
        Value::Array(_) => "list",
        Value::Object(_) => "dict",
    }
}

/// `json.dumps(v, sort_keys=True)` with Python's defaults (", " and ": " separators, ASCII-only
/// output, floats as Python's `repr`).
pub fn py_json_dumps(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.push_str(&i.to_string());
            } else if let Some(u) = n.as_u64() {
                out.push_str(&u.to_string());
            } else {
                out.push_str(&py_float_repr(n.as_f64().unwrap_or(f64::NAN)));
            }
        }
        Value::String(s) => py_json_str(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_json_dumps(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            // UTF-8 byte order is code point order, which is how Python sorts str keys.
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_unstable();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_json_str(k, out);
                out.push_str(": ");
                py_json_dumps(&map[k], out);
            }
            out.push('}');
        }
    }
}

/// Python's `repr(float)`: the shortest round-trip digits, positional for exponents -4..16, else
/// `d.ddde+XX` (JSON has no NaN or infinity, so those are not reached from a parsed body).
pub fn py_float_repr(f: f64) -> String {
    if !f.is_finite() {
        return if f.is_nan() {
            "NaN".into()
        } else if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let sci = format!("{f:e}"); // shortest round-trip digits: "-1.5e-7", "1e20", "0e0"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        format!("{sign}{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

pub(crate) fn py_json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
    out.push('"');
}

/// Python's truthiness of a JSON value (`bool(value)` after `json.loads`).
pub(crate) fn py_truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// UTF-8 bytes zero-padded to a multiple of 4, read as little-endian u32 "tokens".
pub fn text_tokens(raw: &[u8]) -> Vec<u32> {
    let mut chunks = raw.chunks_exact(BYTES_PER_TOKEN);
    let mut out: Vec<u32> = Vec::with_capacity(raw.len().div_ceil(BYTES_PER_TOKEN));
    out.extend(chunks.by_ref().map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 4];
        last[..rest.len()].copy_from_slice(rest);
        out.push(u32::from_le_bytes(last));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn approx_prompt_t(body: &Value, chat: bool, bs: usize, seed: u64) -> Result<ApproxPrompt, BadRequest> {
        approx_prompt(body, chat, bs, seed, None)
    }

    #[test]
    fn identity_and_media_key_the_prompt() {
        let body = json!({"prompt": "x".repeat(64)});
        let base = approx_prompt(&body, false, 2, 1, None).unwrap();
        let lora = approx_prompt(&body, false, 2, 1, Some("a")).unwrap();
        let salted = approx_prompt(&json!({"prompt": "x".repeat(64), "cache_salt": "s"}), false, 2, 1, None).unwrap();
        let empty_salt = approx_prompt(&json!({"prompt": "x".repeat(64), "cache_salt": ""}), false, 2, 1, None).unwrap();
        assert_eq!(base.hashes.len(), 8);
        assert_eq!(empty_salt, base);
        assert!(lora.hashes[0] != base.hashes[0] && salted.hashes[0] != base.hashes[0] && salted.hashes[0] != lora.hashes[0]);
        assert!(approx_prompt(&json!({"prompt": "x", "cache_salt": 3}), false, 2, 1, None).is_err());
        // Media: keyed up to the first media part; the length still counts all of it.
        let text = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "y".repeat(40)}]}]});
        let img = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "y".repeat(40)}, {"type": "image_url", "image_url": {"url": "http://x/1.png"}},
            {"type": "text", "text": "z".repeat(80)}]}]});
        let (t, i) = (approx_prompt(&text, true, 2, 1, None).unwrap(), approx_prompt(&img, true, 2, 1, None).unwrap());
        // "<|user|>" + 40 bytes = 48 bytes = 12 tokens = 6 blocks before the image.
        assert_eq!(i.hashes, t.hashes[..6].to_vec());
        assert!(i.num_tokens > t.num_tokens + 20);
        assert!(has_media(img.as_object().unwrap()) && !has_media(text.as_object().unwrap()));
    }
    use serde_json::json;

    fn dumps(v: Value) -> String {
        let mut s = String::new();
        py_json_dumps(&v, &mut s);
        s
    }

    #[test]
    fn json_dumps_matches_python_defaults() {
        assert_eq!(
            dumps(json!({"b": [1, -2, true, null], "a": "x\"y\\\n\u{7f}é😀"})),
            r#"{"a": "x\"y\\\n\u007f\u00e9\ud83d\ude00", "b": [1, -2, true, null]}"#
        );
        assert_eq!(
            dumps(json!({"f": 1.5, "g": [1e20, 1e-7, 0.1, 123456.0, -2.5e-5, 1e16, 1234567890123456.0]})),
            r#"{"f": 1.5, "g": [1e+20, 1e-07, 0.1, 123456.0, -2.5e-05, 1e+16, 1234567890123456.0]}"#
        );
    }

    #[test]
    fn text_tokens_pad_and_read_little_endian() {
        assert_eq!(text_tokens(b"abcde"), vec![u32::from_le_bytes(*b"abcd"), u32::from_le_bytes([b'e', 0, 0, 0])]);
        assert!(text_tokens(b"").is_empty());
    }

    #[test]
    fn completion_forms_and_fallbacks() {
        let p = approx_prompt_t(&json!({"prompt": "hello world", "max_tokens": 3}), false, 2, 1).unwrap();
        assert_eq!(p.num_tokens, 3);
        assert_eq!(p.hashes.len(), 1);
        assert_eq!(p.output_tokens, Some(3));
        let ids = approx_prompt_t(&json!({"prompt": [1, 2, 3, 4]}), false, 2, 1).unwrap();
        assert_eq!(ids.hashes, kvroute_core::hash::sequence_hashes(&[1, 2, 3, 4], 2, 1, None));
        let batched = approx_prompt_t(&json!({"prompt": [[1, 2, 3, 4], [5]]}), false, 2, 1).unwrap();
        assert_eq!(batched, ids);
        for bad in [
            json!({"prompt": ""}),
            json!({"prompt": []}),
            json!({"prompt": [1, -2]}),
            json!({"prompt": [1, 4294967296u64]}),
            json!({"prompt": "a", "max_tokens": -1}),
            json!({"prompt": "a", "max_tokens": true}),
            json!({"prompt": "a", "max_tokens": 2.0}),
            json!({"max_tokens": 3}),
            json!([1, 2]),
        ] {
            assert!(approx_prompt_t(&bad, false, 2, 1).is_err(), "{bad}");
        }
        let first_null = approx_prompt_t(&json!({"prompt": "a", "max_completion_tokens": null, "max_tokens": 7}), false, 2, 1).unwrap();
        assert_eq!(first_null.output_tokens, Some(7));
    }

    #[test]
    fn chat_text_is_role_and_content_in_order() {
        let body = json!({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "u"}}]}, {"role": "assistant"}]});
        let text = "<|system|>be brief\n<|user|>hi{\"image_url\": {\"url\": \"u\"}, \"type\": \"image_url\"}\n<|assistant|>\n";
        let p = approx_prompt_t(&body, true, 4, 9).unwrap();
        // Keyed up to the image part ("<|system|>be brief\n<|user|>hi" is 29 bytes: 7 whole tokens).
        let keyed = &text_tokens(text.as_bytes())[..29 / 4];
        assert_eq!(p.hashes, kvroute_core::hash::sequence_hashes(keyed, 4, 9, None));
        assert_eq!(p.num_tokens, text.len().div_ceil(4) as u64);
        for bad in [
            json!({"messages": []}),
            json!({"messages": "hi"}),
            json!({"messages": [{"content": "x"}]}),
            json!({"messages": [{"role": "u", "content": 3}]}),
        ] {
            assert!(approx_prompt_t(&bad, true, 4, 9).is_err(), "{bad}");
        }
    }
}
