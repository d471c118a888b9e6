//! The notification body: JSON with `{name}` placeholders, checked once at start-up.
//!
//! A placeholder is `{` + letters, digits or `_` + `}`; any other `{` (the JSON object's own
//! braces) is text. Values go in JSON-escaped without quotes, so placeholders belong inside
//! JSON strings: `{"text": "{node} is draining"}`. Start-up renders the template with values
//! full of characters that need escaping and refuses it unless that is a JSON object, so a
//! placeholder outside a string, an unknown placeholder or broken JSON is an error before
//! anything runs, never a failed notification during a drain.

use std::fmt;

/// The placeholders, in the order the docs list them.
pub const FIELDS: [&str; 7] = [
    "event", "node", "cluster", "reason", "source", "deadline", "message",
];

/// The default: one line in `text`, which Slack's incoming webhooks and Teams' simple
/// payload both show.
pub const DEFAULT: &str = r#"{"text":"lastcall {event} on node {node}: {message}"}"#;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Text(String),
    Field(usize),
}

/// A parsed template.
#[derive(Clone, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
}

impl fmt::Debug for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Template(")?;
        for p in &self.parts {
            match p {
                Part::Text(t) => f.write_str(t)?,
                Part::Field(i) => write!(f, "{{{}}}", FIELDS[*i])?,
            }
        }
        f.write_str(")")
    }
}

/// The values of one notification, by placeholder.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Values {
    pub event: String,
    pub node: String,
    pub cluster: String,
    pub reason: String,
    pub source: String,
    pub deadline: String,
    pub message: String,
}

impl Values {
    fn get(&self, field: usize) -> &str {
        match FIELDS[field] {
            "event" => &self.event,
            "node" => &self.node,
            "cluster" => &self.cluster,
            "reason" => &self.reason,
            "source" => &self.source,
            "deadline" => &self.deadline,
            _ => &self.message,
        }
    }
}

fn is_name(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl Template {
    /// Parses and checks `s` (the clap value parser of `--notify-template`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut parts = vec![];
        let mut text = String::new();
        let mut rest = s;
        while let Some(i) = rest.find('{') {
            text.push_str(&rest[..i]);
            let after = &rest[i + 1..];
            let name_len = after.find(|c: char| !is_name(c)).unwrap_or(after.len());
            if name_len > 0 && after[name_len..].starts_with('}') {
                let name = &after[..name_len];
                let Some(field) = FIELDS.iter().position(|f| *f == name) else {
                    return Err(format!(
                        "unknown placeholder {{{name}}}; known: {}",
                        FIELDS.map(|f| format!("{{{f}}}")).join(", ")
                    ));
                };
                if !text.is_empty() {
                    parts.push(Part::Text(std::mem::take(&mut text)));
                }
                parts.push(Part::Field(field));
                rest = &after[name_len + 1..];
            } else {
                text.push('{');
                rest = after;
            }
        }
        text.push_str(rest);
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        let t = Self { parts };
        // Values that break JSON unless escaped, and that are not JSON themselves outside a
        // string.
        let probe = Values {
            event: "a\"b".into(),
            node: "c\\d".into(),
            cluster: "e\nf".into(),
            reason: "g}{h".into(),
            source: "i\u{7}j".into(),
            deadline: "k l".into(),
            message: "m\"n".into(),
        };
        let rendered = t.render_unchecked(&probe);
        match serde_json::from_str::<serde_json::Value>(&rendered) {
            Ok(serde_json::Value::Object(_)) => Ok(t),
            Ok(_) => Err("must be a JSON object, e.g. {\"text\": \"{message}\"}".into()),
            Err(e) => Err(format!(
                "is not JSON once filled in ({e}); placeholders go inside JSON strings, e.g. {{\"text\": \"{{node}}: {{message}}\"}}"
            )),
        }
    }

    fn render_unchecked(&self, v: &Values) -> String {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::Field(i) => {
                    // A JSON string literal without its quotes.
                    let quoted = serde_json::Value::String(v.get(*i).to_string()).to_string();
                    out.push_str(&quoted[1..quoted.len() - 1]);
                }
            }
        }
        out
    }

    /// The body for `v`: checked JSON (the start-up check makes a failure here a bug, but
    /// a bug must not send garbage).
    pub fn render(&self, v: &Values) -> Result<String, serde_json::Error> {
        let body = self.render_unchecked(v);
        serde_json::from_str::<serde_json::Value>(&body)?;
        Ok(body)
    }

    /// Whether `{name}` appears.
    pub fn uses(&self, name: &str) -> bool {
        self.parts
            .iter()
            .any(|p| matches!(p, Part::Field(i) if FIELDS[*i] == name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values() -> Values {
        Values {
            event: "drain_started".into(),
            node: "n1".into(),
            cluster: "prod-eu".into(),
            reason: "viability".into(),
            source: "fleetiq".into(),
            deadline: "2026-12-01T12:00:00Z".into(),
            message: "Drain started: \"quoted\" \\ and\nnew line".into(),
        }
    }

    #[test]
    fn the_default_is_slack_and_teams_text() {
        let t = Template::parse(DEFAULT).expect("default parses");
        let body = t.render(&values()).expect("renders");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(
            v["text"],
            "lastcall drain_started on node n1: Drain started: \"quoted\" \\ and\nnew line"
        );
        assert_eq!(v.as_object().map(|o| o.len()), Some(1));
    }

    #[test]
    fn every_placeholder_is_filled_and_escaped() {
        let t = Template::parse(
            r#"{"blocks":[{"type":"section","text":{"type":"mrkdwn","text":"*{event}* {node} {cluster} {reason} {source} {deadline} {message}"}}],"n":"{node}"}"#,
        )
        .expect("parses");
        let v: serde_json::Value =
            serde_json::from_str(&t.render(&values()).expect("renders")).expect("json");
        assert_eq!(v["n"], "n1");
        assert_eq!(
            v["blocks"][0]["text"]["text"],
            "*drain_started* n1 prod-eu viability fleetiq 2026-12-01T12:00:00Z Drain started: \"quoted\" \\ and\nnew line"
        );
        assert!(t.uses("cluster") && !Template::parse(DEFAULT).unwrap().uses("cluster"));
    }

    #[test]
    fn bad_templates_are_refused_with_the_reason() {
        for (bad, want) in [
            (r#"{"text":"{nodename}"}"#, "unknown placeholder {nodename}"),
            (r#"{"text":"{Node}"}"#, "unknown placeholder {Node}"),
            (r#"{"text": {node}}"#, "not JSON once filled in"),
            (r#"{"text":"{node}""#, "not JSON once filled in"),
            (r#""{node}""#, "must be a JSON object"),
            ("", "not JSON"),
        ] {
            let err = Template::parse(bad).expect_err(bad);
            assert!(err.contains(want), "{bad}: {err}");
        }
        // Braces that are not placeholders are text.
        let t = Template::parse(r#"{"text":"{} { x} {node"}"#).expect("literal braces");
        assert_eq!(
            t.render(&values()).expect("renders"),
            r#"{"text":"{} { x} {node"}"#
        );
    }
}
