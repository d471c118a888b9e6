//! No import circles: in each product crate (agent, pubsub, common), the files' `crate::`
//! and `super::` references form no cycle. A circle makes two rooms one (a fact that
//! imports a rule, a rule that imports the I/O it decides for), so it fails here by name.
//!
//! The graph is read from the source text: every `crate::a::b` path (in `use` lines, braces
//! expanded, and inline) and every `super::` path, resolved to the longest module file it
//! names. Comments and `#[cfg(test)] mod tests { … }` blocks are left out (a test may
//! reach anywhere), as are `tests.rs` files and `tests/` directories.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// Every non-test `.rs` file under `src`, by module path (`fleetiq::lifecycle`).
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read the source dir") {
            let path = entry.expect("a dir entry").path();
            let rel = path.strip_prefix(src).expect("under src");
            let rel = rel.to_string_lossy().replace('\\', "/");
            if path.is_dir() {
                if !rel.ends_with("tests") {
                    stack.push(path);
                }
                continue;
            }
            let Some(stem) = rel.strip_suffix(".rs") else {
                continue;
            };
            if stem.ends_with("tests") || stem.ends_with("test_support") {
                continue;
            }
            let name = stem.strip_suffix("/mod").unwrap_or(stem).replace('/', "::");
            if name == "lib" || name == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read a source file");
            out.insert(name, without_tests_and_comments(&text));
        }
    }
    out
}

fn without_tests_and_comments(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Paths after `prefix` (`crate::` or `super::`), `{…}` groups expanded.
fn paths_after(text: &str, prefix: &str) -> Vec<String> {
    let mut out = vec![];
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        let after = &rest[i + prefix.len()..];
        expand("", after, &mut out);
        rest = after;
    }
    out
}

/// Reads one path at the start of `text` (after `base`) into `out`, expanding a group.
fn expand(base: &str, text: &str, out: &mut Vec<String>) {
    let head: String = text
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
        .collect();
    let tail = &text[head.len()..];
    let head = head.trim_end_matches(':');
    let joined = match (base.is_empty(), head.is_empty()) {
        (true, _) => head.to_string(),
        (false, true) => base.to_string(),
        (false, false) => format!("{base}::{head}"),
    };
    let Some(group) = tail.strip_prefix('{') else {
        out.push(joined);
        return;
    };
    // The group's items, split at its own commas (not those of nested groups).
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                expand(&joined, group[start..i].trim_start(), out);
                return;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand(&joined, group[start..i].trim_start(), out);
                start = i + 1;
            }
            _ => {}
        }
    }
}

fn graph(mods: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let resolve = |path: &str| -> Option<String> {
        let parts: Vec<&str> = path.split("::").collect();
        (1..=parts.len())
            .rev()
            .map(|k| parts[..k].join("::"))
            .find(|c| mods.contains_key(c))
    };
    let mut edges = BTreeMap::new();
    for (m, text) in mods {
        let parent = m.rsplit_once("::").map(|(p, _)| p.to_string());
        let mut paths = paths_after(text, "crate::");
        for p in paths_after(text, "super::") {
            paths.push(match &parent {
                Some(parent) => format!("{parent}::{p}"),
                None => p,
            });
        }
        let to: BTreeSet<String> = paths
            .iter()
            .filter_map(|p| resolve(p))
            .filter(|t| t != m)
            .collect();
        edges.insert(m.clone(), to);
    }
    edges
}

/// Strongly connected groups of more than one module (Tarjan).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on.insert(v);
        let edges = s.edges;
        for w in edges.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut group = vec![];
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                group.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                s.out.push(group);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: vec![],
        on: BTreeSet::new(),
        next: 0,
        out: vec![],
    };
    for v in edges.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

fn describe(edges: &BTreeMap<String, BTreeSet<String>>, group: &[String]) -> String {
    group
        .iter()
        .map(|v| {
            let inside: Vec<&str> = edges[v]
                .iter()
                .filter(|w| group.contains(w))
                .map(String::as_str)
                .collect();
            format!("  {v} -> {}", inside.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn assert_no_circles(krate: &str) {
    let mods = modules(&repo().join(krate).join("src"));
    assert!(mods.len() > 3, "{krate}: found only {} modules", mods.len());
    let edges = graph(&mods);
    let found = circles(&edges);
    assert!(
        found.is_empty(),
        "{krate} has import circles (file -> files it imports, inside each circle):\n{}",
        found
            .iter()
            .map(|g| describe(&edges, g))
            .collect::<Vec<_>>()
            .join("\n\n")
    );
}

#[test]
fn the_agent_has_no_import_circles() {
    assert_no_circles("agent");
}

#[test]
fn pubsub_and_common_have_no_import_circles() {
    assert_no_circles("pubsub");
    assert_no_circles("common");
}

/// The reader finds a circle where there is one (so a pass above means something).
#[test]
fn a_circle_is_found() {
    let mods: BTreeMap<String, String> = [
        ("a", "use crate::b::Thing;\n"),
        ("b", "use crate::{c::{self, X}, d};\n"),
        ("c", "fn f() { crate::a::g() }\n"),
        ("d", "// crate::a is only a comment\n"),
        ("e::f", "use super::g::H;\n"),
        ("e::g", "use super::f;\n"),
        ("e", ""),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), without_tests_and_comments(v)))
    .collect();
    let edges = graph(&mods);
    assert_eq!(
        circles(&edges),
        vec![
            vec!["a".to_string(), "b".into(), "c".into()],
            vec!["e::f".to_string(), "e::g".into()]
        ]
    );
}
