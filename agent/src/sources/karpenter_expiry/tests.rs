use serde_json::json;

use super::*;

fn t(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn claim(expire_after: serde_json::Value, tgp: Option<&str>) -> serde_json::Value {
    let mut spec = json!({ "expireAfter": expire_after });
    if let Some(g) = tgp {
        spec["terminationGracePeriod"] = json!(g);
    }
    json!({
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodeClaim",
        "metadata": { "name": "default-abc12", "uid": "u1",
            "creationTimestamp": "2026-12-01T00:00:00Z" },
        "spec": spec,
    })
}

const HOUR: Duration = Duration::from_secs(3600);

#[test]
fn go_durations_read_as_kubernetes_writes_them() {
    for (s, secs) in [
        ("720h", 720.0 * 3600.0),
        ("336h0m0s", 336.0 * 3600.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("90s", 90.0),
        ("500ms", 0.5),
        ("0", 0.0),
    ] {
        assert_eq!(
            parse_go_duration(s),
            Ok(Duration::from_secs_f64(secs)),
            "{s}"
        );
    }
    for bad in ["", "h", "10", "10d", "-1h", "1h-", "Never"] {
        assert!(parse_go_duration(bad).is_err(), "{bad:?} must not parse");
    }
}

#[test]
fn the_owner_is_the_karpenter_nodeclaim_owner_reference() {
    let mut node = Node::default();
    assert_eq!(owner(&node), None);
    node.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "example.com/v1".into(),
            kind: "NodeClaim".into(),
            name: "other".into(),
            uid: "x".into(),
            ..Default::default()
        },
    ]);
    assert_eq!(owner(&node), None, "another group's NodeClaim");
    node.metadata.owner_references.as_mut().unwrap().push(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "karpenter.sh/v1".into(),
            kind: "NodeClaim".into(),
            name: "default-abc12".into(),
            uid: "u1".into(),
            ..Default::default()
        },
    );
    assert_eq!(
        owner(&node),
        Some(Owner {
            name: "default-abc12".into(),
            uid: "u1".into(),
            api_version: "karpenter.sh/v1".into()
        })
    );
}

#[test]
fn with_a_grace_period_the_end_is_when_pods_are_deleted() {
    let c = read_claim(&claim(json!("720h"), Some("24h"))).unwrap();
    let expiry = t("2026-12-31T00:00:00Z");
    assert_eq!(c.expiry(), Some(expiry));
    assert_eq!(c.end(), Some(t("2027-01-01T00:00:00Z")));
    assert_eq!(c.fence_at(HOUR), Some(t("2026-12-30T23:00:00Z")));
    let early = c.notice(HOUR, t("2026-12-30T22:59:59Z")).unwrap();
    assert_eq!(
        (early.severity, early.deadline, early.cause),
        (Severity::Observe, c.end(), Cause::Upgrade)
    );
    let due = c.notice(HOUR, t("2026-12-30T23:00:00Z")).unwrap();
    assert_eq!((due.severity, due.deadline), (Severity::Terminate, c.end()));
    assert!(due.cordon && due.cancellable && !due.estimated_deadline);
}

#[test]
fn without_a_grace_period_nothing_dies_and_the_end_is_the_expiry() {
    let c = read_claim(&claim(json!("48h"), None)).unwrap();
    let expiry = t("2026-12-03T00:00:00Z");
    assert_eq!((c.expiry(), c.end()), (Some(expiry), Some(expiry)));
    let due = c.notice(HOUR, expiry).unwrap();
    assert_eq!(
        (due.severity, due.deadline),
        (Severity::Drain, Some(expiry))
    );
}

#[test]
fn never_and_unreadable_claims_are_no_signal() {
    let never = read_claim(&claim(json!("Never"), Some("1h"))).unwrap();
    assert_eq!(never.expire_after, ExpireAfter::Never);
    assert_eq!(never.notice(HOUR, t("2099-01-01T00:00:00Z")), None);
    assert!(read_claim(&claim(json!("fortnight"), None)).is_err());
    assert!(read_claim(&claim(json!("1h"), Some("soon"))).is_err());
    let mut no_time = claim(json!("1h"), None);
    no_time["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("creationTimestamp");
    assert!(read_claim(&no_time).is_err());
    // Karpenter's default when the field is absent.
    let mut default = claim(json!("1h"), None);
    default["spec"]
        .as_object_mut()
        .unwrap()
        .remove("expireAfter");
    assert_eq!(
        read_claim(&default).unwrap().expire_after,
        ExpireAfter::After(720 * HOUR)
    );
}

#[test]
fn a_lead_longer_than_the_node_s_life_fences_from_creation() {
    let c = read_claim(&claim(json!("30m"), None)).unwrap();
    let n = c.notice(HOUR, t("2026-12-01T00:00:01Z")).unwrap();
    assert_eq!(n.severity, Severity::Drain);
}
