//! Exact-mode prompts: the engines' Hugging Face tokenizer and chat template in Rust, deriving the same
//! token ids and block hashes as `kvroute.prompt.ExactPrompter`.
//!
//! An invalid body is a `BadRequest` (the client's 400, with the Python prompter's message). A valid
//! body this cannot reproduce exactly (a template error, a value whose Python rendering is not
//! reproduced here such as a float or a list printed by the template, a template minijinja cannot
//! compile) yields `Ok(None)`: the plane then routes it on its approximate hashes (routing is advice;
//! the engine still renders and answers it).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error as TemplateError, ErrorKind, Output, State, Value as TemplateValue};
use serde_json::{Map, Value};
use tokenizers::Tokenizer;

use crate::prompt::{
    approx_prompt_of, completion_prompt, first_media_message, has_media, object, output_tokens, py_float_repr, py_json_str, py_truthy,
    request_root, valid_messages, ApproxPrompt, BadRequest, CompletionPrompt,
};

mod reuse;
pub use reuse::{PrefixStore, ReuseStats, DEFAULT_CAPACITY_TOKENS};

/// Texts longer than this are tokenized on tokio's blocking pool, so one long prompt does not stall
/// the (by default single-threaded) data plane; shorter ones are cheaper to encode in place than to hand over.
pub const INLINE_ENCODE_BYTES: usize = 4096;

/// Names the Python prompter passes to the template itself; `chat_template_kwargs` naming one of
/// them is a TypeError there (a 400).
const TEMPLATE_ARGS: [&str; 5] = ["messages", "add_generation_prompt", "tools", "bos_token", "eos_token"];

#[derive(Debug, thiserror::Error)]
pub enum ExactError {
    #[error("tokenizer file not found: {0} (expected a tokenizer.json or a directory holding one)")]
    NotFound(PathBuf),
    #[error("cannot load the tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("cannot read {path}: {reason}")]
    Config { path: PathBuf, reason: String },
}

/// The chat template as the data plane holds it.
enum ChatTemplate {
    /// tokenizer_config.json has none: chat requests get Python's 400.
    Missing,
    /// minijinja cannot compile what jinja2 accepted: chat requests route on approximate hashes, completions stay exact.
    Unsupported(String),
    Ready(Box<Environment<'static>>),
}

/// Exact mode's tokenizer and chat template (`ExactPrompter`), shared by the data plane's tasks.
pub struct ExactPrompter {
    tokenizer: Tokenizer,
    template: ChatTemplate,
    bos_token: String,
    eos_token: String,
    block_size: usize,
    seed: u64,
    /// The encoded prefixes of earlier prompts (src/exact/reuse.rs), or why this tokenizer has none.
    reuse: Result<PrefixStore, String>,
}

impl ExactPrompter {
    /// Loads `path` (a tokenizer.json or its directory) and the chat template of the
    /// tokenizer_config.json beside it, as `ExactPrompter.__init__` does.
    pub fn load(path: &Path, block_size: usize, seed: u64) -> Result<ExactPrompter, ExactError> {
        let tok_file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
        if !tok_file.is_file() {
            return Err(ExactError::NotFound(tok_file));
        }
        let tokenizer =
            Tokenizer::from_file(&tok_file).map_err(|e| ExactError::Tokenizer { path: tok_file.clone(), reason: e.to_string() })?;
        let cfg_file = tok_file.parent().unwrap_or(Path::new(".")).join("tokenizer_config.json");
        let config: Map<String, Value> = if cfg_file.is_file() {
            let text =
                std::fs::read_to_string(&cfg_file).map_err(|e| ExactError::Config { path: cfg_file.clone(), reason: e.to_string() })?;
            match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(m)) => m,
                Ok(_) => return Err(ExactError::Config { path: cfg_file, reason: "expected a JSON object".into() }),
                Err(e) => return Err(ExactError::Config { path: cfg_file, reason: e.to_string() }),
            }
        } else {
            Map::new()
        };
        let template = match chat_template_source(config.get("chat_template")) {
            Ok(None) => ChatTemplate::Missing,
            Ok(Some(src)) => match compile(src) {
                Ok(env) => ChatTemplate::Ready(Box::new(env)),
                Err(e) => ChatTemplate::Unsupported(e.to_string()),
            },
            Err(reason) => return Err(ExactError::Config { path: cfg_file, reason }),
        };
        // KVROUTE_PREFIX_REUSE=off: every prompt encoded whole (a benchmark's baseline, or a tokenizer
        // that would pass the probes and still split differently).
        let reuse = match std::env::var("KVROUTE_PREFIX_REUSE").as_deref() {
            Ok("off") | Ok("0") => Err("turned off (KVROUTE_PREFIX_REUSE=off)".to_string()),
            _ => PrefixStore::new(&tokenizer, DEFAULT_CAPACITY_TOKENS),
        };
        Ok(ExactPrompter {
            reuse,
            tokenizer,
            template,
            bos_token: special(&config, "bos_token"),
            eos_token: special(&config, "eos_token"),
            block_size,
            seed,
        })
    }

    /// Tokens per hashed block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The block hashes' seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The prefix store's counters (`None`: this tokenizer has none, see `prefix_reuse_unavailable`).
    pub fn prefix_reuse(&self) -> Option<ReuseStats> {
        self.reuse.as_ref().ok().map(PrefixStore::stats)
    }

    /// Why this tokenizer's prompts are always encoded whole, when they are.
    pub fn prefix_reuse_unavailable(&self) -> Option<&str> {
        self.reuse.as_ref().err().map(String::as_str)
    }

    /// Why chat requests route on approximate hashes, when they do (the template does not compile in minijinja).
    pub fn template_unsupported(&self) -> Option<&str> {
        match &self.template {
            ChatTemplate::Unsupported(reason) => Some(reason),
            _ => None,
        }
    }

    /// `render_chat`: the chat template applied to the request; `Ok(None)` when it cannot be
    /// rendered exactly here.
    pub fn render_chat(&self, body: &Value) -> Result<Option<String>, BadRequest> {
        let body = object(body)?;
        let msgs = valid_messages(body)?;
        let env = match &self.template {
            ChatTemplate::Missing => {
                return Err(BadRequest("this tokenizer has no chat_template in tokenizer_config.json; use /v1/completions".into()))
            }
            ChatTemplate::Unsupported(_) => return Ok(None),
            ChatTemplate::Ready(env) => env,
        };
        let mut ctx = Map::new();
        // Python: chat_template_kwargs `or {}`, so any falsy value means none; a non-dict is a TypeError.
        match body.get("chat_template_kwargs") {
            None | Some(Value::Null) => {}
            Some(Value::Object(kw)) => {
                for (k, v) in kw {
                    if TEMPLATE_ARGS.contains(&k.as_str()) {
                        return Err(BadRequest(format!("chat_template_kwargs may not set {k:?}: the gateway passes it to the template")));
                    }
                    ctx.insert(k.clone(), v.clone());
                }
            }
            Some(v) if !py_truthy(v) => {}
            Some(_) => return Err(BadRequest("chat_template_kwargs must be an object".into())),
        }
        ctx.insert("messages".into(), Value::Array(msgs.to_vec()));
        ctx.insert("add_generation_prompt".into(), body.get("add_generation_prompt").cloned().unwrap_or(Value::Bool(true)));
        ctx.insert("tools".into(), body.get("tools").cloned().unwrap_or(Value::Null));
        ctx.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        let Ok(tmpl) = env.get_template("chat") else { return Ok(None) };
        match catch_unwind(AssertUnwindSafe(|| tmpl.render(TemplateValue::from_serialize(&ctx)))) {
            Ok(Ok(text)) => Ok(Some(text)),
            Ok(Err(e)) => match e.detail() {
                // The template's own `raise_exception`: the request is invalid for this model.
                Some(d) if e.kind() == ErrorKind::InvalidOperation && d.starts_with(RAISED) => Err(BadRequest(d.to_string())),
                _ => Ok(None),
            },
            Err(_) => Ok(None),
        }
    }

    /// The token ids the engine sees for this request (`ExactPrompter.prompt` before hashing);
    /// `Ok(None)` when they cannot be derived exactly here.
    pub fn token_ids(&self, body: &Value, chat: bool) -> Result<Option<Vec<u32>>, BadRequest> {
        Ok(match self.text(body, chat)? {
            None => None,
            Some(PromptText::Ids(ids)) => Some(ids),
            Some(PromptText::Text(text, add_special)) => self.encode(&text, add_special),
        })
    }

    /// The routed prompt of a parsed request body (`Ok(None)`: not reproducible exactly here).
    /// `lora`: the LoRA adapter serving it; with the body's `cache_salt` it keys the blocks.
    pub fn prompt(&self, body: &Value, chat: bool, lora: Option<&str>) -> Result<Option<ApproxPrompt>, BadRequest> {
        match self.token_ids(body, chat)? {
            Some(ids) => self.hash(body, ids, lora).map(Some),
            None => Ok(None),
        }
    }

    /// What the data plane routes a body on in exact mode: its exact prompt, or, for a valid body
    /// not reproducible exactly here, its approximate hashes; the flag is true when exact.
    pub fn routed_prompt(&self, body: &Value, chat: bool, lora: Option<&str>) -> Result<(ApproxPrompt, bool), BadRequest> {
        let exact = self.prompt(body, chat, lora)?;
        self.or_approx(body, chat, exact, lora)
    }

    /// `exact` (an outcome of `prompt` / `prompt_async`), or the body's approximate hashes in its place.
    pub fn or_approx(
        &self,
        body: &Value,
        chat: bool,
        exact: Option<ApproxPrompt>,
        lora: Option<&str>,
    ) -> Result<(ApproxPrompt, bool), BadRequest> {
        match exact {
            Some(p) => Ok((p, true)),
            None => {
                let approx = approx_prompt_of(body, chat, self.block_size, self.seed, false, lora)?;
                match self.media_prefix(body, chat, lora, approx.num_tokens)? {
                    Some(p) => Ok((p, false)),
                    None => Ok((approx, false)),
                }
            }
        }
    }

    /// A chat with media: the engine's tokens hold the media's placeholders, which only its processor
    /// expands, so the exact tokens are those of the conversation before the message holding the
    /// first media part (rendered without a generation prompt: a prefix of the engine's prompt for
    /// templates that render turn by turn; where it is not, its blocks simply do not match). Never
    /// credited with more than that; `None` when the first message holds media or the prefix does
    /// not render. `num_tokens` stays the whole prompt's estimate (`estimate`, at least the prefix).
    fn media_prefix(&self, body: &Value, chat: bool, lora: Option<&str>, estimate: u64) -> Result<Option<ApproxPrompt>, BadRequest> {
        let obj = object(body)?;
        if !chat {
            return Ok(None);
        }
        let Some(i) = first_media_message(obj).filter(|&i| i > 0) else { return Ok(None) };
        let msgs = valid_messages(obj)?;
        let mut prefix = obj.clone();
        prefix.insert("messages".into(), Value::Array(msgs[..i].to_vec()));
        prefix.insert("add_generation_prompt".into(), Value::Bool(false));
        let Some(text) = self.render_chat(&Value::Object(prefix))? else { return Ok(None) };
        let Some(ids) = self.encode(&text, false) else { return Ok(None) };
        if ids.is_empty() {
            return Ok(None);
        }
        let mut p = self.hash(body, ids, lora)?;
        p.num_tokens = p.num_tokens.max(estimate);
        Ok(Some(p))
    }

    /// `prompt` off the runtime thread for long texts (see `INLINE_ENCODE_BYTES`).
    pub async fn prompt_async(self: &Arc<Self>, body: &Value, chat: bool, lora: Option<&str>) -> Result<Option<ApproxPrompt>, BadRequest> {
        let ids = match self.text(body, chat)? {
            None => None,
            Some(PromptText::Ids(ids)) => Some(ids),
            Some(PromptText::Text(text, add_special)) if text.len() <= INLINE_ENCODE_BYTES => self.encode(&text, add_special),
            Some(PromptText::Text(text, add_special)) => {
                let me = self.clone();
                tokio::task::spawn_blocking(move || me.encode(&text, add_special)).await.ok().flatten()
            }
        };
        match ids {
            Some(ids) => self.hash(body, ids, lora).map(Some),
            None => Ok(None),
        }
    }

    /// The text to encode (and whether to add special tokens: yes for completions, as the engines
    /// do; no for chat, whose template carries them), or the prompt's own token ids.
    fn text(&self, body: &Value, chat: bool) -> Result<Option<PromptText>, BadRequest> {
        if chat {
            let text = self.render_chat(body)?;
            // A chat with media: the engine's tokens hold the media's placeholders, which only the
            // engine's processor expands; routed on its approximate text prefix (`approx_prompt_of`).
            if has_media(object(body)?) {
                return Ok(None);
            }
            // Validated like a rendered prompt would be, so a fallback body is a valid one.
            output_tokens(object(body)?)?;
            return Ok(text.map(|t| PromptText::Text(t, false)));
        }
        let body = object(body)?;
        output_tokens(body)?;
        Ok(Some(match completion_prompt(body)? {
            CompletionPrompt::Text(s) => PromptText::Text(s.to_string(), true),
            CompletionPrompt::Ids(ids) => PromptText::Ids(ids),
        }))
    }

    /// `text`'s token ids, reusing a stored prefix's when the post-processor adds nothing (chat).
    fn encode(&self, text: &str, add_special_tokens: bool) -> Option<Vec<u32>> {
        match &self.reuse {
            Ok(store) if !add_special_tokens => store.encode(text, |t| self.encode_whole(t, false)),
            _ => self.encode_whole(text, add_special_tokens),
        }
    }

    fn encode_whole(&self, text: &str, add_special_tokens: bool) -> Option<Vec<u32>> {
        let enc = catch_unwind(AssertUnwindSafe(|| self.tokenizer.encode_fast(text, add_special_tokens))).ok()?.ok()?;
        Some(enc.get_ids().to_vec())
    }

    fn hash(&self, body: &Value, ids: Vec<u32>, lora: Option<&str>) -> Result<ApproxPrompt, BadRequest> {
        if ids.is_empty() {
            return Err(BadRequest("empty prompt".into()));
        }
        let body = object(body)?;
        let output_tokens = output_tokens(body)?;
        let root = request_root(body, lora)?;
        let hashes = kvroute_core::hash::sequence_hashes(&ids, self.block_size, self.seed, root);
        Ok(ApproxPrompt { hashes, num_tokens: ids.len() as u64, output_tokens })
    }
}

/// How `raise_exception`'s error message starts (the Python prompter's BadRequest message).
const RAISED: &str = "chat template: ";

enum PromptText {
    Text(String, bool),
    Ids(Vec<u32>),
}

/// `ExactPrompter._special`: a string, or the `content` of an AddedToken object; else "".
fn special(cfg: &Map<String, Value>, key: &str) -> String {
    let v = match cfg.get(key) {
        Some(Value::Object(o)) => o.get("content"),
        other => other,
    };
    v.and_then(Value::as_str).unwrap_or("").to_string()
}

/// `_compile_template`'s choice: a string, or the "default" (else first) of named templates.
fn chat_template_source(t: Option<&Value>) -> Result<Option<String>, String> {
    let t = match t {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(items)) => {
            // Python builds a dict name -> template: later duplicates win, order of first appearance kept.
            let mut named: Vec<(Value, Value)> = Vec::new();
            for it in items.iter().filter_map(Value::as_object) {
                let name = it.get("name").cloned().unwrap_or(Value::Null);
                let tmpl = it.get("template").cloned().unwrap_or(Value::Null);
                match named.iter_mut().find(|(n, _)| *n == name) {
                    Some(slot) => slot.1 = tmpl,
                    None => named.push((name, tmpl)),
                }
            }
            let default = named.iter().find(|(n, _)| n.as_str() == Some("default")).map(|(_, t)| t.clone());
            match default.filter(py_truthy) {
                Some(t) => t,
                None => named.into_iter().next().map(|(_, t)| t).unwrap_or(Value::Null),
            }
        }
        Some(other) => other.clone(),
    };
    match t {
        Value::String(s) => Ok(Some(s)),
        _ => Err("chat_template must be a string or a list of {name, template}".into()),
    }
}

/// A minijinja environment configured like the Python prompter's jinja2 sandbox (trim_blocks,
/// lstrip_blocks, `raise_exception`), with Python's string methods and Python's way of printing values.
fn compile(source: String) -> Result<Environment<'static>, TemplateError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(py_method);
    env.set_formatter(py_format);
    env.add_function("raise_exception", |msg: String| -> Result<TemplateValue, TemplateError> {
        Err(TemplateError::new(ErrorKind::InvalidOperation, format!("{RAISED}{msg}")))
    });
    env.add_filter("tojson", tojson);
    // jinja2's trim and string filters call str() first: None is "None" there.
    env.add_filter("trim", |v: &TemplateValue, chars: Option<&str>| py_str(v).map(|s| py_strip(&s, chars, true, true).to_string()));
    env.add_filter("string", |v: &TemplateValue| py_str(v).map(TemplateValue::from));
    env.add_template_owned("chat", source)?;
    Ok(env)
}

/// Python's whitespace (`str.isspace`): Unicode White_Space plus the separators U+001C..U+001F.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `str.strip` / `lstrip` / `rstrip` with Python's whitespace, or the given characters.
fn py_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let strip = |c: char| chars.map_or_else(|| py_space(c), |cs| cs.contains(c));
    let s = if left { s.trim_start_matches(strip) } else { s };
    if right {
        s.trim_end_matches(strip)
    } else {
        s
    }
}

/// Python's string methods: whitespace-sensitive ones with Python's whitespace, the rest from
/// minijinja-contrib's pycompat.
fn py_method(state: &State, value: &TemplateValue, method: &str, args: &[TemplateValue]) -> Result<TemplateValue, TemplateError> {
    if let (Some(s), "strip" | "lstrip" | "rstrip" | "split" | "isspace") = (value.as_str(), method) {
        let chars = match args {
            [] => None,
            [a] if a.is_none() => None,
            [a] if method != "split" && method != "isspace" => {
                Some(a.as_str().ok_or_else(|| TemplateError::from(ErrorKind::InvalidOperation))?)
            }
            _ => return minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
        };
        return Ok(match method {
            "strip" => TemplateValue::from(py_strip(s, chars, true, true)),
            "lstrip" => TemplateValue::from(py_strip(s, chars, true, false)),
            "rstrip" => TemplateValue::from(py_strip(s, chars, false, true)),
            "split" => TemplateValue::from(s.split(py_space).filter(|w| !w.is_empty()).map(TemplateValue::from).collect::<Vec<_>>()),
            _ => TemplateValue::from(!s.is_empty() && s.chars().all(py_space)),
        });
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Prints a value as jinja2 does (`str()` of the Python object): None as "None", booleans as
/// "True"/"False", floats as Python's repr. Lists and dicts are refused (Python's repr of them is
/// not reproduced): the render fails and the request routes on its approximate hashes.
fn py_format(out: &mut Output, _state: &State, v: &TemplateValue) -> Result<(), TemplateError> {
    let text = py_str(v)?;
    out.write_str(&text).map_err(|e| TemplateError::new(ErrorKind::WriteFailure, e.to_string()))
}

/// Python's `str()` of a template value, for the kinds whose rendering is reproduced here.
fn py_str(v: &TemplateValue) -> Result<String, TemplateError> {
    Ok(match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => (if v.is_true() { "True" } else { "False" }).into(),
        ValueKind::Number if v.is_integer() => v.to_string(),
        ValueKind::Number => py_float_repr(f64::try_from(v.clone())?),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        kind => return Err(TemplateError::new(ErrorKind::InvalidOperation, format!("printing a {kind} is not reproduced exactly"))),
    })
}

/// jinja2's `tojson`: `json.dumps(v, sort_keys=True[, indent=n])` with `<`, `>`, `&`, `'` escaped.
fn tojson(value: &TemplateValue, indent: Option<TemplateValue>, kwargs: Kwargs) -> Result<TemplateValue, TemplateError> {
    let kw_indent: Option<TemplateValue> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let indent = match indent.or(kw_indent) {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.is_integer() => Some(usize::try_from(v.as_i64().unwrap_or(-1)).unwrap_or(0)),
        Some(_) => return Err(TemplateError::new(ErrorKind::InvalidOperation, "tojson: indent must be an integer")),
    };
    let mut out = String::new();
    dumps(value, indent, 0, &mut out)?;
    let escaped = out.replace('<', "\\u003c").replace('>', "\\u003e").replace('&', "\\u0026").replace('\'', "\\u0027");
    Ok(TemplateValue::from_safe_string(escaped))
}

/// Python's `json.dumps(sort_keys=True)` (ASCII output) over a template value; non-JSON values are refused.
fn dumps(v: &TemplateValue, indent: Option<usize>, depth: usize, out: &mut String) -> Result<(), TemplateError> {
    let refuse = |what: &str| Err(TemplateError::new(ErrorKind::InvalidOperation, format!("tojson of {what} is not reproduced exactly")));
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&py_float_repr(f64::try_from(v.clone())?)),
        ValueKind::String => py_json_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            let items: Vec<TemplateValue> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    if indent.is_none() {
                        out.push(' ');
                    }
                }
                newline(out, depth + 1);
                dumps(item, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, TemplateValue)> = Vec::new();
            for k in v.try_iter()? {
                let Some(key) = k.as_str() else { return refuse("a map with non-string keys") };
                entries.push((key.to_string(), v.get_item(&k)?));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    if indent.is_none() {
                        out.push(' ');
                    }
                }
                newline(out, depth + 1);
                py_json_str(k, out);
                out.push_str(": ");
                dumps(item, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        kind => return refuse(&kind.to_string()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, ctx: Value) -> Result<String, String> {
        let env = compile(src.to_string()).map_err(|e| e.to_string())?;
        let t = env.get_template("chat").map_err(|e| e.to_string())?;
        t.render(TemplateValue::from_serialize(&ctx)).map_err(|e| e.to_string())
    }

    #[test]
    fn values_print_as_python_does() {
        let ctx = json!({"n": null, "t": true, "f": false, "i": -3, "s": "x"});
        assert_eq!(render("{{ n }}|{{ t }}|{{ f }}|{{ i }}|{{ s }}|{{ missing }}", ctx.clone()).unwrap(), "None|True|False|-3|x|");
        assert_eq!(render("{{ n|trim }}|{{ t|string }}|{{ i|string }}", ctx).unwrap(), "None|True|-3");
        for refused in ["{{ [1] }}", "{{ {'a': 1} }}"] {
            assert!(render(refused, json!({})).is_err(), "{refused}");
        }
        assert_eq!(render("{{ f }}|{{ g }}", json!({"f": 0.5, "g": 1e20})).unwrap(), "0.5|1e+20", "floats as Python's repr");
    }

    #[test]
    fn tojson_matches_jinja2() {
        let ctx = json!({"v": {"b": [1, "<a&b>'"], "a": null, "é": true}, "e": [], "m": {}});
        assert_eq!(
            render("{{ v|tojson }}", ctx.clone()).unwrap(),
            r#"{"a": null, "b": [1, "\u003ca\u0026b\u003e\u0027"], "\u00e9": true}"#
        );
        assert_eq!(
            render("{{ v|tojson(indent=2) }}", ctx.clone()).unwrap(),
            "{\n  \"a\": null,\n  \"b\": [\n    1,\n    \"\\u003ca\\u0026b\\u003e\\u0027\"\n  ],\n  \"\\u00e9\": true\n}"
        );
        assert_eq!(render("{{ e|tojson(2) }}{{ m|tojson }}", ctx).unwrap(), "[]{}");
        assert_eq!(render("{{ f|tojson }}", json!({"f": 1.5})).unwrap(), "1.5");
    }

    #[test]
    fn trim_lstrip_python_methods_and_raise_exception() {
        // Expected outputs are jinja2's (trim_blocks=True, lstrip_blocks=True).
        let ctx = json!({"messages": [{"content": " a "}, {"content": "b\n"}]});
        let src = "{% for m in messages %}\n  {{ m.content.strip() }}{% if not loop.last %},{% endif %}\n{% endfor %}";
        assert_eq!(render(src, ctx.clone()).unwrap(), "  a,  b");
        let src = "{% for m in messages %}\n  {% if m %}{{ m.content.strip() }}{% endif %}\n{% endfor %}";
        assert_eq!(render(src, ctx).unwrap(), "ab");
        let ctx = json!({"s": "\u{1f} a\u{a0}\u{1c}"});
        assert_eq!(
            render("[{{ s.strip() }}|{{ s.lstrip() }}|{{ s|trim }}|{{ s.split()|length }}|{{ 'xax'.strip('x') }}]", ctx).unwrap(),
            "[a|a\u{a0}\u{1c}|a|1|a]"
        );
        let err = render("{{ raise_exception('no system role') }}", json!({})).unwrap_err();
        assert!(err.contains("chat template: no system role"), "{err}");
        assert_eq!(render("{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", json!({})).unwrap(), "1");
    }

    #[test]
    fn template_choice_follows_python() {
        assert_eq!(chat_template_source(None).unwrap(), None);
        assert_eq!(chat_template_source(Some(&json!("t"))).unwrap().as_deref(), Some("t"));
        let named = json!([{"name": "tool_use", "template": "a"}, {"name": "default", "template": "b"}]);
        assert_eq!(chat_template_source(Some(&named)).unwrap().as_deref(), Some("b"));
        let no_default = json!([{"name": "x", "template": "a"}, {"name": "default", "template": ""}]);
        assert_eq!(chat_template_source(Some(&no_default)).unwrap().as_deref(), Some("a"));
        assert!(chat_template_source(Some(&json!(3))).is_err());
        assert!(chat_template_source(Some(&json!([]))).is_err(), "Python refuses a list without templates");
    }

    /// A word-level tokenizer.json (whitespace split, `<s>` added to completions prompts) and a
    /// tokenizer_config.json with `template`, in a fresh directory.
    fn word_level(name: &str, template: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvroute-exact-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let words = ["<s>", "</s>", "[UNK]", "<|user|>", "the", "sky", "is", "blue"];
        let vocab: Map<String, Value> = words.iter().enumerate().map(|(i, w)| (w.to_string(), json!(i))).collect();
        let bos = json!({"SpecialToken": {"id": "<s>", "type_id": 0}});
        let seq = |id: &str| json!({"Sequence": {"id": id, "type_id": 0}});
        let tok = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": {"type": "TemplateProcessing", "single": [bos, seq("A")], "pair": [bos, seq("A"), seq("B")],
                               "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        let cfg = json!({"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        dir
    }

    #[test]
    fn media_credits_the_conversation_before_it_never_more() {
        let dir = word_level("media", "{{ bos_token }}{% for m in messages %}<|user|> {{ m.content }} {% endfor %}");
        let ex = ExactPrompter::load(&dir, 2, 7).unwrap();
        let img = json!({"type": "image_url", "image_url": {"url": "http://x/1.png"}});
        let text = json!({"messages": [{"role": "user", "content": "the sky is blue the sky"}]});
        let media = json!({"messages": [{"role": "user", "content": "the sky is blue the sky"},
                                        {"role": "user", "content": [{"type": "text", "text": "is"}, img]}]});
        let (t, exact_t) = ex.routed_prompt(&text, true, None).unwrap();
        let (m, exact_m) = ex.routed_prompt(&media, true, None).unwrap();
        assert!(exact_t && !exact_m, "a media prompt's length is an estimate: not exact");
        assert_eq!(ex.token_ids(&media, true), Ok(None));
        // The first message alone renders to the same tokens as the text-only prompt: same keys.
        assert_eq!(m.hashes, t.hashes);
        assert!(m.num_tokens >= t.num_tokens);
        // Under an adapter, the same prefix is keyed by it.
        let (ml, _) = ex.routed_prompt(&media, true, Some("a")).unwrap();
        assert_ne!(ml.hashes, m.hashes);
        // Media in the first message: nothing exact to credit (the approximate text prefix instead).
        let first = json!({"messages": [{"role": "user", "content": [img.clone(), {"type": "text", "text": "the sky"}]}]});
        let (f, exact_f) = ex.routed_prompt(&first, true, None).unwrap();
        // ("<|user|>", 8 bytes, is the approximate text before the image: one 2-token block.)
        assert!(!exact_f && f.hashes.len() == 1);
    }

    #[test]
    fn prompts_tokenize_render_and_hash() {
        let dir = word_level("prompts", "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}");
        let ex = ExactPrompter::load(&dir, 2, 7).unwrap();
        // Completions text: special tokens added (the engines do); chat: the template carries them.
        assert_eq!(ex.token_ids(&json!({"prompt": "the sky is blue"}), false), Ok(Some(vec![0, 4, 5, 6, 7])));
        let chat = json!({"messages": [{"role": "user", "content": "the sky"}], "max_tokens": 3});
        assert_eq!(ex.render_chat(&chat).unwrap().as_deref(), Some("<s><|user|> the sky "));
        assert_eq!(ex.token_ids(&chat, true), Ok(Some(vec![2, 4, 5])), "<s><|user|> is one unknown word");
        let p = ex.prompt(&chat, true, None).unwrap().unwrap();
        assert_eq!((p.num_tokens, p.output_tokens), (3, Some(3)));
        assert_eq!(p.hashes, kvroute_core::hash::sequence_hashes(&[2, 4, 5], 2, 7, None));
        assert_eq!(ex.token_ids(&json!({"prompt": [[9, 8, 7]]}), false), Ok(Some(vec![9, 8, 7])), "token ids are used as they are");
        for invalid in [
            json!({"prompt": [1, -1]}),
            json!({"prompt": "x", "max_tokens": -1}),
            json!({"messages": []}),
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": "3"}),
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}}),
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}),
        ] {
            let chat = invalid.get("messages").is_some();
            assert!(ex.prompt(&invalid, chat, None).is_err(), "{invalid}");
        }
        // Valid, but printing a list is not reproduced exactly: the plane routes it approximately.
        let printed_list = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "printed list"}]}]});
        assert_eq!(ex.prompt(&printed_list, true, None), Ok(None));
        // Long texts are encoded on the blocking pool: the same prompt.
        let long = json!({"prompt": "the sky is blue ".repeat(INLINE_ENCODE_BYTES / 8)});
        let ex = Arc::new(ex);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (a, b) = rt.block_on(async { (ex.prompt_async(&long, false, None).await, ex.prompt_async(&chat_body(), true, None).await) });
        assert_eq!(a, ex.prompt(&long, false, None));
        assert!(a.unwrap().is_some_and(|p| p.num_tokens as usize == 1 + INLINE_ENCODE_BYTES / 2));
        assert_eq!(b, ex.prompt(&chat_body(), true, None));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn chat_body() -> Value {
        json!({"messages": [{"role": "user", "content": "the sky"}]})
    }

    #[test]
    fn unsupported_template_leaves_chat_to_approximate_hashes() {
        let dir = word_level("unsupported", "{% for m in messages %}{{ m.content | no_such_filter_anywhere(1) }}{% endfor %}{% endfor %}");
        let ex = ExactPrompter::load(&dir, 2, 7).unwrap();
        assert!(ex.template_unsupported().is_some());
        assert_eq!(ex.prompt(&chat_body(), true, None), Ok(None));
        assert!(ex.prompt(&json!({"prompt": "the sky"}), false, None).unwrap().is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_tokenizer_is_a_clear_error() {
        let err = ExactPrompter::load(Path::new("/nonexistent/dir/tokenizer.json"), 16, 1).err().unwrap();
        assert!(err.to_string().contains("tokenizer file not found"), "{err}");
    }
}
