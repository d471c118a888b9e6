//! Label and field selectors with the real server's syntax, matching and errors.
//!
//! Label selectors support the full set-based grammar (`=`, `==`, `!=`, `in`, `notin`,
//! existence, `!` non-existence, `<`, `>`). Field selectors support the fields the real
//! server indexes for each type; anything else is a 400, so a client relying on an
//! unsupported field fails here as it would against a cluster.

use serde_json::{Map, Value};

use super::resources::ResourceType;
use super::status::ApiError;

/// A label selector operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Eq,
    NotEq,
    In,
    NotIn,
    Exists,
    NotExists,
    Gt,
    Lt,
}

/// One requirement (`key op values`); all requirements of a selector must hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requirement {
    pub key: String,
    pub op: Op,
    pub values: Vec<String>,
}

impl Requirement {
    fn matches(&self, labels: Option<&Map<String, Value>>) -> bool {
        let v = labels
            .and_then(|l| l.get(&self.key))
            .and_then(Value::as_str);
        match self.op {
            Op::Exists => v.is_some(),
            Op::NotExists => v.is_none(),
            Op::Eq | Op::In => v.is_some_and(|v| self.values.iter().any(|x| x == v)),
            Op::NotEq | Op::NotIn => v.is_none_or(|v| !self.values.iter().any(|x| x == v)),
            Op::Gt | Op::Lt => {
                let (Some(v), Some(bound)) = (
                    v.and_then(|v| v.parse::<i64>().ok()),
                    self.values.first().and_then(|b| b.parse::<i64>().ok()),
                ) else {
                    return false;
                };
                if self.op == Op::Gt {
                    v > bound
                } else {
                    v < bound
                }
            }
        }
    }
}

/// A parsed label selector. The empty selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelSelector {
    pub requirements: Vec<Requirement>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Not,
    Eq,
    DoubleEq,
    NotEq,
    Open,
    Close,
    Comma,
    Gt,
    Lt,
}

fn lex(s: &str) -> Result<Vec<Tok>, ApiError> {
    let mut out = Vec::new();
    let chars: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            c if c.is_whitespace() => i += 1,
            '!' if next == Some('=') => {
                out.push(Tok::NotEq);
                i += 2;
            }
            '!' => {
                out.push(Tok::Not);
                i += 1;
            }
            '=' if next == Some('=') => {
                out.push(Tok::DoubleEq);
                i += 2;
            }
            '=' => {
                out.push(Tok::Eq);
                i += 1;
            }
            '(' => {
                out.push(Tok::Open);
                i += 1;
            }
            ')' => {
                out.push(Tok::Close);
                i += 1;
            }
            ',' => {
                out.push(Tok::Comma);
                i += 1;
            }
            '>' => {
                out.push(Tok::Gt);
                i += 1;
            }
            '<' => {
                out.push(Tok::Lt);
                i += 1;
            }
            _ => {
                let start = i;
                while i < chars.len() && !chars[i].is_whitespace() && !"!=(),<>".contains(chars[i])
                {
                    i += 1;
                }
                out.push(Tok::Ident(chars[start..i].iter().collect()));
            }
        }
    }
    Ok(out)
}

fn parse_error(sel: &str, why: &str) -> ApiError {
    ApiError::bad_request(&format!(
        "unable to parse requirement: {why} (in label selector {sel:?})"
    ))
}

/// Label keys: optional DNS-subdomain prefix and `/`, then a name of at most 63 chars.
fn valid_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && (p.is_empty()
            || p.len() > 253
            || !p
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'))
    {
        return false;
    }
    !name.is_empty() && valid_value(name)
}

/// Label values: empty, or at most 63 alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric.
fn valid_value(v: &str) -> bool {
    if v.is_empty() {
        return true;
    }
    v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && v.as_bytes().first().is_some_and(u8::is_ascii_alphanumeric)
        && v.as_bytes().last().is_some_and(u8::is_ascii_alphanumeric)
}

impl LabelSelector {
    /// Parses the `labelSelector` query syntax; errors are 400 BadRequest.
    pub fn parse(sel: &str) -> Result<Self, ApiError> {
        let toks = lex(sel)?;
        let mut reqs = Vec::new();
        let mut i = 0;
        if toks.is_empty() {
            return Ok(LabelSelector::default());
        }
        loop {
            let (req, used) = Self::parse_requirement(sel, &toks[i..])?;
            if !valid_key(&req.key) {
                return Err(parse_error(
                    sel,
                    &format!("invalid label key {:?}", req.key),
                ));
            }
            if let Some(bad) = req.values.iter().find(|v| !valid_value(v)) {
                return Err(parse_error(sel, &format!("invalid label value {bad:?}")));
            }
            reqs.push(req);
            i += used;
            match toks.get(i) {
                None => break,
                Some(Tok::Comma) => {
                    i += 1;
                    if i >= toks.len() {
                        return Err(parse_error(sel, "expected a requirement after ','"));
                    }
                }
                Some(t) => {
                    return Err(parse_error(sel, &format!("unexpected {t:?}, expected ','")));
                }
            }
        }
        Ok(LabelSelector { requirements: reqs })
    }

    fn parse_requirement(sel: &str, toks: &[Tok]) -> Result<(Requirement, usize), ApiError> {
        let ident = |i: usize| match toks.get(i) {
            Some(Tok::Ident(s)) => Some(s.clone()),
            _ => None,
        };
        if toks.first() == Some(&Tok::Not) {
            let key = ident(1).ok_or_else(|| parse_error(sel, "expected a key after '!'"))?;
            return Ok((
                Requirement {
                    key,
                    op: Op::NotExists,
                    values: vec![],
                },
                2,
            ));
        }
        let key = ident(0).ok_or_else(|| parse_error(sel, "expected a key"))?;
        let req = |op, values| Requirement {
            key: key.clone(),
            op,
            values,
        };
        match toks.get(1) {
            None | Some(Tok::Comma) => Ok((req(Op::Exists, vec![]), 1)),
            Some(Tok::Eq | Tok::DoubleEq | Tok::NotEq) => {
                let op = if toks.get(1) == Some(&Tok::NotEq) {
                    Op::NotEq
                } else {
                    Op::Eq
                };
                match toks.get(2) {
                    Some(Tok::Ident(v)) => Ok((req(op, vec![v.clone()]), 3)),
                    None | Some(Tok::Comma) => Ok((req(op, vec![String::new()]), 2)),
                    Some(t) => Err(parse_error(
                        sel,
                        &format!("unexpected {t:?} after operator"),
                    )),
                }
            }
            Some(Tok::Gt | Tok::Lt) => {
                let op = if toks.get(1) == Some(&Tok::Gt) {
                    Op::Gt
                } else {
                    Op::Lt
                };
                let v = ident(2).ok_or_else(|| parse_error(sel, "expected an integer"))?;
                if v.parse::<i64>().is_err() {
                    return Err(parse_error(
                        sel,
                        &format!("for '<' and '>', the value must be an integer, not {v:?}"),
                    ));
                }
                Ok((req(op, vec![v]), 3))
            }
            Some(Tok::Ident(kw)) if kw == "in" || kw == "notin" => {
                let op = if kw == "in" { Op::In } else { Op::NotIn };
                if toks.get(2) != Some(&Tok::Open) {
                    return Err(parse_error(sel, &format!("expected '(' after {kw:?}")));
                }
                let mut values = Vec::new();
                let mut i = 3;
                loop {
                    match toks.get(i) {
                        Some(Tok::Ident(v)) => {
                            values.push(v.clone());
                            i += 1;
                            match toks.get(i) {
                                Some(Tok::Comma) => i += 1,
                                Some(Tok::Close) => {
                                    i += 1;
                                    break;
                                }
                                _ => {
                                    return Err(parse_error(
                                        sel,
                                        "expected ',' or ')' in a value set",
                                    ));
                                }
                            }
                        }
                        Some(Tok::Close) if values.is_empty() => {
                            return Err(parse_error(sel, "a value set must not be empty"));
                        }
                        _ => return Err(parse_error(sel, "expected a value in a value set")),
                    }
                }
                Ok((req(op, values), i))
            }
            Some(t) => Err(parse_error(
                sel,
                &format!("unexpected {t:?} after key {key:?}"),
            )),
        }
    }

    /// Builds a selector from a `metav1.LabelSelector` object (`matchLabels`,
    /// `matchExpressions`), as PDBs carry it. `{}` matches everything.
    pub fn from_object(v: &Value) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        if let Some(ml) = v.get("matchLabels").and_then(Value::as_object) {
            for (k, val) in ml {
                reqs.push(Requirement {
                    key: k.clone(),
                    op: Op::Eq,
                    values: vec![val.as_str().unwrap_or_default().to_string()],
                });
            }
        }
        if let Some(exprs) = v.get("matchExpressions").and_then(Value::as_array) {
            for e in exprs {
                let key = e
                    .get("key")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                let values: Vec<String> = e
                    .get("values")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default();
                let op = match e
                    .get("operator")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                {
                    "In" => Op::In,
                    "NotIn" => Op::NotIn,
                    "Exists" => Op::Exists,
                    "DoesNotExist" => Op::NotExists,
                    other => {
                        return Err(ApiError::bad_request(&format!(
                            "{other:?} is not a valid label selector operator"
                        )));
                    }
                };
                reqs.push(Requirement { key, op, values });
            }
        }
        Ok(LabelSelector { requirements: reqs })
    }

    /// Whether the labels satisfy every requirement.
    pub fn matches_labels(&self, labels: Option<&Map<String, Value>>) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }

    /// Whether the object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        self.matches_labels(obj.pointer("/metadata/labels").and_then(Value::as_object))
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }
}

/// One field requirement: `field = value` or `field != value`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldRequirement {
    pub field: String,
    pub equal: bool,
    pub value: String,
}

/// A parsed field selector, checked against the fields the type supports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FieldSelector {
    pub requirements: Vec<FieldRequirement>,
}

/// Splits on an unescaped `sep`, keeping escapes for the next step.
fn split_unescaped(s: &str, sep: char) -> Vec<String> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            cur.push('\\');
            cur.push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == sep {
            parts.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    if escaped {
        cur.push('\\');
    }
    parts.push(cur);
    parts
}

fn unescape(s: &str) -> Result<String, ApiError> {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some(e @ ('\\' | ',' | '=')) => out.push(e),
                Some(e) => {
                    return Err(ApiError::bad_request(&format!(
                        "invalid field selector: invalid escape sequence \\{e}"
                    )));
                }
                None => {
                    return Err(ApiError::bad_request(
                        "invalid field selector: trailing backslash",
                    ));
                }
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// Finds the first unescaped occurrence of an operator in a term.
fn split_term(term: &str) -> Option<(String, bool, String)> {
    let bytes = term.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'!' if bytes.get(i + 1) == Some(&b'=') => {
                return Some((term[..i].to_string(), false, term[i + 2..].to_string()));
            }
            b'=' if bytes.get(i + 1) == Some(&b'=') => {
                return Some((term[..i].to_string(), true, term[i + 2..].to_string()));
            }
            b'=' => return Some((term[..i].to_string(), true, term[i + 1..].to_string())),
            _ => i += 1,
        }
    }
    None
}

impl FieldSelector {
    /// Parses `fieldSelector` for type `rt`; unknown fields and bad syntax are 400.
    pub fn parse(rt: &ResourceType, sel: &str) -> Result<Self, ApiError> {
        Self::parse_with(rt, sel, &[])
    }

    /// Like [`Self::parse`], for a custom resource whose CRD declares `crd_fields` in
    /// `selectableFields` (each a jsonPath without its leading dot).
    pub fn parse_with(rt: &ResourceType, sel: &str, crd_fields: &[&str]) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        if sel.trim().is_empty() {
            return Ok(FieldSelector::default());
        }
        for term in split_unescaped(sel, ',') {
            let Some((field, equal, value)) = split_term(&term) else {
                return Err(ApiError::bad_request(&format!(
                    "invalid selector: '{sel}'; can't understand '{term}'"
                )));
            };
            let field = field.trim().to_string();
            if !supported_field(rt, &field) && !crd_fields.contains(&field.as_str()) {
                // Worded alike for built-in types and CRDs (Kubernetes 1.35).
                return Err(ApiError::bad_request(&format!(
                    "field label not supported: {field}"
                )));
            }
            reqs.push(FieldRequirement {
                field,
                equal,
                value: unescape(&value)?,
            });
        }
        Ok(FieldSelector { requirements: reqs })
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.requirements
            .iter()
            .all(|r| (field_value(obj, &r.field) == r.value) == r.equal)
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }
}

/// The GameServer CRD's `selectableFields` since Agones 1.58 (served by Kubernetes 1.31 and
/// later); an absent field reads as `""`, as the real server evaluates a jsonPath.
pub const AGONES_SELECTABLE_FIELDS: &[&str] = &["status.state", "status.nodeName"];

/// Per-type fields beyond metadata.name/namespace, as the real server indexes them.
fn type_fields(rt: &ResourceType) -> &'static [&'static str] {
    match (rt.group, rt.plural) {
        ("", "pods") => &[
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ],
        ("", "nodes") => &["spec.unschedulable"],
        ("", "events") => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ],
        ("events.k8s.io", "events") => &[
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "regarding.apiVersion",
            "regarding.resourceVersion",
            "regarding.fieldPath",
            "reason",
            "reportingController",
            "type",
        ],
        _ => &[],
    }
}

fn supported_field(rt: &ResourceType, field: &str) -> bool {
    field == "metadata.name" || field == "metadata.namespace" || type_fields(rt).contains(&field)
}

/// The string value of a selectable field; missing fields read as `""` (booleans as `"false"`).
fn field_value(obj: &Value, field: &str) -> String {
    let path = match field {
        "source" => "/source/component".to_string(),
        f => format!("/{}", f.replace('.', "/")),
    };
    match obj.pointer(&path) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        _ if field == "spec.unschedulable" || field == "spec.hostNetwork" => "false".to_string(),
        _ => String::new(),
    }
}

/// An equality requirement a watch can be found by (see [`super::fanout`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum IndexKey {
    Field { field: String, value: String },
    Label { key: String, value: String },
}

impl IndexKey {
    /// The same key name with `value`.
    pub fn with_value(&self, value: String) -> IndexKey {
        match self {
            IndexKey::Field { field, .. } => IndexKey::Field {
                field: field.clone(),
                value,
            },
            IndexKey::Label { key, .. } => IndexKey::Label {
                key: key.clone(),
                value,
            },
        }
    }

    /// The value this key asks for.
    pub fn value(&self) -> &str {
        match self {
            IndexKey::Field { value, .. } | IndexKey::Label { value, .. } => value,
        }
    }

    /// Whether `other` names the same field or label (whatever the values).
    pub fn same_attribute(&self, other: &IndexKey) -> bool {
        match (self, other) {
            (IndexKey::Field { field: a, .. }, IndexKey::Field { field: b, .. }) => a == b,
            (IndexKey::Label { key: a, .. }, IndexKey::Label { key: b, .. }) => a == b,
            _ => false,
        }
    }

    /// This key's value in `obj` (a missing field reads as the selectors read it; a
    /// missing label has none).
    pub fn value_in(&self, obj: &Value) -> Option<String> {
        match self {
            IndexKey::Field { field, .. } => Some(field_value(obj, field)),
            IndexKey::Label { key, .. } => obj
                .pointer("/metadata/labels")
                .and_then(|l| l.get(key))
                .and_then(Value::as_str)
                .map(str::to_string),
        }
    }
}

/// Both selectors of a list or watch.
#[derive(Clone, Debug, Default)]
pub struct Selectors {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Selectors {
    pub fn parse(
        rt: &ResourceType,
        labels: Option<&str>,
        fields: Option<&str>,
    ) -> Result<Self, ApiError> {
        Self::parse_with(rt, labels, fields, &[])
    }

    /// With a CRD's selectable fields (see [`FieldSelector::parse_with`]).
    pub fn parse_with(
        rt: &ResourceType,
        labels: Option<&str>,
        fields: Option<&str>,
        crd_fields: &[&str],
    ) -> Result<Self, ApiError> {
        Ok(Selectors {
            labels: match labels {
                Some(l) => LabelSelector::parse(l)?,
                None => LabelSelector::default(),
            },
            fields: match fields {
                Some(f) => FieldSelector::parse_with(rt, f, crd_fields)?,
                None => FieldSelector::default(),
            },
        })
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }

    /// One requirement every matching object meets with a single value, to index a watch
    /// by: a field equality first, else a label equality (or `in` of one value).
    pub fn index_key(&self) -> Option<IndexKey> {
        if let Some(r) = self.fields.requirements.iter().find(|r| r.equal) {
            return Some(IndexKey::Field {
                field: r.field.clone(),
                value: r.value.clone(),
            });
        }
        self.labels
            .requirements
            .iter()
            .find(|r| matches!(r.op, Op::Eq | Op::In) && r.values.len() == 1)
            .map(|r| IndexKey::Label {
                key: r.key.clone(),
                value: r.values[0].clone(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"labels": labels}})
    }

    #[test]
    fn label_operators() {
        let o = obj(json!({"a": "x", "n": "5"}));
        for (sel, want) in [
            ("a=x", true),
            ("a==x", true),
            ("a!=x", false),
            ("b!=x", true),
            ("a in (x, y)", true),
            ("a notin (x,y)", false),
            ("b notin (x)", true),
            ("a", true),
            ("!a", false),
            ("!b", true),
            ("a,b", false),
            ("n>4,n<6", true),
            ("a=x,n=5", true),
        ] {
            assert_eq!(
                LabelSelector::parse(sel).unwrap().matches(&o),
                want,
                "{sel}"
            );
        }
        for bad in [
            "a in x", "a=(", "=x", "a in ()", "a b", "a,", "a=x y", "n>q",
        ] {
            assert_eq!(LabelSelector::parse(bad).unwrap_err().code, 400, "{bad}");
        }
    }

    #[test]
    fn field_escapes() {
        let rt = super::super::resources::PODS;
        let s = FieldSelector::parse(&rt, r"metadata.name=a\,b").unwrap();
        assert!(s.matches(&json!({"metadata": {"name": "a,b"}})));
        assert_eq!(
            FieldSelector::parse(&rt, "spec.foo=x").unwrap_err().code,
            400
        );
        assert_eq!(FieldSelector::parse(&rt, "nonsense").unwrap_err().code, 400);
    }
}
