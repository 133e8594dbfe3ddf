//! The Router's configuration as flat named parameters (`kvroute.Router(policy=..., ttft_slo=...)`
//! in Python, the CLIs' flags): one table that maps each name to its place in `RouterConfig`.

use super::config::{DecodeRule, Preset, RouterConfig, TieBreak, TtftModel};
use super::policy::PolicyConfig;
use super::RouterError;

/// A parameter's value as the bindings pass it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
}

/// What a parameter accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Bool,
    /// An integer >= 0.
    Int,
    Float,
    /// A number, or None.
    OptFloat,
    /// One of these names.
    Choice(&'static [&'static str]),
}

impl Kind {
    /// The Python type this kind takes, as the stub spells it.
    pub fn python_type(self) -> String {
        match self {
            Kind::Bool => "bool".into(),
            Kind::Int => "int".into(),
            Kind::Float => "float".into(),
            Kind::OptFloat => "float | None".into(),
            Kind::Choice(names) => format!("Literal[{}]", names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")),
        }
    }
}

/// One named parameter.
pub struct Param {
    pub name: &'static str,
    pub kind: Kind,
    /// The policies it belongs to (empty: it applies whatever the policy).
    pub policies: &'static [&'static str],
    /// One line for a CLI's help.
    pub help: &'static str,
    get: fn(&RouterConfig) -> Option<Value>,
    set: fn(&mut RouterConfig, Value) -> Option<()>,
}

impl Param {
    /// Its value in `cfg`; None when it belongs to another policy than `cfg`'s.
    pub fn get(&self, cfg: &RouterConfig) -> Option<Value> {
        (self.get)(cfg)
    }

    /// Its default under `preset` (for a policy's parameter, that policy's default).
    pub fn default_value(&self, preset: Preset) -> Value {
        let mut cfg = RouterConfig::preset(preset);
        if let Some(p) = self.policies.first() {
            cfg.policy = PolicyConfig::named(p).expect("a known policy");
        }
        self.get(&cfg).expect("a parameter of the config's policy")
    }

    /// Sets it in `cfg`: the value must be of its kind, and a policy's parameter needs that policy.
    pub fn set(&self, cfg: &mut RouterConfig, v: Value) -> Result<(), RouterError> {
        let v = self.check_kind(v)?;
        match (&v, self.kind) {
            (Value::Int(i), _) if *i < 0 || *i > u64::MAX as i128 => {
                return Err(RouterError::InvalidConfig(format!("{} must be an integer >= 0, got {i}", self.name)));
            }
            (Value::Str(s), Kind::Choice(names)) if !names.contains(&s.as_str()) => {
                return Err(RouterError::InvalidConfig(format!("unknown {} {s:?}; expected one of {}", self.name, names.join(", "))));
            }
            _ => {}
        }
        if !self.policies.is_empty() && !self.policies.contains(&cfg.policy.name()) {
            return Err(RouterError::InvalidConfig(format!(
                "{} is a parameter of the {} policy, not of {:?}",
                self.name,
                self.policies.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(" and "),
                cfg.policy.name()
            )));
        }
        (self.set)(cfg, v).ok_or_else(|| RouterError::InvalidConfig(format!("{} cannot be set here", self.name)))
    }

    /// `v` if it is of this parameter's kind (an int where a number is expected becomes a float).
    pub fn check_kind(&self, v: Value) -> Result<Value, RouterError> {
        let bad = |v: &Value| {
            let want = match self.kind {
                Kind::Bool => "True or False".to_string(),
                Kind::Int => "an integer".to_string(),
                Kind::Float => "a number".to_string(),
                Kind::OptFloat => "a number or None".to_string(),
                Kind::Choice(_) => "a str".to_string(),
            };
            RouterError::InvalidConfig(format!("{} must be {want}, got {}", self.name, describe(v)))
        };
        match (self.kind, v) {
            (Kind::Bool, v @ Value::Bool(_)) => Ok(v),
            (Kind::Int, v @ Value::Int(_)) => Ok(v),
            (Kind::Float | Kind::OptFloat, Value::Int(i)) => Ok(Value::Float(i as f64)),
            (Kind::Float | Kind::OptFloat, v @ Value::Float(_)) => Ok(v),
            (Kind::OptFloat, Value::None) => Ok(Value::None),
            (Kind::Choice(_), v @ Value::Str(_)) => Ok(v),
            (_, v) => Err(bad(&v)),
        }
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::None => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Int(i) => i.to_string(),
        Value::Float(f) => f.to_string(),
        Value::Str(s) => format!("{s:?}"),
    }
}

trait FromValue: Sized {
    fn from_value(v: Value) -> Option<Self>;
}
impl FromValue for bool {
    fn from_value(v: Value) -> Option<Self> {
        if let Value::Bool(b) = v {
            Some(b)
        } else {
            None
        }
    }
}
impl FromValue for f64 {
    fn from_value(v: Value) -> Option<Self> {
        if let Value::Float(f) = v {
            Some(f)
        } else {
            None
        }
    }
}
impl FromValue for Option<f64> {
    fn from_value(v: Value) -> Option<Self> {
        match v {
            Value::None => Some(None),
            Value::Float(f) => Some(Some(f)),
            _ => None,
        }
    }
}
impl FromValue for u64 {
    fn from_value(v: Value) -> Option<Self> {
        if let Value::Int(i) = v {
            u64::try_from(i).ok()
        } else {
            None
        }
    }
}
impl FromValue for usize {
    fn from_value(v: Value) -> Option<Self> {
        u64::from_value(v).and_then(|u| usize::try_from(u).ok())
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}
impl From<f64> for Value {
    fn from(f: f64) -> Self {
        Value::Float(f)
    }
}
impl From<Option<f64>> for Value {
    fn from(f: Option<f64>) -> Self {
        f.map_or(Value::None, Value::Float)
    }
}
impl From<u64> for Value {
    fn from(i: u64) -> Self {
        Value::Int(i as i128)
    }
}
impl From<usize> for Value {
    fn from(i: usize) -> Self {
        Value::Int(i as i128)
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.into())
    }
}
impl From<i32> for Value {
    fn from(i: i32) -> Self {
        Value::Int(i as i128)
    }
}
impl From<TieBreak> for Value {
    fn from(t: TieBreak) -> Self {
        Value::Str(t.name().into())
    }
}
impl From<DecodeRule> for Value {
    fn from(r: DecodeRule) -> Self {
        Value::Str(r.name().into())
    }
}
impl From<TtftModel> for Value {
    fn from(m: TtftModel) -> Self {
        Value::Str(m.name().into())
    }
}

/// A `RouterConfig` from flat parameters, not yet validated (`Router::new` validates):
/// `router_config!(policy: "slack", ttft_slo: Some(2.0))`, or from a base,
/// `router_config!(reject: false, ..cfg.clone())`. Panics on an unknown name or a wrong kind.
#[macro_export]
macro_rules! router_config {
    (@base) => { $crate::router::RouterConfig::default() };
    (@base $base:expr) => { $base };
    ($($name:ident : $v:expr),* $(, ..$base:expr)? $(,)?) => {{
        #[allow(unused_mut)]
        let mut c: $crate::router::RouterConfig = $crate::router_config!(@base $($base)?);
        $(
            $crate::router::params::param(stringify!($name))
                .unwrap_or_else(|| panic!("unknown router parameter {}", stringify!($name)))
                .set(&mut c, $crate::router::params::Value::from($v))
                .unwrap_or_else(|e| panic!("{e}"));
        )*
        c
    }};
    (..$base:expr) => { $base };
}

fn name_of(v: Value) -> Option<String> {
    if let Value::Str(s) = v {
        Some(s)
    } else {
        None
    }
}

/// A parameter of every policy at `$($path).+` in `RouterConfig`.
macro_rules! field {
    ($name:literal, $kind:ident, $help:literal, $($path:ident).+) => {
        Param {
            name: $name,
            kind: Kind::$kind,
            policies: &[],
            help: $help,
            get: |c| Some(Value::from(c.$($path).+)),
            set: |c, v| {
                c.$($path).+ = FromValue::from_value(v)?;
                Some(())
            },
        }
    };
}

/// A parameter of the policies whose `PolicyConfig` variants are listed, each holding it at
/// `$field` of its parameters (`$($via).*` inside them).
macro_rules! policy_field {
    ($name:literal, $kind:ident, $help:literal, [$($pname:literal),+], $field:ident, $($variant:ident $(. $via:ident)*),+) => {
        Param {
            name: $name,
            kind: Kind::$kind,
            policies: &[$($pname),+],
            help: $help,
            get: |c| match &c.policy {
                $(PolicyConfig::$variant(p) => Some(Value::from(p$(.$via)*.$field)),)+
                #[allow(unreachable_patterns)]
                _ => None,
            },
            set: |c, v| match &mut c.policy {
                $(PolicyConfig::$variant(p) => {
                    p$(.$via)*.$field = FromValue::from_value(v)?;
                    Some(())
                })+
                #[allow(unreachable_patterns)]
                _ => None,
            },
        }
    };
}

/// Every parameter, in the order the Python constructor documents them.
pub static PARAMS: &[Param] = &[
    Param {
        name: "policy",
        kind: Kind::Choice(PolicyConfig::NAMES),
        policies: &[],
        help: "routing policy (docs/router.md)",
        get: |c| Some(Value::Str(c.policy.name().into())),
        set: |c, v| {
            c.policy = PolicyConfig::named(&name_of(v)?)?;
            Some(())
        },
    },
    field!("block_size", Int, "tokens per KV block (the engines' block size)", block_size),
    Param {
        name: "tie_break",
        kind: Kind::Choice(TieBreak::NAMES),
        policies: &[],
        help: "ties between equal scores: rotate (least loaded, then in turn) or lowest (worker id)",
        get: |c| Some(Value::Str(c.tie_break.name().into())),
        set: |c, v| {
            c.tie_break = TieBreak::from_name(&name_of(v)?)?;
            Some(())
        },
    },
    field!("seed", Int, "seed of the router's random choices", seed),
    field!("ttft_slo", OptFloat, "TTFT SLO in seconds", admission.ttft_slo),
    field!("tpot_slo", OptFloat, "TPOT SLO in seconds", decode.tpot_slo),
    field!("reject", Bool, "early rejection of requests predicted to miss an SLO", admission.reject),
    field!("admission_work_factor", OptFloat, "size-aware admission factor (default: the policy's)", admission.work_factor),
    field!("shed_load_threshold", Float, "offered load (x capacity) where size-aware shedding starts", admission.shed_load_threshold),
    field!("shed_load_ramp", Float, "offered load over which shedding ramps up to the full factor", admission.shed_load_ramp),
    field!("shed_load_sigmas", Float, "standard errors the offered load must clear before shedding", admission.shed_load_sigmas),
    field!(
        "load_window_s",
        OptFloat,
        "time constant of the load estimates in seconds (default 5 x ttft_slo, or 10)",
        admission.load_window_s
    ),
    policy_field!(
        "cache_threshold",
        Float,
        "matched fraction above which the best-overlap worker wins",
        ["cache_aware"],
        cache_threshold,
        CacheAware
    ),
    policy_field!(
        "balance_abs_threshold",
        Float,
        "in-flight gap that counts as imbalance",
        ["cache_aware"],
        balance_abs_threshold,
        CacheAware
    ),
    policy_field!(
        "balance_rel_threshold",
        Float,
        "max/min in-flight ratio that counts as imbalance",
        ["cache_aware"],
        balance_rel_threshold,
        CacheAware
    ),
    policy_field!("prefill_load_scale", Float, "weight of prefill blocks against decode blocks", ["cost"], prefill_load_scale, Cost),
    policy_field!("temperature", Float, "softmax temperature over normalised costs (0: the minimum)", ["cost"], temperature, Cost),
    policy_field!("queue_weight", Float, "weight of the queueing delay", ["capacity", "slack"], queue_weight, Capacity.slack, Slack),
    policy_field!(
        "prefill_weight",
        Float,
        "weight of the uncached prefill time",
        ["capacity", "slack"],
        prefill_weight,
        Capacity.slack,
        Slack
    ),
    policy_field!(
        "pressure_weight",
        Float,
        "weight of the queueing imposed on later requests",
        ["capacity", "slack"],
        pressure_weight,
        Capacity.slack,
        Slack
    ),
    policy_field!(
        "slo_margin",
        Float,
        "fraction of the TTFT SLO held back when judging feasibility",
        ["capacity", "slack"],
        slo_margin,
        Capacity.slack,
        Slack
    ),
    policy_field!("eviction_weight", Float, "weight of the recompute of what a placement evicts", ["slack"], eviction_weight, Slack),
    field!("kv_headroom", Float, "decode KV headroom: room when used + need x (1 + headroom) <= capacity", decode.kv_headroom),
    field!("decode_step_s", Float, "decode step time at batch 0 in seconds (TPOT = step + batch / speed)", decode.step_s),
    Param {
        name: "decode_choice",
        kind: Kind::Choice(DecodeRule::NAMES),
        policies: &[],
        help: "PD mode: decode worker by lowest predicted TPOT, or the seed documents' score",
        get: |c| Some(Value::Str(c.decode.rule.name().into())),
        set: |c, v| {
            c.decode.rule = DecodeRule::from_name(&name_of(v)?)?;
            Some(())
        },
    },
    field!("kv_bytes_per_token", Float, "KV cache bytes per token (PD transfer time)", pd.kv_bytes_per_token),
    field!("link_bytes_per_s", Float, "KV transfer bandwidth in bytes per second", pd.link_bytes_per_s),
    field!("link_latency_s", Float, "KV transfer latency per transfer in seconds", pd.link_latency_s),
    field!("kv_compression", Float, "bytes sent per KV byte (0.5: fp8 transfer)", pd.kv_compression),
    field!(
        "local_prefill_max_tokens",
        Int,
        "PD mode: prompts with at most N uncached tokens prefill on the decode worker",
        pd.local_prefill_max_tokens
    ),
    field!(
        "prefill_busy_queue_s",
        OptFloat,
        "PD mode: prefill on the decode worker when prefill would queue longer",
        pd.prefill_busy_queue_s
    ),
    field!("optimistic_insert", Bool, "store each routed prefix in the index at once (no KV events)", cache_view.optimistic_insert),
    field!("pending_prefixes", Bool, "count a routed prefix as cached until its KV events can have arrived", cache_view.pending_prefixes),
    field!("pending_grace_s", Float, "seconds a pending prefix outlives its prefill", cache_view.pending_grace_s),
    field!("pending_ttl_s", Float, "seconds a pending prefix lasts when its prefill is never reported", cache_view.pending_ttl_s),
    field!("stale_overlaps", Bool, "correct queued requests' predictions when their blocks are evicted", cache_view.stale_overlaps),
    field!("hash_seed", Int, "seed of the block hashes (Dynamo's 1337)", hash_seed),
    Param {
        name: "ttft_model",
        kind: Kind::Choice(TtftModel::NAMES),
        policies: &[],
        help: "predicted TTFT from the configured speeds, or learned from finished prefills",
        get: |c| Some(Value::Str(c.ttft_model.name().into())),
        set: |c, v| {
            c.ttft_model = TtftModel::from_name(&name_of(v)?)?;
            Some(())
        },
    },
    field!("token_share_bound", OptFloat, "keep every worker within X times the mean routed prompt tokens (>= 1)", token_share_bound),
];

/// The parameter called `name`.
pub fn param(name: &str) -> Option<&'static Param> {
    PARAMS.iter().find(|p| p.name == name)
}

/// A validated config: `preset`'s defaults, then `policy` with its defaults, then `params` in order.
pub fn build<'a>(preset: Preset, params: impl IntoIterator<Item = (&'a str, Value)>) -> Result<RouterConfig, RouterError> {
    let mut cfg = RouterConfig::preset(preset);
    let mut rest = Vec::new();
    for (name, v) in params {
        let p = param(name).ok_or_else(|| {
            RouterError::InvalidConfig(format!("unknown parameter {name:?}; expected one of {}", names().collect::<Vec<_>>().join(", ")))
        })?;
        if rest.iter().any(|(q, _): &(&Param, Value)| q.name == name) {
            return Err(RouterError::InvalidConfig(format!("{name} given twice")));
        }
        rest.push((p, v));
    }
    // The policy first: its parameters are set on it.
    if let Some(i) = rest.iter().position(|(p, _)| p.name == "policy") {
        let (p, v) = rest.remove(i);
        p.set(&mut cfg, v)?;
    }
    for (p, v) in rest {
        p.set(&mut cfg, v)?;
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Every parameter's name.
pub fn names() -> impl Iterator<Item = &'static str> {
    PARAMS.iter().map(|p| p.name)
}

/// The parameters `cfg` has (those of its policy and every policy's), with their values.
pub fn values(cfg: &RouterConfig) -> impl Iterator<Item = (&'static str, Value)> + '_ {
    PARAMS.iter().filter_map(move |p| p.get(cfg).map(|v| (p.name, v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_reads_back_what_it_set() {
        for p in PARAMS {
            let def = p.default_value(Preset::Simulator);
            let mut cfg = RouterConfig::default();
            if let Some(pol) = p.policies.first() {
                cfg.policy = PolicyConfig::named(pol).unwrap();
            }
            p.set(&mut cfg, def.clone()).unwrap();
            assert_eq!(p.get(&cfg), Some(def), "{}", p.name);
        }
    }

    #[test]
    fn a_policy_parameter_needs_its_policy() {
        let e = build(Preset::Simulator, [("policy", Value::Str("ttft".into())), ("cache_threshold", Value::Float(0.5))]).unwrap_err();
        assert!(e.to_string().contains("cache_threshold is a parameter of the \"cache_aware\" policy"), "{e}");
        let c = build(Preset::Simulator, [("cache_threshold", Value::Float(0.5)), ("policy", Value::Str("cache_aware".into()))]).unwrap();
        assert_eq!(c.policy, PolicyConfig::CacheAware(crate::router::policy::CacheAware { cache_threshold: 0.5, ..Default::default() }));
    }

    #[test]
    fn bad_values_say_what_was_expected() {
        let cases: [(&str, Value, &str); 5] = [
            ("nope", Value::Int(1), "unknown parameter \"nope\""),
            ("block_size", Value::Int(-1), "block_size must be an integer >= 0, got -1"),
            ("reject", Value::Int(1), "reject must be True or False, got 1"),
            ("tie_break", Value::Str("x".into()), "unknown tie_break \"x\"; expected one of rotate, lowest"),
            ("ttft_slo", Value::Float(-1.0), "ttft_slo must be a finite number > 0 seconds, got -1"),
        ];
        for (name, v, want) in cases {
            let e = build(Preset::Simulator, [(name, v)]).unwrap_err().to_string();
            assert!(e.contains(want), "{name}: {e}");
        }
        let e = build(Preset::Simulator, [("seed", Value::Int(1)), ("seed", Value::Int(2))]).unwrap_err().to_string();
        assert!(e.contains("seed given twice"), "{e}");
    }

    #[test]
    fn presets_differ_only_where_they_say() {
        let sim = RouterConfig::preset(Preset::Simulator);
        assert_eq!(sim, RouterConfig::default());
        let host = RouterConfig::preset(Preset::HostRouter);
        assert_eq!((host.block_size, host.token_share_bound, host.ttft_model), (16, Some(1.25), TtftModel::Learned));
        assert_eq!(RouterConfig { block_size: 64, token_share_bound: None, ttft_model: TtftModel::Configured, ..host }, sim);
    }
}
