//! Signals read from the agent's own Node: operators' manual label, Karpenter's and the
//! cluster autoscaler's taints, GKE's maintenance labels and taint, and (opt-in) a cordon
//! lastcall did not make. Each is a plain function of the observed Node.

use jiff::{SignedDuration, Timestamp};

use super::NodeSignalConfig;
use crate::keys;
use crate::notice::{Cause, Notice, Severity, Source};
use crate::observed::NodeView;

pub const MANUAL: Source = Source("manual");
pub const KARPENTER: Source = Source("karpenter");
pub const CLUSTER_AUTOSCALER: Source = Source("cluster_autoscaler");
pub const GKE: Source = Source("gke");
pub const FOREIGN_CORDON: Source = Source("cordon");

/// Karpenter v1's taint on a node it is disrupting (no value).
pub const TAINT_KARPENTER: &str = "karpenter.sh/disrupted";
/// The cluster autoscaler's taint on a node it is removing.
pub const TAINT_CLUSTER_AUTOSCALER: &str = "ToBeDeletedByClusterAutoscaler";
/// GKE cordons a node it is terminating with this taint.
pub const TAINT_GKE_TERMINATION: &str = "cloud.google.com/impending-node-termination";
/// GKE: `ONGOING` while it stops workloads for host maintenance.
pub const LABEL_GKE_ACTIVE_MAINTENANCE: &str = "cloud.google.com/active-node-maintenance";
/// GKE: upcoming host maintenance, Unix epoch seconds.
pub const LABEL_GKE_SCHEDULED_MAINTENANCE: &str = "cloud.google.com/scheduled-maintenance-time";

fn notice(
    source: Source,
    cause: Cause,
    severity: Severity,
    deadline: Option<Timestamp>,
    cordon: bool,
    detail: String,
) -> Notice {
    // Every Node signal is level: when the label or taint goes, so does the notice.
    Notice {
        cordon,
        ..Notice::new(source, cause, severity, deadline, true, detail)
    }
}

/// `lastcall.dev/drain=true`: an operator's safe drain; removing the label cancels it.
pub fn manual(node: &NodeView, _: &NodeSignalConfig, _: Timestamp) -> Option<Notice> {
    let v = node.labels.get(keys::LABEL_MANUAL_DRAIN)?;
    (v == "true").then(|| {
        notice(
            MANUAL,
            Cause::Manual,
            Severity::Drain,
            None,
            true,
            format!("node label {}=true", keys::LABEL_MANUAL_DRAIN),
        )
    })
}

/// Karpenter's deadline for a node it is terminating: when its `terminationGracePeriod`
/// runs out it deletes every pod left (each at `deadline − the pod's grace`) and the instance.
pub const ANN_KARPENTER_TERMINATION: &str = "karpenter.sh/nodeclaim-termination-timestamp";

/// Karpenter is taking the node; it keeps new pods off itself. With a
/// `terminationGracePeriod` it also says when the node goes, and then it is a Terminate with
/// that deadline; without one it waits for the pods, and it is a plain drain.
pub fn karpenter(node: &NodeView, _: &NodeSignalConfig, _: Timestamp) -> Option<Notice> {
    if !node.has_taint(TAINT_KARPENTER) {
        return None;
    }
    let deadline = node
        .annotations
        .get(ANN_KARPENTER_TERMINATION)
        .and_then(|v| v.parse::<Timestamp>().ok());
    Some(match deadline {
        Some(d) => notice(
            KARPENTER,
            Cause::ScaleDown,
            Severity::Terminate,
            Some(d),
            false,
            format!("taint {TAINT_KARPENTER}; {ANN_KARPENTER_TERMINATION} {d}"),
        ),
        None => notice(
            KARPENTER,
            Cause::ScaleDown,
            Severity::Drain,
            None,
            false,
            format!("taint {TAINT_KARPENTER}"),
        ),
    })
}

/// The cluster autoscaler is removing the node; its taint keeps new pods off.
pub fn cluster_autoscaler(node: &NodeView, _: &NodeSignalConfig, _: Timestamp) -> Option<Notice> {
    node.has_taint(TAINT_CLUSTER_AUTOSCALER).then(|| {
        notice(
            CLUSTER_AUTOSCALER,
            Cause::ScaleDown,
            Severity::Drain,
            None,
            false,
            format!("taint {TAINT_CLUSTER_AUTOSCALER}"),
        )
    })
}

/// GKE: termination under way (taint or `ONGOING`) is Terminate; scheduled maintenance
/// drains from `epoch − maintenance lead`, with the epoch as the deadline, so matches that
/// start before then end on their own before the window.
pub fn gke(node: &NodeView, cfg: &NodeSignalConfig, now: Timestamp) -> Option<Notice> {
    let ongoing = node
        .labels
        .get(LABEL_GKE_ACTIVE_MAINTENANCE)
        .is_some_and(|v| v == "ONGOING");
    if node.has_taint(TAINT_GKE_TERMINATION) || ongoing {
        return Some(notice(
            GKE,
            Cause::Maintenance,
            Severity::Terminate,
            None,
            true,
            if ongoing {
                format!("label {LABEL_GKE_ACTIVE_MAINTENANCE}=ONGOING")
            } else {
                format!("taint {TAINT_GKE_TERMINATION}")
            },
        ));
    }
    let raw = node.labels.get(LABEL_GKE_SCHEDULED_MAINTENANCE)?;
    // A garbled value is ignored (logged nowhere here: policy sees no notice, nothing acts).
    let epoch: i64 = raw.trim().parse().ok()?;
    let window = Timestamp::from_second(epoch).ok()?;
    let lead = SignedDuration::try_from(cfg.maintenance_lead).unwrap_or_default();
    let from = window.checked_sub(lead).unwrap_or(window);
    let severity = if now >= from {
        Severity::Drain
    } else {
        Severity::Observe
    };
    Some(notice(
        GKE,
        Cause::Maintenance,
        severity,
        Some(window),
        true,
        format!("label {LABEL_GKE_SCHEDULED_MAINTENANCE}={epoch}"),
    ))
}

/// Opt-in: a cordon lastcall did not make (`kubectl cordon`, a GKE blue-green or cluster
/// upgrade) gets the game-server work. lastcall never un-cordons it.
pub fn foreign_cordon(node: &NodeView, cfg: &NodeSignalConfig, _: Timestamp) -> Option<Notice> {
    let ours = node.annotations.get(keys::ANN_CORDONED).map(String::as_str) == Some("true");
    (cfg.drain_on_foreign_cordon && node.unschedulable && !ours).then(|| {
        notice(
            FOREIGN_CORDON,
            Cause::Upgrade,
            Severity::Drain,
            None,
            false,
            "node cordoned by someone else".into(),
        )
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use k8s_openapi::api::core::v1::Taint;

    use super::*;

    fn node() -> NodeView {
        NodeView {
            name: "n1".into(),
            resource_version: "1".into(),
            unschedulable: false,
            taints: vec![],
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            boot_id: None,
            ready_since: None,
        }
    }

    fn cfg() -> NodeSignalConfig {
        NodeSignalConfig {
            maintenance_lead: Duration::from_secs(3600),
            drain_on_foreign_cordon: false,
        }
    }

    fn taint(key: &str) -> Taint {
        Taint {
            key: key.into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        }
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn manual_label_only_for_true() {
        let mut n = node();
        assert_eq!(manual(&n, &cfg(), t(0)), None);
        n.labels
            .insert(keys::LABEL_MANUAL_DRAIN.into(), "nope".into());
        assert_eq!(manual(&n, &cfg(), t(0)), None);
        n.labels
            .insert(keys::LABEL_MANUAL_DRAIN.into(), "true".into());
        let m = manual(&n, &cfg(), t(0)).unwrap();
        assert_eq!(
            (m.cause, m.severity, m.cancellable, m.cordon),
            (Cause::Manual, Severity::Drain, true, true)
        );
    }

    #[test]
    fn autoscaler_taints_drain_without_cordoning_again() {
        let mut n = node();
        n.taints.push(taint(TAINT_KARPENTER));
        let k = karpenter(&n, &cfg(), t(0)).unwrap();
        assert_eq!(
            (k.cause, k.severity, k.cordon),
            (Cause::ScaleDown, Severity::Drain, false)
        );
        assert_eq!(cluster_autoscaler(&n, &cfg(), t(0)), None);
        n.taints = vec![taint(TAINT_CLUSTER_AUTOSCALER)];
        assert!(cluster_autoscaler(&n, &cfg(), t(0)).is_some_and(|c| !c.cordon));
        assert_eq!(karpenter(&n, &cfg(), t(0)), None);
    }

    #[test]
    fn karpenter_s_termination_timestamp_is_the_deadline() {
        let mut n = node();
        n.annotations.insert(
            ANN_KARPENTER_TERMINATION.into(),
            "2026-12-02T10:00:00Z".into(),
        );
        // The annotation alone (no taint) is not a signal.
        assert_eq!(karpenter(&n, &cfg(), t(0)), None);
        n.taints.push(taint(TAINT_KARPENTER));
        let k = karpenter(&n, &cfg(), t(0)).unwrap();
        assert_eq!(
            (k.severity, k.deadline, k.cordon),
            (
                Severity::Terminate,
                Some("2026-12-02T10:00:00Z".parse().unwrap()),
                false
            )
        );
        // Unreadable: never an invented deadline, still a drain.
        n.annotations
            .insert(ANN_KARPENTER_TERMINATION.into(), "tomorrow".into());
        let k = karpenter(&n, &cfg(), t(0)).unwrap();
        assert_eq!((k.severity, k.deadline), (Severity::Drain, None));
    }

    #[test]
    fn gke_maintenance_drains_from_the_lead_and_terminates_when_ongoing() {
        let mut n = node();
        assert_eq!(gke(&n, &cfg(), t(0)), None);
        n.labels
            .insert(LABEL_GKE_SCHEDULED_MAINTENANCE.into(), "10000".into());
        let early = gke(&n, &cfg(), t(10000 - 3601)).unwrap();
        assert_eq!(
            (early.severity, early.deadline),
            (Severity::Observe, Some(t(10000)))
        );
        let due = gke(&n, &cfg(), t(10000 - 3600)).unwrap();
        assert_eq!(
            (due.severity, due.deadline),
            (Severity::Drain, Some(t(10000)))
        );
        n.labels
            .insert(LABEL_GKE_SCHEDULED_MAINTENANCE.into(), "soon".into());
        assert_eq!(gke(&n, &cfg(), t(0)), None, "garbage is no signal");
        n.labels
            .insert(LABEL_GKE_ACTIVE_MAINTENANCE.into(), "ONGOING".into());
        assert_eq!(gke(&n, &cfg(), t(0)).unwrap().severity, Severity::Terminate);
        let mut m = node();
        m.taints.push(taint(TAINT_GKE_TERMINATION));
        assert_eq!(gke(&m, &cfg(), t(0)).unwrap().severity, Severity::Terminate);
    }

    #[test]
    fn a_foreign_cordon_drains_only_when_asked_and_never_our_own() {
        let mut n = node();
        n.unschedulable = true;
        assert_eq!(foreign_cordon(&n, &cfg(), t(0)), None, "off by default");
        let on = NodeSignalConfig {
            drain_on_foreign_cordon: true,
            ..cfg()
        };
        let f = foreign_cordon(&n, &on, t(0)).unwrap();
        assert_eq!((f.cause, f.cordon), (Cause::Upgrade, false));
        n.annotations
            .insert(keys::ANN_CORDONED.into(), "true".into());
        assert_eq!(foreign_cordon(&n, &on, t(0)), None, "our own cordon");
    }
}
