//! What the providers document, written once: the timelines' truth (which deadlines are hard,
//! when they fall, which matches a game lets end for them) is taken from here, never from
//! lastcall's own rules or settings. Each fact names the public page it comes from.
//!
//! Time runs compressed. A provider's notice of seconds to an hour becomes one of a few
//! seconds ([`run_time`]: each doubling of a notice adds half a second, 30 s becoming 1.5 s),
//! so a timeline lasts seconds while every notice keeps its rank among the others. The agent
//! is configured as an operator following the same pages would configure it (its
//! `--gce-terminate-notice` for the VM's class, its `--gce-preemption-notice`), from the
//! values here; where the agent takes no setting (FleetIQ's Spot notice), the notice is not
//! compressed.

use std::time::Duration;

use super::script::{AzureKind, Safe};

/// A provider's notice as the timelines play it: `1.5 s + 0.5 s × log2(notice / 30 s)`
/// (30 s → 1.5 s, 60 s → 2 s, two minutes → 2.5 s, 15 minutes → about 4 s, an hour → about
/// 5 s). Shorter notices than 30 s are not drawn.
pub fn run_time(notice: Duration) -> Duration {
    let ratio = (notice.as_secs_f64() / 30.0).max(1.0);
    Duration::from_millis((1500.0 + 500.0 * ratio.log2()).round() as u64)
}

/// EC2 Spot: the instance-action notice comes two minutes before the interruption, and its
/// `time` states when it happens.
/// <https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html>
pub const EC2_SPOT_NOTICE: Duration = Duration::from_secs(120);

/// GCE preemption (Spot and preemptible VMs): `preempted` turns `TRUE` with the ACPI G2
/// soft-off, and the VM is powered off (G3) 30 s later.
/// <https://cloud.google.com/compute/docs/instances/spot#preemption-process>
pub const GCE_PREEMPTION_NOTICE: Duration = Duration::from_secs(30);

/// The class of a GCE VM, which decides how long before host maintenance stops it
/// `maintenance-event` says `TERMINATE_ON_HOST_MAINTENANCE`: "Compute Engine gives GPU VMs a
/// 1-hour stopping notice, while normal VMs receive only a 60-second notice".
/// <https://cloud.google.com/compute/docs/gpus/gpu-host-maintenance>,
/// <https://cloud.google.com/compute/docs/metadata/getting-live-migration-notice>
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GceVm {
    Normal,
    Gpu,
}

impl GceVm {
    pub fn terminate_notice(self) -> Duration {
        match self {
            GceVm::Normal => Duration::from_secs(60),
            GceVm::Gpu => Duration::from_secs(3600),
        }
    }
}

/// What a GCE VM does at host maintenance (`scheduling/on-host-maintenance`): `MIGRATE` is
/// live-migrated and keeps running (every process survives; `maintenance-event` says
/// `MIGRATE_ON_HOST_MAINTENANCE` and no new boot follows), `TERMINATE` is stopped (and, set
/// to restart, boots again). GPU VMs cannot be live-migrated.
/// <https://cloud.google.com/compute/docs/instances/host-maintenance-overview>,
/// <https://cloud.google.com/compute/docs/instances/setting-vm-host-options>
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostMaintenance {
    Migrate,
    Terminate,
}

impl HostMaintenance {
    pub fn as_str(self) -> &'static str {
        match self {
            HostMaintenance::Migrate => "MIGRATE",
            HostMaintenance::Terminate => "TERMINATE",
        }
    }

    /// Whether the VM stops when maintenance starts (an `upcoming-maintenance` window going
    /// `ONGOING`): then the window's start is a hard deadline.
    pub fn stops_the_vm(self) -> bool {
        self == HostMaintenance::Terminate
    }
}

/// Azure Scheduled Events: the least notice each event type is scheduled with (a
/// `Terminate` notice is the scale set's `notBeforeTimeout`, 5 to 15 minutes).
/// <https://learn.microsoft.com/en-us/azure/virtual-machines/linux/scheduled-events#event-scheduling>,
/// <https://learn.microsoft.com/en-us/azure/virtual-machine-scale-sets/virtual-machine-scale-sets-terminate-notification>
pub fn azure_min_notice(kind: AzureKind) -> Duration {
    match kind {
        AzureKind::FreezeShort | AzureKind::FreezeLong | AzureKind::Reboot => {
            Duration::from_secs(15 * 60)
        }
        AzureKind::Redeploy => Duration::from_secs(10 * 60),
        AzureKind::Preempt => Duration::from_secs(30),
        AzureKind::Terminate => Duration::from_secs(5 * 60),
    }
}

/// What an Azure event does to a running process (the same page): a `Freeze` pauses the VM
/// for `DurationInSeconds` and every process survives, so nothing ends and whether to keep
/// new matches off is the agent's own choice; the others end the VM at `NotBefore`.
pub fn azure_ends_the_vm(kind: AzureKind) -> bool {
    !matches!(kind, AzureKind::FreezeShort | AzureKind::FreezeLong)
}

/// The EC2 Auto Scaling termination hook: the instance waits up to `HeartbeatTimeout`
/// between heartbeats and at most `min(48 h, 100 × HeartbeatTimeout)` in all, then goes.
/// <https://docs.aws.amazon.com/autoscaling/ec2/userguide/lifecycle-hooks-overview.html>
pub fn asg_global_timeout(heartbeat: Duration) -> Duration {
    (heartbeat * 100).min(Duration::from_secs(48 * 3600))
}

/// Who decided that the machine goes, as the provider's signal tells it: what Agones'
/// `eviction.safe` is about ([`consent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decided {
    /// The platform: host maintenance or retirement, a Spot reclaim, a forced replacement
    /// (Karpenter's expiry). The machine goes whatever anyone wants.
    Platform,
    /// An autoscaler removing capacity it chose to remove.
    Autoscaler,
    /// The signal does not say. An Auto Scaling termination hook runs for a scale-in and for
    /// an instance refresh or a health replacement alike
    /// (<https://docs.aws.amazon.com/autoscaling/ec2/userguide/lifecycle-hooks-overview.html>);
    /// an Azure `Terminate` for a scale set's scale-in and for a user deleting the VM; the
    /// termination time Karpenter writes for consolidation, drift and expiry alike
    /// (<https://karpenter.sh/docs/concepts/disruption/>).
    Either,
}

/// The marks Agones puts on a game server's pod for its `eviction.safe`
/// (<https://agones.dev/site/docs/advanced/controlling-disruption/>, the chart's
/// `agones-gameserver-safe-to-evict-false` PodDisruptionBudget with `maxUnavailable: 0%`
/// selecting `agones.dev/safe-to-evict: "false"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgonesMarks {
    /// `cluster-autoscaler.kubernetes.io/safe-to-evict: "true"`: an autoscaler may take it.
    pub autoscaler_may_evict: bool,
    /// `agones.dev/safe-to-evict: "false"`: the PodDisruptionBudget refuses every eviction.
    pub disruption_budget: bool,
}

pub fn agones_marks(safe: Safe) -> AgonesMarks {
    match safe {
        Safe::Never => AgonesMarks {
            autoscaler_may_evict: false,
            disruption_budget: true,
        },
        Safe::OnUpgrade => AgonesMarks {
            autoscaler_may_evict: false,
            disruption_budget: false,
        },
        Safe::Always => AgonesMarks {
            autoscaler_may_evict: true,
            disruption_budget: false,
        },
    }
}

/// Whether a game lets its match end early (gracefully, at the deadline less its grace) for
/// a machine going by `decided`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consent {
    Yes,
    No,
    /// Yes for one reading of an ambiguous signal, no for the other: ending it and keeping it
    /// are both the agent's to choose, and neither is judged.
    Either,
}

impl Consent {
    fn of(yes: bool) -> Consent {
        if yes { Consent::Yes } else { Consent::No }
    }

    /// Ending the match is not refused.
    pub fn allows(self) -> bool {
        self != Consent::No
    }
}

/// The game's consent, from its pod's marks: an autoscaler honours the
/// `cluster-autoscaler.kubernetes.io/safe-to-evict` annotation, and every other evicting
/// drain (an upgrade, a maintenance drain) meets the PodDisruptionBudget. With
/// `graceful_termination` (lastcall's documented operator setting) the operator has
/// consented for every match.
pub fn consent(safe: Safe, decided: Decided, graceful_termination: bool) -> Consent {
    if graceful_termination {
        return Consent::Yes;
    }
    let marks = agones_marks(safe);
    let platform = !marks.disruption_budget;
    let autoscaler = marks.autoscaler_may_evict;
    match decided {
        Decided::Platform => Consent::of(platform),
        Decided::Autoscaler => Consent::of(autoscaler),
        Decided::Either if platform == autoscaler => Consent::of(platform),
        Decided::Either => Consent::Either,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_keep_their_rank_compressed() {
        let ms = |s: u64| run_time(Duration::from_secs(s)).as_millis();
        assert_eq!(ms(30), 1500);
        assert_eq!(ms(60), 2000);
        assert_eq!(ms(120), 2500);
        assert_eq!(ms(3600), 4953);
        let notices = [
            GCE_PREEMPTION_NOTICE,
            GceVm::Normal.terminate_notice(),
            EC2_SPOT_NOTICE,
            azure_min_notice(AzureKind::Terminate),
            azure_min_notice(AzureKind::Redeploy),
            azure_min_notice(AzureKind::Reboot),
            GceVm::Gpu.terminate_notice(),
        ];
        assert!(notices.windows(2).all(|w| run_time(w[0]) < run_time(w[1])));
    }

    #[test]
    fn agones_consent_follows_the_pods_marks() {
        use Consent::*;
        let table = [
            (Safe::Never, [No, No, No]),
            (Safe::OnUpgrade, [Yes, No, Either]),
            (Safe::Always, [Yes, Yes, Yes]),
        ];
        for (safe, row) in table {
            for (decided, want) in [Decided::Platform, Decided::Autoscaler, Decided::Either]
                .into_iter()
                .zip(row)
            {
                assert_eq!(consent(safe, decided, false), want, "{safe:?} {decided:?}");
                assert_eq!(consent(safe, decided, true), Yes);
            }
        }
        assert_eq!(
            asg_global_timeout(Duration::from_secs(3600)),
            Duration::from_secs(48 * 3600)
        );
        assert!(!azure_ends_the_vm(AzureKind::FreezeLong));
        assert!(HostMaintenance::Terminate.stops_the_vm());
    }
}
