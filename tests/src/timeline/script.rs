//! The generator: a seeded draw of one node's whole timeline, as a list of timed steps.
//!
//! Times are milliseconds from the timeline's start (`t0`); deadlines too, so a printed
//! script reads the same on every run and `TIMELINE_SEED` replays it.

use std::fmt;

use rand::{Rng, SeedableRng, rngs::StdRng};

use super::providers::{self, GceVm, HostMaintenance};

/// The latest moment (ms after `t0`) a timeline waits for a hard deadline.
pub const MAX_RUN_MS: u64 = 6000;

/// `d` in whole milliseconds.
pub fn ms_of(d: std::time::Duration) -> u64 {
    d.as_millis() as u64
}

/// Generator dimensions that need agent behaviour not every build has. All on by default;
/// `TIMELINE_DISABLE=two_agents,hangs` switches some off (see `docs/testing.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dimensions {
    /// A second agent on the node during a rollout (needs one owner per node).
    pub two_agents: bool,
    /// API requests that never come back (needs client timeouts).
    pub hangs: bool,
    /// Abrupt agent kills (needs progress kept on the Node, marks written in order).
    pub aborts: bool,
    /// GCE metadata answering an empty body (needs "empty is neither clear nor Terminate").
    pub gce_empty_body: bool,
    /// AWS `system-maintenance` scheduled events (needs "not a stop": no hard deadline).
    pub system_maintenance: bool,
    /// Deadlines rescheduled later (needs "the current deadline, not the minimum").
    pub later_reschedules: bool,
    /// An Auto Scaling termination lifecycle hook (needs `--asg-lifecycle`).
    pub asg_lifecycle: bool,
    /// Azure Scheduled Events (needs `--azure-events`).
    pub azure_events: bool,
    /// Machines that come back: a new boot id, the old life's notices gone with it (needs
    /// "a new boot starts a new life").
    pub returns: bool,
    /// GameLift dropping the node's game server on its own (needs "deregistered is not
    /// empty").
    pub gamelift_forgets: bool,
    /// An Auto Scaling API that still answers the old state after IMDS said `Terminated`
    /// (needs "read again until the wait shows").
    pub asg_lag: bool,
    /// Nodes without FleetIQ, where a game-server pod the scheduler placed just before the
    /// cordon lands after it (needs "one gate for every hand-off").
    pub without_fleetiq: bool,
    /// An allocator that asks for servers on the node the moment lastcall's fence goes up
    /// (needs "no allocation after the fence" with the exclusion selector, and every
    /// allocated server protected without it).
    pub fence_races: bool,
    /// Release DELETEs failing (5xx, or 429 with `Retry-After`), lagging pod and GameServer
    /// watches, and FleetIQ `SPOT_TERMINATING` (needs "a failed release is labelled", "a
    /// hand-off on a fresh read", "a Spot notice is never withdrawn").
    pub more_faults: bool,
    /// Node signals from clouds and autoscalers: the cluster autoscaler's taint, GKE's
    /// termination taint and maintenance labels, Karpenter's taint with a termination time.
    pub node_signals: bool,
    /// Game servers changing state under the drain: reserved and returned to Ready, one
    /// Starting that turns Ready late.
    pub server_states: bool,
    /// 409 and 422 answers to the agent's writes, and a deregistration GameLift applies
    /// whose answer is lost.
    pub lost_answers: bool,
    /// More signals: an AWS rebalance recommendation (and its TTL running out), GCE's
    /// upcoming maintenance (pending, ongoing, complete), a foreign cordon with
    /// `--drain-on-foreign-cordon`.
    pub more_signals: bool,
    /// The agent's modes: `--dry-run`, `--publish-drain-state`, release pacing,
    /// `--autoscaler-cooperation`.
    pub modes: bool,
    /// The API server restarting: every watch ends, requests answered 503 for a moment, the
    /// watch history gone (a resumed watch is answered 410 and its client lists again).
    pub api_restarts: bool,
    /// A machine that comes back whose kubelet posts the new boot id only after the restarted
    /// agent has read the Node (needs "a new boot is read, not taken from one read").
    pub boot_id_lag: bool,
    /// A GKE hand-back on a VM that migrates live: maintenance done, no new boot (needs "a
    /// hand-back ends with the maintenance, not only with a new boot"); the VM's
    /// host-maintenance policy unreadable at first (needs "unread is not TERMINATE").
    pub live_migration: bool,
    /// A pod landing on an empty node whose release keeps being refused (429) while an Auto
    /// Scaling hook or an Azure event appears (needs "empty only from a pass that succeeded").
    pub stale_empty: bool,
}

impl Dimensions {
    pub const ALL: Dimensions = Dimensions {
        two_agents: true,
        hangs: true,
        aborts: true,
        gce_empty_body: true,
        system_maintenance: true,
        later_reschedules: true,
        asg_lifecycle: true,
        azure_events: true,
        returns: true,
        gamelift_forgets: true,
        asg_lag: true,
        without_fleetiq: true,
        fence_races: true,
        more_faults: true,
        node_signals: true,
        server_states: true,
        lost_answers: true,
        more_signals: true,
        modes: true,
        api_restarts: true,
        boot_id_lag: true,
        live_migration: true,
        stale_empty: true,
    };

    /// `ALL` minus the comma-separated names in `disabled`; an unknown name is an error.
    pub fn without(disabled: &str) -> Result<Dimensions, String> {
        let mut d = Self::ALL;
        for name in disabled.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let flag = match name {
                "two_agents" => &mut d.two_agents,
                "hangs" => &mut d.hangs,
                "aborts" => &mut d.aborts,
                "gce_empty_body" => &mut d.gce_empty_body,
                "system_maintenance" => &mut d.system_maintenance,
                "later_reschedules" => &mut d.later_reschedules,
                "asg_lifecycle" => &mut d.asg_lifecycle,
                "azure_events" => &mut d.azure_events,
                "returns" => &mut d.returns,
                "gamelift_forgets" => &mut d.gamelift_forgets,
                "asg_lag" => &mut d.asg_lag,
                "without_fleetiq" => &mut d.without_fleetiq,
                "fence_races" => &mut d.fence_races,
                "more_faults" => &mut d.more_faults,
                "node_signals" => &mut d.node_signals,
                "server_states" => &mut d.server_states,
                "lost_answers" => &mut d.lost_answers,
                "more_signals" => &mut d.more_signals,
                "modes" => &mut d.modes,
                "api_restarts" => &mut d.api_restarts,
                "boot_id_lag" => &mut d.boot_id_lag,
                "live_migration" => &mut d.live_migration,
                "stale_empty" => &mut d.stale_empty,
                other => return Err(format!("unknown timeline dimension {other:?}")),
            };
            *flag = false;
        }
        Ok(d)
    }
}

/// `spec.eviction.safe` of a Fleet; each Fleet is named after its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Safe {
    Never,
    OnUpgrade,
    Always,
}

impl Safe {
    pub const ALL: [Safe; 3] = [Safe::Never, Safe::OnUpgrade, Safe::Always];

    /// The Fleet name, also the prefix of its GameServers' names.
    pub fn fleet(self) -> &'static str {
        match self {
            Safe::Never => "never",
            Safe::OnUpgrade => "onupgrade",
            Safe::Always => "always",
        }
    }

    pub fn of_server(name: &str) -> Option<Safe> {
        Self::ALL
            .into_iter()
            .find(|s| name.starts_with(&format!("{}-", s.fleet())))
    }
}

/// An AWS scheduled-event code (`instance-stop` ends the VM, `system-reboot` reboots it,
/// `system-maintenance` keeps it running).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventCode {
    InstanceStop,
    InstanceRetirement,
    SystemReboot,
    SystemMaintenance,
}

impl EventCode {
    pub fn as_str(self) -> &'static str {
        match self {
            EventCode::InstanceStop => "instance-stop",
            EventCode::InstanceRetirement => "instance-retirement",
            EventCode::SystemReboot => "system-reboot",
            EventCode::SystemMaintenance => "system-maintenance",
        }
    }

    /// Whether the instance stops or reboots at `NotBefore`: then that time is a hard
    /// deadline. EC2's scheduled events: `instance-stop`, `instance-retirement` and
    /// `system-reboot` stop or reboot it; during `system-maintenance` (network or power
    /// maintenance) it keeps running.
    /// <https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/monitoring-instances-status-check_sched.html>
    pub fn ends_the_vm(self) -> bool {
        !matches!(self, EventCode::SystemMaintenance)
    }
}

/// An Azure Scheduled Events `EventType` (a freeze pauses the VM, the rest end it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AzureKind {
    /// A freeze of a few seconds: only observed.
    FreezeShort,
    /// A freeze of minutes: keeps new matches off, never ends one.
    FreezeLong,
    Reboot,
    Redeploy,
    /// A Spot eviction: never withdrawn.
    Preempt,
    /// A scale-set scale-in.
    Terminate,
}

impl AzureKind {
    pub fn event_type(self) -> &'static str {
        match self {
            AzureKind::FreezeShort | AzureKind::FreezeLong => "Freeze",
            AzureKind::Reboot => "Reboot",
            AzureKind::Redeploy => "Redeploy",
            AzureKind::Preempt => "Preempt",
            AzureKind::Terminate => "Terminate",
        }
    }

    /// Whether the VM ends at `NotBefore`: then that time is a hard deadline
    /// ([`providers::azure_ends_the_vm`]).
    pub fn ends_the_vm(self) -> bool {
        providers::azure_ends_the_vm(self)
    }
}

/// A Kubernetes API fault injected into the emulator (`kube::faults`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KubeFault {
    /// The next `n` writes to the Node answer this status.
    FailNode { n: usize, status: u16 },
    /// The next `n` GameServer writes answer this status.
    FailGameServers { n: usize, status: u16 },
    /// The next write to the Node is accepted and never answered.
    HangNode,
    /// The next GameServer write is accepted and never answered.
    HangGameServers,
    /// The next `n` pod evictions answer 503.
    FailEvictions { n: usize },
    /// The next `n` GameServer DELETEs (releases) answer this status (429 comes with
    /// `Retry-After: 1`, as API Priority and Fairness sends it).
    FailReleases { n: usize, status: u16 },
    /// From now on, every watch of pods and GameServers delivers its events this late (a
    /// lagging watch cache).
    LagWatches { ms: u64 },
    /// The agent's next write of this kind is applied and its answer lost (`504 Timeout`).
    LoseAnswer(Write),
}

/// GCE's `maintenance_status` of an upcoming maintenance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upcoming {
    Pending,
    Ongoing,
    Complete,
}

/// A kind of write the agent makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// A Node PATCH: the fence, its progress, its undoing.
    Node,
    /// A GameServer PATCH: a mark, a deadline announced.
    GameServer,
    /// A GameServer DELETE: a release.
    Release,
    /// A pod eviction: a match ended.
    Eviction,
}

/// One thing that happens to the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// IMDS `events/maintenance/scheduled` holds one active event (the same EventId, so a
    /// new `NotBefore` is a reschedule).
    ImdsScheduled {
        code: EventCode,
        not_before_ms: u64,
    },
    /// The scheduled event is canceled.
    ImdsScheduledCancel,
    /// IMDS `spot/instance-action` (never withdrawn), its `time` EC2's two minutes after
    /// the notice ([`providers::EC2_SPOT_NOTICE`]).
    ImdsSpot {
        at_ms: u64,
    },
    /// GCE `maintenance-event` = `TERMINATE_ON_HOST_MAINTENANCE` (deadline: now + the VM
    /// class's notice, [`GceVm::terminate_notice`]).
    GceTerminate,
    /// GCE `maintenance-event` = `NONE`.
    GceNone,
    /// GCE `maintenance-event` answers an empty body (a glitch: changes nothing).
    GceEmpty,
    /// GCE `preempted` = `TRUE` (deadline: now + ACPI G2 to G3,
    /// [`providers::GCE_PREEMPTION_NOTICE`]; never withdrawn).
    GcePreempted,
    /// The Auto Scaling group terminates the instance: it waits on the termination hook and
    /// IMDS `autoscaling/target-lifecycle-state` reads `Terminated` (never withdrawn).
    AsgTerminate,
    /// Azure event `episode` (its own EventId) is listed with this `NotBefore`; listed again,
    /// its `NotBefore` moved.
    AzureEvent {
        episode: u8,
        kind: AzureKind,
        not_before_ms: u64,
    },
    /// Azure event `episode` vanishes from the document (completed or cancelled).
    AzureGone {
        episode: u8,
    },
    /// Not drawn: the agent approved Azure event `episode` (read from the emulator after
    /// the run; the platform may start it at once).
    AzureApproved {
        episode: u8,
    },
    /// FleetIQ status published on Redis as pubsub does.
    FleetIq {
        draining: bool,
    },
    /// FleetIQ `SPOT_TERMINATING` published on Redis (never withdrawn: a later `ACTIVE`
    /// from a lagging replica does not cancel it).
    FleetIqSpot,
    /// The operator's `lastcall.dev/drain=true` label on or off.
    Manual(bool),
    /// Karpenter's `karpenter.sh/disrupted:NoSchedule` taint on or off (off also removes
    /// the termination time [`Action::KarpenterAt`] writes).
    Karpenter(bool),
    /// Karpenter taints the node with a `terminationGracePeriod`: the taint and
    /// `karpenter.sh/nodeclaim-termination-timestamp`, when it deletes every pod left.
    KarpenterAt {
        at_ms: u64,
    },
    /// The cluster autoscaler's `ToBeDeletedByClusterAutoscaler:NoSchedule` taint on or off.
    Autoscaler(bool),
    /// GKE's `cloud.google.com/impending-node-termination:NoSchedule` taint on or off.
    GkeTaint(bool),
    /// GKE's `cloud.google.com/active-node-maintenance=ONGOING` label on or off.
    GkeOngoing(bool),
    /// GKE's `cloud.google.com/scheduled-maintenance-time` label (Unix seconds) set or
    /// moved, or removed.
    GkeMaintenance {
        epoch_ms: Option<u64>,
    },
    /// Someone else strips lastcall's taint from the Node (a reverted write).
    RevertTaint,
    /// The agent shuts down cleanly and a new one starts.
    RestartAgent,
    /// The agent task is killed; a new one starts after `gap_ms`.
    AbortAgent {
        gap_ms: u64,
    },
    /// A second agent starts on the node (a rollout); the older one stops `overlap_ms` later.
    Rollout {
        overlap_ms: u64,
    },
    Fault(KubeFault),
    /// FleetIQ's `DeregisterGameServer` fails once with a 500.
    FailDeregister,
    /// GameLift applies the next `DeregisterGameServer` and its answer is lost: the agent
    /// sees its call fail (a 500 after the fact) though the server is gone.
    DeregisterAnswerLost,
    /// Auto Scaling applies the next `CompleteLifecycleAction` and its answer is lost.
    AsgCompleteAnswerLost,
    /// GameLift drops the node's game server on its own (its heartbeats stopped, an old
    /// agent's exit deregistered it): unregistered with no call of this agent's.
    GameLiftForgets,
    /// The machine went down and came back (a stopped Spot VM started again, a reboot): a
    /// new boot id, the agent's container restarted, and the cloud's notices gone with the
    /// old boot (the operator's label and Karpenter's taint are on the Node and stay).
    MachineReturns,
    /// Arms a game server that a scheduler working from a cache of a moment ago places on
    /// the node as lastcall's fence goes up: it tolerates everything and its pod lands
    /// `bind_lag_ms` later, within `--deregister-settle`.
    LateServer,
    /// The allocator asks for a server of this Fleet on the node.
    Allocate(Safe),
    /// Arms an allocator that races lastcall's fence: the first time the fence's taint is
    /// seen, it asks for a server of this Fleet on the node at once and twice shortly
    /// after (with the exclusion selector when the timeline uses it).
    AllocateAtFence(Safe),
    /// A running match on the node ends (the game calls `Shutdown()`).
    EndMatch,
    /// IMDS `events/recommendations/rebalance` appears (never withdrawn by AWS).
    ImdsRebalance,
    /// Not drawn: the rebalance recommendation's `--rebalance-ttl` ran out (counted from its
    /// `noticeTime`: the operator's setting for how long it holds the node).
    RebalanceExpires,
    /// Not drawn: the node's Karpenter NodeClaim expires `--maintenance-lead` from now (the
    /// node takes no new match from here); `end_ms`, the expiry plus its
    /// `terminationGracePeriod`, is when Karpenter deletes every pod left (`None`: it has no
    /// grace period, so nothing is killed).
    NodeClaimFence {
        /// From `t0`: negative where it lies before (the NodeClaim is created before the
        /// agent starts, as Karpenter registers the node before its pods run).
        end_ms: Option<i64>,
    },
    /// GCE `instance/upcoming-maintenance`: a window starting at `window_ms`, in this state
    /// (`Complete`: the key gone, 404).
    GceUpcoming {
        status: Upcoming,
        window_ms: u64,
    },
    /// The operator cordons (`true`) or uncordons the node (`kubectl cordon`).
    OperatorCordon(bool),
    /// The API server restarts, down (answering 503) for `down_ms`; watches resumed from
    /// before it are answered 410 and re-list.
    ApiRestart {
        down_ms: u64,
    },
    /// The game on a Ready server of the node reserves it (SDK `Reserve`).
    Reserve,
    /// A Reserved server's reservation runs out: back to Ready (SDK `Ready`).
    Unreserve,
    /// The game server that started slowly on the node calls `Ready()`.
    TurnsReady,
    /// A game server that tolerates everything (blanket tolerations) is placed on the node,
    /// the pod watch delivers 400 ms late from then on, and the next `refusals` release
    /// DELETEs are answered 429 with `Retry-After`.
    StrayServer {
        refusals: usize,
    },
    /// Not drawn: GKE migrates the VM live, started by the agent's hand-back
    /// (`maintenance-event` is `MIGRATE_ON_HOST_MAINTENANCE` meanwhile).
    GceMigrating,
}

impl Action {
    /// Whether the step is a signal's (or its withdrawal, or the machine's return, which
    /// ends the machine's own signals): what asks for a drain or stops asking.
    pub fn is_signal(&self) -> bool {
        matches!(
            self,
            Action::ImdsScheduled { .. }
                | Action::ImdsScheduledCancel
                | Action::ImdsSpot { .. }
                | Action::GceTerminate
                | Action::GceNone
                | Action::GceEmpty
                | Action::GcePreempted
                | Action::AsgTerminate
                | Action::AzureEvent { .. }
                | Action::AzureGone { .. }
                | Action::FleetIq { .. }
                | Action::FleetIqSpot
                | Action::Manual(_)
                | Action::Karpenter(_)
                | Action::KarpenterAt { .. }
                | Action::Autoscaler(_)
                | Action::GkeTaint(_)
                | Action::GkeOngoing(_)
                | Action::GkeMaintenance { .. }
                | Action::ImdsRebalance
                | Action::GceUpcoming { .. }
                | Action::OperatorCordon(_)
                | Action::MachineReturns
                | Action::NodeClaimFence { .. }
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub at_ms: u64,
    pub action: Action,
}

/// The whole drawn timeline.
#[derive(Clone, Debug)]
pub struct Timeline {
    pub seed: u64,
    pub dims: Dimensions,
    /// Ready servers per Fleet at the start, in `Safe::ALL` order.
    pub ready: [usize; 3],
    /// Allocated servers per Fleet at the start.
    pub allocated: [usize; 3],
    /// `terminationGracePeriodSeconds` per Fleet.
    pub grace_s: [i64; 3],
    /// The allocator excludes `lastcall.dev/node-draining=true` (as the docs ask).
    pub exclusion_selector: bool,
    pub graceful_termination: bool,
    /// The operator had cordoned the node before any signal.
    pub foreign_cordon: bool,
    /// The GCE VM's class: how long before host maintenance stops it GCE says so.
    pub gce_vm: GceVm,
    /// The GCE VM's `scheduling/on-host-maintenance`.
    pub host_maintenance: HostMaintenance,
    /// The termination hook's heartbeat timeout (its cap is 100 times this).
    pub asg_heartbeat_s: u64,
    /// `--azure-approve-when-empty`.
    pub azure_approve: bool,
    /// Agones 1.58 or later: the agent selects its servers by `status.nodeName` (no claims).
    pub agones_selectable_fields: bool,
    /// The node is in a FleetIQ game server group (else the agent runs without FleetIQ).
    pub fleetiq: bool,
    /// How many `DescribeAutoScalingInstances` answers lag behind IMDS' `Terminated`.
    pub asg_lag: usize,
    /// How long the scheduler takes to bind a pod it decided on (0: at once).
    pub bind_lag_ms: u64,
    pub steps: Vec<Step>,
    /// All matches end at the last step (otherwise `Never` matches may hold the drain).
    pub end_all_at_ms: u64,
    /// A game server on the node still Starting when the timeline begins (it turns Ready at
    /// [`Action::TurnsReady`]).
    pub slow_starter: bool,
    /// `--rebalance-ttl` in ms (0: the default, far beyond the run).
    pub rebalance_ttl_ms: u64,
    /// `--drain-on-foreign-cordon`.
    pub drain_on_foreign_cordon: bool,
    /// The node was launched by Karpenter with a NodeClaim that expires in the run.
    pub nodeclaim: Option<NodeClaim>,
    /// The only signal is an IMDS, Azure or GCE event cancelled just before its matches are due
    /// ([`late_cancel`]).
    pub late_cancel: bool,
    /// The agent's modes.
    pub mode: Modes,
    /// A staged race replacing the drawn steps ([`Staged`]).
    pub staged: Option<Staged>,
    /// A machine that comes back gets its new boot id from the kubelet only after the
    /// restarted agent's first read of the Node.
    pub boot_id_lag: bool,
    /// `--gke-hand-back`, with GCE's upcoming maintenance reschedulable (`can_reschedule`).
    pub gke_hand_back: bool,
    /// The first reads of GCE's `scheduling/on-host-maintenance` that answer 503.
    pub policy_read_faults: usize,
}

/// A race the timelines stage whole, each from a stream of its own, in place of the drawn
/// signals (other draws of the seed kept where they cannot spoil it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staged {
    /// FleetIQ asks for a drain on an empty node, which is deregistered; the machine comes
    /// back with nothing live, and the kubelet posts its new boot id only after the restarted
    /// agent read the Node: the agent must register again and lift the fence.
    BootIdLag,
    /// GCE's upcoming maintenance, reschedulable, on a GKE node with `--gke-hand-back` and a
    /// VM that migrates live: once the node is empty the agent hands it back, GKE migrates
    /// the VM (no new boot) and the maintenance is done: the node must be lifted again. Half
    /// the time the window goes `ONGOING` instead, with no hand-back: on a VM that migrates,
    /// no deadline, so no match may end, and mostly the policy's reads fail until after it
    /// (unread, the policy is not `TERMINATE`). Otherwise its first reads may fail.
    LiveMigration { hand_back: bool },
    /// The operator's drain on a node without FleetIQ (an Agones that selects by field); once
    /// it is empty a game server that tolerates everything lands there, its releases refused
    /// with 429s, while an Auto Scaling termination (or an Azure event, approvals on)
    /// appears: nothing may be handed over while the pod is there.
    StaleEmpty { asg: bool },
}

impl Staged {
    /// At most one per timeline, none with a late cancel (its own stage).
    fn draw(seed: u64, dims: Dimensions) -> Option<Staged> {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x7374_6167_6564);
        let pick = rng.random_range(0..100);
        let asg = dims.asg_lifecycle && (!dims.azure_events || rng.random_bool(0.5));
        match pick {
            0..10 if dims.boot_id_lag && dims.returns => Some(Staged::BootIdLag),
            10..24 if dims.live_migration => Some(Staged::LiveMigration {
                hand_back: rng.random_bool(0.5),
            }),
            24..34 if dims.stale_empty && (dims.asg_lifecycle || dims.azure_events) => {
                Some(Staged::StaleEmpty { asg })
            }
            _ => None,
        }
    }

    /// The staged steps, from `t` (ms), and the Fleets' matches: `(steps, an Always match
    /// that ends only at the end)`.
    fn steps(self, seed: u64) -> (Vec<Step>, bool) {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x7374_6570_7321);
        let t = rng.random_range(0..300);
        let step = |at_ms, action| Step { at_ms, action };
        match self {
            Staged::BootIdLag => (
                vec![
                    step(t, Action::FleetIq { draining: true }),
                    step(t + rng.random_range(1800..=2500), Action::MachineReturns),
                ],
                false,
            ),
            Staged::LiveMigration { hand_back: true } => (
                vec![step(
                    t,
                    Action::GceUpcoming {
                        status: Upcoming::Pending,
                        window_ms: t + 4500,
                    },
                )],
                false,
            ),
            Staged::LiveMigration { hand_back: false } => {
                let window_ms = t + rng.random_range(1200..=1800);
                (
                    vec![
                        step(
                            t,
                            Action::GceUpcoming {
                                status: Upcoming::Pending,
                                window_ms,
                            },
                        ),
                        step(
                            window_ms,
                            Action::GceUpcoming {
                                status: Upcoming::Ongoing,
                                window_ms,
                            },
                        ),
                        step(
                            window_ms + rng.random_range(1500..=2500),
                            Action::GceUpcoming {
                                status: Upcoming::Complete,
                                window_ms,
                            },
                        ),
                    ],
                    true,
                )
            }
            Staged::StaleEmpty { asg } => {
                // Once the released servers' grace periods are over and the node is empty
                // (the runner also waits for the agent to say so).
                let stray = t + rng.random_range(3000..=3500);
                let then = stray + rng.random_range(500..=900);
                let hand_off = if asg {
                    Action::AsgTerminate
                } else {
                    Action::AzureEvent {
                        episode: 1,
                        kind: [AzureKind::Reboot, AzureKind::Terminate][rng.random_range(0..2)],
                        not_before_ms: then
                            + ms_of(providers::run_time(providers::azure_min_notice(
                                AzureKind::Reboot,
                            ))),
                    }
                };
                (
                    vec![
                        step(t, Action::Manual(true)),
                        step(stray, Action::StrayServer { refusals: 2 }),
                        step(then, hand_off),
                    ],
                    false,
                )
            }
        }
    }
}

/// `--maintenance-lead` where a NodeClaim expires: longer than any other drawn signal's
/// deadline is ahead of it (those stay "within the lead", as with the default hour), so only
/// the NodeClaim's fence waits for it.
pub const NODECLAIM_LEAD_S: u64 = 20;

/// A Karpenter NodeClaim owning the node, created as the timeline starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeClaim {
    /// `spec.expireAfter` in seconds: either longer than `NODECLAIM_LEAD_S`, so the fence
    /// comes within the run, or a few seconds, so the fence is at once and the expiry (and
    /// its grace period's end) within the run.
    pub expire_s: u64,
    /// `spec.terminationGracePeriod` in seconds, if any.
    pub grace_s: Option<u64>,
}

impl NodeClaim {
    /// Drawn from a stream of its own, with the Node signals.
    fn draw(seed: u64, dims: Dimensions) -> Option<NodeClaim> {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x636c_6169_6d21);
        if !(dims.node_signals && rng.random_bool(0.15)) {
            return None;
        }
        Some(if rng.random_bool(0.5) {
            NodeClaim {
                expire_s: NODECLAIM_LEAD_S + rng.random_range(1..=4),
                grace_s: rng.random_bool(0.6).then(|| rng.random_range(1..=30)),
            }
        } else {
            NodeClaim {
                expire_s: rng.random_range(4..=6),
                grace_s: rng.random_bool(0.7).then(|| rng.random_range(1..=2)),
            }
        })
    }

    /// How long after its creation the NodeClaim's fence comes, in ms.
    pub fn fence_after_ms(&self) -> u64 {
        self.expire_s.saturating_sub(NODECLAIM_LEAD_S) * 1000
    }

    /// How long after its creation Karpenter deletes every pod left, in ms.
    pub fn end_after_ms(&self) -> Option<u64> {
        self.grace_s.map(|g| (self.expire_s + g) * 1000)
    }
}

/// The agent's modes a timeline runs it in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Modes {
    /// `--dry-run`: the agent must send no write at all (the world is judged by that alone).
    pub dry_run: bool,
    /// `--publish-drain-state` (FleetIQ nodes: the Redis is there).
    pub publish_drain_state: bool,
    /// Release pacing: `--release-floor 1 --release-interval 150ms --release-hold-max 1s`.
    pub pacing: bool,
    /// `--autoscaler-cooperation`: `in-use` or `all`.
    pub cooperation: Option<&'static str>,
    /// `--compat-taints`: the original adapter's NoExecute taints, which the taint manager
    /// acts on (the world, not the agent, ends a match that does not tolerate them).
    pub compat_taints: bool,
    /// With compat taints: the Fleets' pods tolerate `gamelift.status/active`, as the
    /// original's setup required (without it the agent must not add that taint).
    pub tolerate_active: bool,
}

impl Modes {
    /// Compat mode, from a stream of its own (other seeds keep their scripts).
    fn compat(seed: u64) -> Modes {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x636f_6d70_6174);
        let compat_taints = rng.random_bool(0.15);
        Modes {
            compat_taints,
            tolerate_active: compat_taints && rng.random_bool(0.5),
            ..Modes::default()
        }
    }

    fn draw(seed: u64, dims: Dimensions, fleetiq: bool, selectable_fields: bool) -> Modes {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x6d6f_6465_7321);
        if !dims.modes {
            return Modes::default();
        }
        Modes {
            // By field only: claiming servers by label is a write, which a dry run never sends.
            dry_run: selectable_fields && rng.random_bool(0.12),
            publish_drain_state: fleetiq && rng.random_bool(0.3),
            pacing: rng.random_bool(0.2),
            cooperation: rng
                .random_bool(0.2)
                .then(|| ["in-use", "all"][rng.random_range(0..2)]),
            ..Modes::compat(seed)
        }
    }
}

impl Timeline {
    /// Draws the timeline for `seed`.
    pub fn draw(seed: u64, dims: Dimensions) -> Timeline {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut ready = [0; 3];
        let mut allocated = [0; 3];
        let mut grace_s = [1; 3];
        for i in 0..3 {
            ready[i] = rng.random_range(0..=2);
            allocated[i] = rng.random_range(0..=2);
            grace_s[i] = rng.random_range(1..=2);
        }
        // Mostly a match to protect; sometimes none, so the node empties and is
        // deregistered mid-timeline and later signals meet a deregistered node.
        if rng.random_bool(0.25) {
            allocated = [0; 3];
            if ready.iter().sum::<usize>() == 0 {
                ready[0] = 1;
            }
        } else if allocated.iter().sum::<usize>() == 0 {
            allocated[rng.random_range(0..3)] = 1;
        }
        let mut steps = vec![];
        let horizon: u64 = 2200;
        let at = |rng: &mut StdRng| rng.random_range(0..horizon);
        let deadline = |rng: &mut StdRng, from: u64| from + rng.random_range(1500..=4500);

        // Signals: two or more sources, some moving, cancelled and re-appearing.
        let n_signals = rng.random_range(2..=5);
        let mut asg_drawn = false;
        let mut episode = 0u8;
        for _ in 0..n_signals {
            let t = at(&mut rng);
            let mut kind = rng.random_range(0..10);
            if (kind == 8 && (!dims.asg_lifecycle || asg_drawn))
                || (kind == 9 && !dims.azure_events)
            {
                kind = 7;
            }
            match kind {
                0 | 1 => {
                    let code = match rng.random_range(0..4) {
                        0 => EventCode::InstanceStop,
                        1 => EventCode::InstanceRetirement,
                        2 => EventCode::SystemReboot,
                        _ if dims.system_maintenance => EventCode::SystemMaintenance,
                        _ => EventCode::InstanceStop,
                    };
                    let mut nb = deadline(&mut rng, t);
                    steps.push(Step {
                        at_ms: t,
                        action: Action::ImdsScheduled {
                            code,
                            not_before_ms: nb,
                        },
                    });
                    // Moves, a cancel, a re-appearance.
                    let mut t2 = t;
                    for _ in 0..rng.random_range(0..=3) {
                        t2 += rng.random_range(150..700);
                        match rng.random_range(0..3) {
                            0 => steps.push(Step {
                                at_ms: t2,
                                action: Action::ImdsScheduledCancel,
                            }),
                            1 if dims.later_reschedules => {
                                nb += rng.random_range(1000..=3000);
                                steps.push(Step {
                                    at_ms: t2,
                                    action: Action::ImdsScheduled {
                                        code,
                                        not_before_ms: nb,
                                    },
                                });
                            }
                            _ => {
                                nb = (nb.saturating_sub(rng.random_range(500..=1500)))
                                    .max(t2 + 1000);
                                steps.push(Step {
                                    at_ms: t2,
                                    action: Action::ImdsScheduled {
                                        code,
                                        not_before_ms: nb,
                                    },
                                });
                            }
                        }
                    }
                }
                2 => {
                    if rng.random_bool(0.5) {
                        // EC2's two minutes (the draw kept, so the stream stays as it was).
                        let _ = deadline(&mut rng, t);
                        let d = t + ms_of(providers::run_time(providers::EC2_SPOT_NOTICE));
                        steps.push(Step {
                            at_ms: t,
                            action: Action::ImdsSpot { at_ms: d },
                        });
                    } else {
                        steps.push(Step {
                            at_ms: t,
                            action: Action::GcePreempted,
                        });
                    }
                }
                3 => {
                    steps.push(Step {
                        at_ms: t,
                        action: Action::GceTerminate,
                    });
                    let mut t2 = t;
                    for _ in 0..rng.random_range(0..=3) {
                        t2 += rng.random_range(150..700);
                        let action = match rng.random_range(0..3) {
                            0 if dims.gce_empty_body => Action::GceEmpty,
                            1 => Action::GceTerminate,
                            _ => Action::GceNone,
                        };
                        steps.push(Step { at_ms: t2, action });
                    }
                }
                4 | 5 => {
                    let mut on = true;
                    let mut t2 = t;
                    for _ in 0..rng.random_range(1..=3) {
                        steps.push(Step {
                            at_ms: t2,
                            action: Action::FleetIq { draining: on },
                        });
                        on = !on;
                        t2 += rng.random_range(200..900);
                    }
                }
                6 => {
                    let mut on = true;
                    let mut t2 = t;
                    for _ in 0..rng.random_range(1..=3) {
                        steps.push(Step {
                            at_ms: t2,
                            action: Action::Manual(on),
                        });
                        on = !on;
                        t2 += rng.random_range(200..900);
                    }
                }
                8 => {
                    asg_drawn = true;
                    steps.push(Step {
                        at_ms: t,
                        action: Action::AsgTerminate,
                    });
                }
                9 => {
                    episode += 1;
                    let kind = match rng.random_range(0..6) {
                        0 => AzureKind::FreezeShort,
                        1 => AzureKind::FreezeLong,
                        2 => AzureKind::Reboot,
                        3 => AzureKind::Redeploy,
                        4 => AzureKind::Preempt,
                        _ => AzureKind::Terminate,
                    };
                    // Never sooner than Azure's least notice for the type, whenever it is
                    // listed or moved.
                    let least = ms_of(providers::run_time(providers::azure_min_notice(kind)));
                    let mut nb = deadline(&mut rng, t).max(t + least);
                    steps.push(Step {
                        at_ms: t,
                        action: Action::AzureEvent {
                            episode,
                            kind,
                            not_before_ms: nb,
                        },
                    });
                    // Moves later and earlier, then maybe it vanishes (a Spot eviction's
                    // notice stays whatever the document says). Each version stands for at
                    // least two of the agent's polls (200 ms): a real event stands for
                    // minutes, and a version no poll could see is not one the agent missed.
                    let mut t2 = t;
                    for _ in 0..rng.random_range(0..=2) {
                        t2 += rng.random_range(450..1000);
                        nb = if rng.random_bool(0.5) {
                            nb + rng.random_range(1000..=3000)
                        } else {
                            nb.saturating_sub(rng.random_range(500..=1500))
                                .max(t2 + 1000)
                        }
                        .max(t2 + least);
                        steps.push(Step {
                            at_ms: t2,
                            action: Action::AzureEvent {
                                episode,
                                kind,
                                not_before_ms: nb,
                            },
                        });
                    }
                    if rng.random_bool(0.4) {
                        steps.push(Step {
                            at_ms: t2 + rng.random_range(450..1000),
                            action: Action::AzureGone { episode },
                        });
                    }
                }
                _ => {
                    steps.push(Step {
                        at_ms: t,
                        action: Action::Karpenter(true),
                    });
                    if rng.random_bool(0.6) {
                        steps.push(Step {
                            at_ms: t + rng.random_range(300..1500),
                            action: Action::Karpenter(false),
                        });
                    }
                }
            }
        }
        // The agent's life.
        for _ in 0..rng.random_range(0..=2) {
            let t = at(&mut rng);
            let action = match rng.random_range(0..3) {
                0 => Action::RestartAgent,
                1 if dims.aborts => Action::AbortAgent {
                    gap_ms: rng.random_range(0..400),
                },
                2 if dims.two_agents => Action::Rollout {
                    overlap_ms: rng.random_range(100..1500),
                },
                _ => Action::RestartAgent,
            };
            steps.push(Step { at_ms: t, action });
        }
        // The API misbehaving.
        for _ in 0..rng.random_range(0..=2) {
            let t = at(&mut rng);
            let status = if rng.random_bool(0.5) { 500 } else { 503 };
            let action = match rng.random_range(0..7) {
                0 => Action::Fault(KubeFault::FailNode {
                    n: rng.random_range(1..=3),
                    status,
                }),
                1 => Action::Fault(KubeFault::FailGameServers {
                    n: rng.random_range(1..=3),
                    status,
                }),
                2 if dims.hangs => Action::Fault(KubeFault::HangNode),
                3 if dims.hangs => Action::Fault(KubeFault::HangGameServers),
                4 => Action::Fault(KubeFault::FailEvictions {
                    n: rng.random_range(1..=2),
                }),
                5 => Action::RevertTaint,
                _ => Action::FailDeregister,
            };
            steps.push(Step { at_ms: t, action });
        }
        // Allocations and match ends racing all of it.
        for _ in 0..rng.random_range(0..=4) {
            let t = at(&mut rng);
            let safe = Safe::ALL[rng.random_range(0..3)];
            steps.push(Step {
                at_ms: t,
                action: Action::Allocate(safe),
            });
        }
        for _ in 0..rng.random_range(0..=2) {
            steps.push(Step {
                at_ms: at(&mut rng),
                action: Action::EndMatch,
            });
        }
        // The hand-off edges, from their own stream so every other draw of a seed stays
        // what it was before these existed.
        let edges = Edges::draw(seed, dims, asg_drawn, horizon, &mut steps);
        if edges.empty_node {
            ready = [0; 3];
            allocated = [0; 3];
        }
        // An allocator racing the fence, from its own stream too.
        let mut racing = StdRng::seed_from_u64(seed ^ 0x7261_6365_7321);
        if dims.fence_races && racing.random_bool(0.4) {
            steps.push(Step {
                at_ms: 0,
                action: Action::AllocateAtFence(Safe::ALL[racing.random_range(0..3)]),
            });
        }
        // More faults and FleetIQ's Spot notice, from a stream of their own as well.
        let mut more = StdRng::seed_from_u64(seed ^ 0x6d6f_7265_2121);
        if dims.more_faults {
            if more.random_bool(0.3) {
                let status = [500, 503, 429][more.random_range(0..3)];
                steps.push(Step {
                    at_ms: more.random_range(0..horizon),
                    action: Action::Fault(KubeFault::FailReleases {
                        n: more.random_range(1..=3),
                        status,
                    }),
                });
            }
            if more.random_bool(0.2) {
                steps.push(Step {
                    at_ms: more.random_range(0..horizon),
                    action: Action::Fault(KubeFault::LagWatches {
                        ms: more.random_range(100..=500),
                    }),
                });
            }
            if edges.fleetiq && more.random_bool(0.15) {
                let t = more.random_range(0..horizon);
                steps.push(Step {
                    at_ms: t,
                    action: Action::FleetIqSpot,
                });
                // A lagging replica answers ACTIVE afterwards: the notice stands.
                if more.random_bool(0.5) {
                    steps.push(Step {
                        at_ms: t + more.random_range(200..800),
                        action: Action::FleetIq { draining: false },
                    });
                }
            }
        }
        // GCE's notices are the VM class's (the two draws kept, so the stream stays as it was).
        let _ = rng.random_range(2..=3);
        let mut gce_vm = if rng.random_range(2..=3) == 3 {
            GceVm::Gpu
        } else {
            GceVm::Normal
        };
        let asg_heartbeat_s = rng.random_range(2..=3);
        let azure_approve = rng.random_bool(0.5);
        let exclusion_selector = rng.random_bool(0.5);
        let graceful_termination = rng.random_bool(0.3);
        let foreign_cordon = rng.random_bool(0.15);
        // Its own stream: every seed's script stays what it was before this was drawn.
        let mut agones_selectable_fields =
            StdRng::seed_from_u64(seed ^ 0x6167_6f6e_6573).random_bool(0.5);
        let mode = Modes::draw(seed, dims, edges.fleetiq, agones_selectable_fields);
        let later = Later::draw(
            seed,
            dims,
            edges.fleetiq,
            foreign_cordon,
            horizon,
            &mut steps,
        );
        let late_cancel = late_cancel(
            seed,
            dims,
            &grace_s,
            &mut allocated,
            &mut gce_vm,
            &mut steps,
        );
        // A staged race replaces the drawn signals and whatever could spoil it.
        let staged = Staged::draw(seed, dims).filter(|_| !late_cancel);
        let mut fleetiq = edges.fleetiq;
        let mut mode = mode;
        let (mut later, mut bind_lag_ms, mut asg_lag) = (later, edges.bind_lag_ms, edges.asg_lag);
        let mut host_maintenance = HostMaintenance::Terminate;
        let (mut gke_hand_back, mut policy_read_faults, mut azure_approve) =
            (false, 0, azure_approve);
        if let Some(st) = staged {
            let (staged_steps, always_match) = st.steps(seed);
            steps = staged_steps;
            allocated = [0; 3];
            if always_match {
                allocated[Safe::Always as usize] = 1;
            }
            if ready.iter().sum::<usize>() == 0 {
                ready[Safe::Never as usize] = 1;
            }
            later = Later {
                slow_starter: false,
                rebalance_ttl_ms: 0,
                drain_on_foreign_cordon: false,
            };
            (bind_lag_ms, asg_lag) = (0, 0);
            mode.dry_run = false;
            let mut rng = StdRng::seed_from_u64(seed ^ 0x706f_6c69_6379);
            match st {
                Staged::BootIdLag => fleetiq = true,
                Staged::LiveMigration { hand_back } => {
                    fleetiq = false;
                    host_maintenance = HostMaintenance::Migrate;
                    gke_hand_back = hand_back;
                    // A blip or two; where the window goes ONGOING, mostly every read until
                    // well after it (the policy stays unknown).
                    policy_read_faults = if hand_back || rng.random_bool(0.3) {
                        rng.random_range(0..=2)
                    } else {
                        40
                    };
                }
                Staged::StaleEmpty { asg } => {
                    fleetiq = false;
                    azure_approve = azure_approve || !asg;
                    // Selected by field: no claim write of its own for the stray server, so
                    // the first pass that sees it releases it (and is refused).
                    agones_selectable_fields = true;
                }
            }
        }
        if !fleetiq {
            mode.publish_drain_state = false;
        }
        // A machine that comes back gets its new boot id late in the staged race, and in half
        // the others that draw a return (a stream of its own).
        let boot_id_lag = staged == Some(Staged::BootIdLag)
            || (dims.boot_id_lag
                && steps
                    .iter()
                    .any(|s| matches!(s.action, Action::MachineReturns))
                && StdRng::seed_from_u64(seed ^ 0x626f_6f74_6c61_6721).random_bool(0.5));
        steps.sort_by_key(|s| s.at_ms);
        // Run until the last hard deadline has passed (capped), so the agent's verdicts at
        // `deadline − grace` happen inside the timeline.
        let last_hard = steps
            .iter()
            .map(|s| match s.action {
                Action::ImdsScheduled { not_before_ms, .. } => not_before_ms,
                Action::ImdsSpot { at_ms } => at_ms,
                Action::KarpenterAt { at_ms } => at_ms,
                Action::GceUpcoming {
                    status: Upcoming::Ongoing,
                    window_ms,
                } => window_ms,
                Action::GcePreempted => {
                    s.at_ms + ms_of(providers::run_time(providers::GCE_PREEMPTION_NOTICE))
                }
                Action::GceTerminate => {
                    s.at_ms + ms_of(providers::run_time(gce_vm.terminate_notice()))
                }
                Action::AzureEvent {
                    kind,
                    not_before_ms,
                    ..
                } if kind.ends_the_vm() => not_before_ms,
                _ => 0,
            })
            .max()
            .unwrap_or(0);
        let last_step = steps.last().map(|s| s.at_ms).unwrap_or(0);
        // Matches outlive two heartbeat timeouts of a termination hook: a hook left to time
        // out (no heartbeat) ends them, and the checker sees it.
        let asg_hold = steps
            .iter()
            .find(|s| matches!(s.action, Action::AsgTerminate))
            .map_or(0, |s| s.at_ms + 2000 * asg_heartbeat_s);
        // A rebalance recommendation's TTL runs out within the run.
        let rebalance_end = steps
            .iter()
            .find(|s| matches!(s.action, Action::ImdsRebalance))
            .map_or(0, |s| s.at_ms + later.rebalance_ttl_ms + 1000);
        // A NodeClaim's fence (created before `t0`, so no later than this) well inside.
        let nodeclaim = NodeClaim::draw(seed, dims).filter(|_| !late_cancel && staged.is_none());
        let nodeclaim_end = nodeclaim.map_or(0, |c| {
            (c.fence_after_ms() + 2000).max(c.end_after_ms().unwrap_or(0).min(MAX_RUN_MS))
        });
        // A staged race plays on for the world's answers (a hand-back, a refused release).
        let staged_end = if staged.is_some() { 4000 } else { 0 };
        let end_all_at_ms = last_step
            .max(last_hard.min(MAX_RUN_MS))
            .max(asg_hold)
            .max(rebalance_end)
            .max(nodeclaim_end)
            .max(staged_end)
            + 200;
        Timeline {
            seed,
            dims,
            ready,
            allocated,
            grace_s,
            exclusion_selector,
            graceful_termination,
            foreign_cordon,
            gce_vm,
            host_maintenance,
            asg_heartbeat_s,
            azure_approve,
            agones_selectable_fields,
            fleetiq,
            asg_lag,
            bind_lag_ms,
            steps,
            end_all_at_ms,
            slow_starter: later.slow_starter,
            rebalance_ttl_ms: later.rebalance_ttl_ms,
            drain_on_foreign_cordon: later.drain_on_foreign_cordon && !late_cancel,
            nodeclaim,
            late_cancel,
            mode,
            staged,
            boot_id_lag,
            gke_hand_back,
            policy_read_faults,
        }
    }

    /// `--deregister-settle`: longer where a pod lands after the fence, so that the pod,
    /// placed as the fence goes up, lands within it even on a loaded machine.
    pub fn deregister_settle_ms(&self) -> u64 {
        if self.bind_lag_ms > 0 { 700 } else { 300 }
    }

    pub fn grace_of(&self, safe: Safe) -> i64 {
        self.grace_s[safe as usize]
    }

    /// GCE's notice before host maintenance stops the VM, as the timeline plays it: what the
    /// operator sets `--gce-terminate-notice` to for this class of VM.
    pub fn gce_terminate_notice(&self) -> std::time::Duration {
        providers::run_time(self.gce_vm.terminate_notice())
    }

    /// ACPI G2 to G3 on a preempted VM, as the timeline plays it (`--gce-preemption-notice`).
    pub fn gce_preemption_notice(&self) -> std::time::Duration {
        providers::run_time(providers::GCE_PREEMPTION_NOTICE)
    }
}

/// Sometimes (under `more_signals`, from a stream of its own) the only signal is an IMDS
/// scheduled stop, an Azure reboot (IMDS' where Azure is not drawn) or a GCE
/// `TERMINATE_ON_HOST_MAINTENANCE` on a GPU VM (an hour's notice, the longest GCE gives),
/// cancelled 1.0–1.3 s before a match lastcall may end is due. An agent that acts on
/// the cancel a second late ends that match, and a reaction window of 1.5 s would excuse it:
/// only the bound by the reads that saw the cancel catches it. Returns whether it drew one.
fn late_cancel(
    seed: u64,
    dims: Dimensions,
    grace_s: &[i64; 3],
    allocated: &mut [usize; 3],
    gce_vm: &mut GceVm,
    steps: &mut Vec<Step>,
) -> bool {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6c61_7465_6321);
    if !dims.more_signals || !rng.random_bool(0.24) {
        return false;
    }
    let always = Safe::Always as usize;
    allocated[always] = allocated[always].max(1);
    let t: u64 = rng.random_range(0..900);
    // One source in three each (IMDS where Azure is not drawn).
    let kind = rng.random_range(0..3);
    let azure = kind == 1 && dims.azure_events;
    let gce = kind == 2;
    // Azure's no sooner than its least notice for a reboot.
    let least = if azure {
        ms_of(providers::run_time(providers::azure_min_notice(
            AzureKind::Reboot,
        )))
    } else {
        3500
    };
    // Just short of a whole second: the run starts on one, so IMDS and Azure (whole
    // seconds, rounded up) state it 50 ms later, whatever the few ms the start took.
    let mut not_before_ms = (t + rng.random_range(least..=4500)).div_ceil(1000) * 1000 - 50;
    // GCE counts the notice from the step, and the truth's end is that to the second below:
    // the step 100 ms into the run puts it on the whole second after the notice, within a
    // few hundred ms of where the agent (counting from its first sight) puts it.
    let gce_at = 100;
    if gce {
        *gce_vm = GceVm::Gpu;
        let end = gce_at + ms_of(providers::run_time(gce_vm.terminate_notice()));
        not_before_ms = end / 1000 * 1000;
    }
    let due = not_before_ms - 1000 * grace_s[always] as u64;
    // No agent stopped near the cancel (a start is a moment the bound cannot judge), and the
    // matches still running when they are due.
    steps.retain(|s| {
        let dropped = match s.action {
            Action::RestartAgent | Action::AbortAgent { .. } | Action::Rollout { .. } => true,
            Action::EndMatch => s.at_ms <= due + 500,
            ref a => a.is_signal(),
        };
        !dropped
    });
    let cancel_at = due - rng.random_range(1000..=1300);
    let (event, cancel) = if azure {
        (
            Action::AzureEvent {
                episode: 1,
                kind: AzureKind::Reboot,
                not_before_ms,
            },
            Action::AzureGone { episode: 1 },
        )
    } else if gce {
        (Action::GceTerminate, Action::GceNone)
    } else {
        (
            Action::ImdsScheduled {
                code: EventCode::InstanceStop,
                not_before_ms,
            },
            Action::ImdsScheduledCancel,
        )
    };
    steps.push(Step {
        at_ms: if gce { gce_at } else { t },
        action: event,
    });
    steps.push(Step {
        at_ms: cancel_at,
        action: cancel,
    });
    true
}

/// What the hand-off edges drew for a timeline.
struct Edges {
    fleetiq: bool,
    asg_lag: usize,
    bind_lag_ms: u64,
    /// No game server on the node but the late one: the hand-off follows the fence at once,
    /// where a pod landing after the cordon matters.
    empty_node: bool,
}

impl Edges {
    /// Draws the edges into `steps`: a node without FleetIQ (its FleetIQ steps dropped) and
    /// a pod landing there just after the fence, GameLift forgetting the server, a machine
    /// that comes back, a lagging Auto Scaling API.
    fn draw(
        seed: u64,
        dims: Dimensions,
        asg_drawn: bool,
        horizon: u64,
        steps: &mut Vec<Step>,
    ) -> Edges {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x6564_6765_7321);
        let fleetiq = !(dims.without_fleetiq && rng.random_bool(0.3));
        if !fleetiq {
            steps.retain(|s| !matches!(s.action, Action::FleetIq { .. } | Action::FailDeregister));
        }
        let mut bind_lag_ms = 0;
        let mut empty_node = false;
        // The first signal that fences (Karpenter's taint is its own fence).
        let first = steps
            .iter()
            .filter(|s| !matches!(s.action, Action::Karpenter(_)))
            .map(|s| s.at_ms)
            .min()
            .unwrap_or(0);
        // Mostly where the hand-off has no deregistration before it: just before the first
        // signal that fences, so the scheduler's decision predates the cordon.
        let late = if fleetiq { 0.15 } else { 0.7 };
        if dims.without_fleetiq && rng.random_bool(late) {
            bind_lag_ms = rng.random_range(100..=200);
            empty_node = rng.random_bool(0.5);
            steps.push(Step {
                at_ms: rng.random_range(0..=first),
                action: Action::LateServer,
            });
        }
        if fleetiq && dims.gamelift_forgets && rng.random_bool(0.25) {
            // Mostly during a drain, where forgetting a busy server matters.
            let at_ms = if rng.random_bool(0.75) {
                first + rng.random_range(200..1500)
            } else {
                rng.random_range(0..horizon + 1500)
            };
            steps.push(Step {
                at_ms,
                action: Action::GameLiftForgets,
            });
            // A running agent hears of it only when it asks GameLift: at a start on a
            // draining node (a rollout, a crash) or before it cancels.
            if rng.random_bool(0.6) {
                steps.push(Step {
                    at_ms: at_ms + rng.random_range(50..600),
                    action: Action::RestartAgent,
                });
            }
        }
        // An instance the Auto Scaling group terminates does not come back.
        if dims.returns && !asg_drawn && rng.random_bool(0.2) {
            steps.push(Step {
                at_ms: rng.random_range(1000..horizon + 2500),
                action: Action::MachineReturns,
            });
        }
        let asg_lag = if dims.asg_lag && asg_drawn {
            rng.random_range(0..=3)
        } else {
            0
        };
        Edges {
            fleetiq,
            asg_lag,
            bind_lag_ms,
            empty_node,
        }
    }
}

/// The draws added after the hand-off edges, each from a stream of its own so that every
/// earlier draw of a seed stays what it was: Node signals from clouds and autoscalers, game
/// servers changing state under the drain, and answers lost or refused after a write.
struct Later {
    slow_starter: bool,
    rebalance_ttl_ms: u64,
    drain_on_foreign_cordon: bool,
}

impl Later {
    /// Draws into `steps`.
    fn draw(
        seed: u64,
        dims: Dimensions,
        fleetiq: bool,
        foreign_cordon: bool,
        horizon: u64,
        steps: &mut Vec<Step>,
    ) -> Later {
        let has_karpenter = steps
            .iter()
            .any(|s| matches!(s.action, Action::Karpenter(_)));
        let asg_drawn = steps
            .iter()
            .any(|s| matches!(s.action, Action::AsgTerminate));
        let mut push = |at_ms: u64, action: Action| steps.push(Step { at_ms, action });
        let mut rng = StdRng::seed_from_u64(seed ^ 0x6e6f_6465_7321);
        if dims.node_signals && rng.random_bool(0.45) {
            let t = rng.random_range(0..horizon);
            let off = |rng: &mut StdRng| t + rng.random_range(300..1500);
            match rng.random_range(0..5) {
                0 => {
                    push(t, Action::Autoscaler(true));
                    if rng.random_bool(0.5) {
                        push(off(&mut rng), Action::Autoscaler(false));
                    }
                }
                1 => {
                    push(t, Action::GkeTaint(true));
                    if rng.random_bool(0.4) {
                        push(off(&mut rng), Action::GkeTaint(false));
                    }
                }
                2 => {
                    push(t, Action::GkeOngoing(true));
                    if rng.random_bool(0.4) {
                        push(off(&mut rng), Action::GkeOngoing(false));
                    }
                }
                3 => {
                    let mut epoch = t + rng.random_range(1500..=4500);
                    push(
                        t,
                        Action::GkeMaintenance {
                            epoch_ms: Some(epoch),
                        },
                    );
                    let mut t2 = t;
                    for _ in 0..rng.random_range(0..=2) {
                        t2 += rng.random_range(300..900);
                        let action = if rng.random_bool(0.3) {
                            Action::GkeMaintenance { epoch_ms: None }
                        } else {
                            epoch = if rng.random_bool(0.5) {
                                epoch + rng.random_range(1000..=3000)
                            } else {
                                epoch
                                    .saturating_sub(rng.random_range(500..=1500))
                                    .max(t2 + 1000)
                            };
                            Action::GkeMaintenance {
                                epoch_ms: Some(epoch),
                            }
                        };
                        push(t2, action);
                    }
                }
                _ => {
                    // Karpenter writes its taint once: not where the script already has it.
                    if !has_karpenter {
                        push(
                            t,
                            Action::KarpenterAt {
                                at_ms: t + rng.random_range(1500..=4500),
                            },
                        );
                        if rng.random_bool(0.3) {
                            push(off(&mut rng), Action::Karpenter(false));
                        }
                    }
                }
            }
        }
        let mut states = StdRng::seed_from_u64(seed ^ 0x7374_6174_6573);
        let mut slow_starter = false;
        if dims.server_states {
            // The first mostly early, while the node still has Ready servers; the rest at any
            // time, racing the releases.
            for i in 0..states.random_range(0..=2) {
                let t = states.random_range(0..if i == 0 { horizon / 3 } else { horizon });
                push(t, Action::Reserve);
                if states.random_bool(0.6) {
                    push(t + states.random_range(300..1500), Action::Unreserve);
                }
            }
            if states.random_bool(0.3) {
                slow_starter = true;
                push(states.random_range(200..horizon + 1000), Action::TurnsReady);
            }
        }
        let mut lost = StdRng::seed_from_u64(seed ^ 0x6c6f_7374_2121);
        if dims.lost_answers {
            if lost.random_bool(0.3) {
                let status = [409, 422][lost.random_range(0..2)];
                let n = lost.random_range(1..=2);
                let action = match lost.random_range(0..3) {
                    0 => Action::Fault(KubeFault::FailNode { n, status }),
                    1 => Action::Fault(KubeFault::FailGameServers { n, status }),
                    _ => Action::Fault(KubeFault::FailReleases { n, status }),
                };
                push(lost.random_range(0..horizon), action);
            }
            if fleetiq && lost.random_bool(0.4) {
                push(lost.random_range(0..horizon), Action::DeregisterAnswerLost);
            }
            if lost.random_bool(0.4) {
                let write = [
                    Write::Node,
                    Write::GameServer,
                    Write::Release,
                    Write::Eviction,
                ][lost.random_range(0..4)];
                push(
                    lost.random_range(0..horizon),
                    Action::Fault(KubeFault::LoseAnswer(write)),
                );
            }
            // Only where the group terminates the instance: then the hook is completed.
            if asg_drawn && lost.random_bool(0.5) {
                push(lost.random_range(0..horizon), Action::AsgCompleteAnswerLost);
            }
        }
        let mut restarts = StdRng::seed_from_u64(seed ^ 0x7265_7374_6172_7421);
        if dims.api_restarts && restarts.random_bool(0.25) {
            push(
                restarts.random_range(0..horizon),
                Action::ApiRestart {
                    down_ms: restarts.random_range(50..=300),
                },
            );
        }
        let mut more = StdRng::seed_from_u64(seed ^ 0x7369_676e_616c_7332);
        let (mut rebalance_ttl_ms, mut drain_on_foreign_cordon) = (0, false);
        if dims.more_signals {
            if more.random_bool(0.25) {
                rebalance_ttl_ms = more.random_range(1500..=3000);
                push(more.random_range(0..horizon), Action::ImdsRebalance);
            }
            if more.random_bool(0.25) {
                let t = more.random_range(0..horizon);
                let window_ms = t + more.random_range(1500..=4000);
                let upcoming = |status| Action::GceUpcoming { status, window_ms };
                push(t, upcoming(Upcoming::Pending));
                if more.random_bool(0.3) {
                    // Called off before it starts.
                    push(
                        t + more.random_range(300..1200),
                        upcoming(Upcoming::Complete),
                    );
                } else if more.random_bool(0.6) {
                    push(window_ms, upcoming(Upcoming::Ongoing));
                    if more.random_bool(0.6) {
                        push(
                            window_ms + more.random_range(300..1200),
                            upcoming(Upcoming::Complete),
                        );
                    }
                }
            }
            if !foreign_cordon && more.random_bool(0.2) {
                drain_on_foreign_cordon = true;
                let t = more.random_range(0..horizon);
                push(t, Action::OperatorCordon(true));
                if more.random_bool(0.5) {
                    push(
                        t + more.random_range(300..1500),
                        Action::OperatorCordon(false),
                    );
                }
            }
        }
        // Sometimes the rebalance is the only signal, so its TTL running out is what ends the
        // drain (from a stream of its own: other seeds keep their scripts).
        if rebalance_ttl_ms > 0 && StdRng::seed_from_u64(seed ^ 0x616c_6f6e_6521).random_bool(0.4) {
            steps.retain(|s| matches!(s.action, Action::ImdsRebalance) || !s.action.is_signal());
            drain_on_foreign_cordon = false;
        }
        Later {
            slow_starter,
            rebalance_ttl_ms,
            drain_on_foreign_cordon,
        }
    }
}

impl fmt::Display for Timeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "timeline seed {}: ready {:?} allocated {:?} grace_s {:?} (never/onupgrade/always), exclusion selector {}, --graceful-termination {}, foreign cordon {}, gce VM {:?} ({} at host maintenance), asg heartbeat {}s (describes lag {}), --azure-approve-when-empty {}, agones selectable fields {}, fleetiq {}, bind lag {} ms, slow starter {}, --rebalance-ttl {} ms, --drain-on-foreign-cordon {}, NodeClaim {:?}, late cancel {}, staged {:?}, boot id lag {}, --gke-hand-back {} (policy reads failing {}), {:?}, {:?}",
            self.seed,
            self.ready,
            self.allocated,
            self.grace_s,
            self.exclusion_selector,
            self.graceful_termination,
            self.foreign_cordon,
            self.gce_vm,
            self.host_maintenance.as_str(),
            self.asg_heartbeat_s,
            self.asg_lag,
            self.azure_approve,
            self.agones_selectable_fields,
            self.fleetiq,
            self.bind_lag_ms,
            self.slow_starter,
            self.rebalance_ttl_ms,
            self.drain_on_foreign_cordon,
            self.nodeclaim,
            self.late_cancel,
            self.staged,
            self.boot_id_lag,
            self.gke_hand_back,
            self.policy_read_faults,
            self.mode,
            self.dims,
        )?;
        for s in &self.steps {
            writeln!(f, "  t+{:>5} ms  {:?}", s.at_ms, s.action)?;
        }
        writeln!(f, "  t+{:>5} ms  every match ends", self.end_all_at_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 409 or 422 answer drawn for a write.
    fn refused(a: &Action) -> bool {
        matches!(
            a,
            Action::Fault(
                KubeFault::FailNode {
                    status: 409 | 422,
                    ..
                } | KubeFault::FailGameServers {
                    status: 409 | 422,
                    ..
                } | KubeFault::FailReleases {
                    status: 409 | 422,
                    ..
                }
            )
        )
    }

    #[test]
    fn a_seed_draws_the_same_timeline_and_dimensions_switch_off() {
        let a = Timeline::draw(7, Dimensions::ALL);
        let b = Timeline::draw(7, Dimensions::ALL);
        assert_eq!(a.steps, b.steps);
        assert_eq!(a.to_string(), b.to_string());
        let none = Dimensions::without(
            "two_agents, hangs,aborts,gce_empty_body,system_maintenance,later_reschedules,asg_lifecycle,azure_events,returns,gamelift_forgets,asg_lag,without_fleetiq,fence_races,more_faults,node_signals,server_states,lost_answers,more_signals,modes,api_restarts,boot_id_lag,live_migration,stale_empty",
        )
        .expect("known names");
        for seed in 0..300 {
            assert_eq!(Timeline::draw(seed, none).mode, Modes::default());
            assert_eq!(Timeline::draw(seed, none).nodeclaim, None);
            assert_eq!(Timeline::draw(seed, none).staged, None);
            assert!(!Timeline::draw(seed, none).boot_id_lag);
            for s in Timeline::draw(seed, none).steps {
                assert!(
                    !refused(&s.action)
                        && !matches!(
                            s.action,
                            Action::Rollout { .. }
                                | Action::AbortAgent { .. }
                                | Action::GceEmpty
                                | Action::AsgTerminate
                                | Action::AzureEvent { .. }
                                | Action::AzureGone { .. }
                                | Action::GameLiftForgets
                                | Action::MachineReturns
                                | Action::LateServer
                                | Action::AllocateAtFence(_)
                                | Action::FleetIqSpot
                                | Action::KarpenterAt { .. }
                                | Action::Autoscaler(_)
                                | Action::GkeTaint(_)
                                | Action::GkeOngoing(_)
                                | Action::GkeMaintenance { .. }
                                | Action::Reserve
                                | Action::Unreserve
                                | Action::TurnsReady
                                | Action::DeregisterAnswerLost
                                | Action::AsgCompleteAnswerLost
                                | Action::Fault(KubeFault::LoseAnswer(_))
                                | Action::ImdsRebalance
                                | Action::GceUpcoming { .. }
                                | Action::OperatorCordon(_)
                                | Action::ApiRestart { .. }
                                | Action::StrayServer { .. }
                                | Action::Fault(
                                    KubeFault::FailReleases { .. } | KubeFault::LagWatches { .. }
                                )
                                | Action::Fault(KubeFault::HangNode | KubeFault::HangGameServers)
                                | Action::ImdsScheduled {
                                    code: EventCode::SystemMaintenance,
                                    ..
                                }
                        ),
                    "seed {seed}: {:?} drawn while switched off",
                    s.action
                );
            }
        }
        assert!(Dimensions::without("nope").is_err());
    }

    #[test]
    fn node_signals_server_states_and_lost_answers_are_drawn() {
        let mut n = std::collections::BTreeMap::<&str, usize>::new();
        for seed in 0..400 {
            let tl = Timeline::draw(seed, Dimensions::ALL);
            let has = |f: &dyn Fn(&Action) -> bool| tl.steps.iter().any(|s| f(&s.action));
            for (what, drawn) in [
                (
                    "Karpenter's termination time",
                    has(&|a| matches!(a, Action::KarpenterAt { .. })),
                ),
                (
                    "the autoscaler's taint",
                    has(&|a| matches!(a, Action::Autoscaler(true))),
                ),
                ("GKE's taint", has(&|a| matches!(a, Action::GkeTaint(true)))),
                (
                    "GKE's ONGOING label",
                    has(&|a| matches!(a, Action::GkeOngoing(true))),
                ),
                (
                    "GKE's maintenance time",
                    has(&|a| matches!(a, Action::GkeMaintenance { .. })),
                ),
                ("a reservation", has(&|a| matches!(a, Action::Reserve))),
                ("a slow starter", tl.slow_starter),
                ("a 409 or 422", has(&refused)),
                (
                    "a lost answer",
                    has(&|a| matches!(a, Action::DeregisterAnswerLost)),
                ),
                ("a rebalance", has(&|a| matches!(a, Action::ImdsRebalance))),
                (
                    "a rebalance, the only signal",
                    has(&|a| matches!(a, Action::ImdsRebalance))
                        && !has(&|a| a.is_signal() && !matches!(a, Action::ImdsRebalance)),
                ),
                (
                    "GCE's upcoming maintenance",
                    has(&|a| matches!(a, Action::GceUpcoming { .. })),
                ),
                ("a foreign cordon", tl.drain_on_foreign_cordon),
                (
                    "an API server restart",
                    has(&|a| matches!(a, Action::ApiRestart { .. })),
                ),
                ("a dry run", tl.mode.dry_run),
                ("a NodeClaim expiring", tl.nodeclaim.is_some()),
                ("the drain state published", tl.mode.publish_drain_state),
                ("release pacing", tl.mode.pacing),
                ("autoscaler cooperation", tl.mode.cooperation.is_some()),
                ("compat taints", tl.mode.compat_taints),
                (
                    "a lost kube answer",
                    has(&|a| matches!(a, Action::Fault(KubeFault::LoseAnswer(_)))),
                ),
            ] {
                *n.entry(what).or_default() += usize::from(drawn);
            }
            assert_eq!(
                has(&|a| matches!(a, Action::TurnsReady)),
                tl.slow_starter,
                "seed {seed}"
            );
            if has(&|a| matches!(a, Action::KarpenterAt { .. })) {
                assert_eq!(
                    tl.steps
                        .iter()
                        .filter(|s| matches!(
                            s.action,
                            Action::Karpenter(true) | Action::KarpenterAt { .. }
                        ))
                        .count(),
                    1,
                    "seed {seed}: Karpenter taints the node once"
                );
            }
        }
        for (what, count) in n {
            // A dry run is drawn rarely: it judges one thing.
            let floor = if what == "a dry run" { 5 } else { 8 };
            assert!(
                count >= floor,
                "{what}: drawn in only {count} of 400 timelines"
            );
        }
    }

    #[test]
    fn the_staged_races_are_drawn_alone() {
        let (mut boot, mut migrate, mut ongoing, mut stale) = (0, 0, 0, 0);
        let mut in_ci = [0; 4];
        for seed in 0..400 {
            let tl = Timeline::draw(seed, Dimensions::ALL);
            let signals: Vec<&Action> = tl
                .steps
                .iter()
                .map(|s| &s.action)
                .filter(|a| a.is_signal())
                .collect();
            match tl.staged {
                Some(Staged::BootIdLag) => {
                    boot += 1;
                    assert!(tl.fleetiq && tl.boot_id_lag, "seed {seed}");
                    assert_eq!(
                        signals,
                        [&Action::FleetIq { draining: true }, &Action::MachineReturns],
                        "seed {seed}"
                    );
                }
                Some(Staged::LiveMigration { hand_back }) => {
                    assert!(!tl.fleetiq, "seed {seed}");
                    assert_eq!(tl.host_maintenance, HostMaintenance::Migrate);
                    assert_eq!(tl.gke_hand_back, hand_back);
                    assert!(
                        signals
                            .iter()
                            .all(|a| matches!(a, Action::GceUpcoming { .. }))
                    );
                    if hand_back {
                        migrate += 1;
                    } else {
                        ongoing += 1;
                        assert_eq!(tl.allocated, [0, 0, 1], "seed {seed}");
                    }
                }
                Some(Staged::StaleEmpty { asg }) => {
                    stale += 1;
                    assert!(!tl.fleetiq && (asg || tl.azure_approve), "seed {seed}");
                    assert_eq!(tl.allocated, [0; 3]);
                    assert!(
                        tl.steps
                            .iter()
                            .any(|s| matches!(s.action, Action::StrayServer { .. })),
                        "seed {seed}"
                    );
                }
                None => {
                    assert_eq!(tl.host_maintenance, HostMaintenance::Terminate);
                    assert!(!tl.gke_hand_back && tl.policy_read_faults == 0);
                }
            }
            assert!(!(tl.staged.is_some() && tl.late_cancel), "seed {seed}");
            // The CI run's seeds, 1–200.
            if (1..=200).contains(&seed) {
                let i = match tl.staged {
                    Some(Staged::BootIdLag) => 0,
                    Some(Staged::LiveMigration { hand_back: true }) => 1,
                    Some(Staged::LiveMigration { hand_back: false }) => 2,
                    Some(Staged::StaleEmpty { .. }) => 3,
                    None => continue,
                };
                in_ci[i] += 1;
            }
        }
        assert!(
            in_ci.iter().all(|n| *n >= 7),
            "staged in seeds 1–200: {in_ci:?}"
        );
        if std::env::var_os("STAGED_SEEDS").is_some() {
            let staged: Vec<(u64, Staged)> = (1..=400)
                .filter_map(|seed| Some((seed, Timeline::draw(seed, Dimensions::ALL).staged?)))
                .collect();
            eprintln!("{staged:?}");
        }
        for (what, n) in [
            ("a late boot id", boot),
            ("a hand-back on a VM that migrates", migrate),
            ("an ONGOING window on a VM that migrates", ongoing),
            ("a stale empty", stale),
        ] {
            assert!(n >= 10, "{what}: staged in only {n} of 400 timelines");
        }
    }

    #[test]
    fn the_hand_off_edges_are_drawn() {
        let (mut forgets, mut returns, mut late, mut lag, mut without) = (0, 0, 0, 0, 0);
        for seed in 0..400 {
            let tl = Timeline::draw(seed, Dimensions::ALL);
            let has = |f: &dyn Fn(&Action) -> bool| tl.steps.iter().any(|s| f(&s.action));
            forgets += usize::from(has(&|a| matches!(a, Action::GameLiftForgets)));
            returns += usize::from(has(&|a| matches!(a, Action::MachineReturns)));
            late += usize::from(has(&|a| matches!(a, Action::LateServer)));
            lag += usize::from(tl.asg_lag > 0);
            without += usize::from(!tl.fleetiq);
            if !tl.fleetiq {
                assert!(
                    !has(&|a| matches!(
                        a,
                        Action::FleetIq { .. } | Action::FailDeregister | Action::GameLiftForgets
                    )),
                    "seed {seed}: FleetIQ steps on a node without it"
                );
            }
            if has(&|a| matches!(a, Action::AsgTerminate)) {
                assert!(
                    !has(&|a| matches!(a, Action::MachineReturns)),
                    "seed {seed}: a terminated instance came back"
                );
            }
            assert_eq!(
                has(&|a| matches!(a, Action::LateServer)),
                tl.bind_lag_ms > 0
            );
        }
        for (what, n) in [
            ("GameLift forgetting", forgets),
            ("machines returning", returns),
            ("late pods", late),
            ("a lagging Auto Scaling API", lag),
            ("nodes without FleetIQ", without),
        ] {
            assert!(n >= 20, "{what}: drawn in only {n} of 400 timelines");
        }
    }

    #[test]
    fn a_late_cancel_is_the_only_signal_and_falls_just_before_a_match_is_due() {
        let drawn: Vec<Timeline> = (1..=1000)
            .map(|seed| Timeline::draw(seed, Dimensions::ALL))
            .filter(|t| t.late_cancel)
            .collect();
        if std::env::var_os("LATE_CANCEL_SEEDS").is_some() {
            let seeds: Vec<(u64, Option<String>)> = drawn
                .iter()
                .map(|t| {
                    let first = t.steps.iter().find(|s| s.action.is_signal());
                    (t.seed, first.map(|s| format!("{:?}", s.action)))
                })
                .collect();
            eprintln!("{seeds:?}");
        }
        assert!((170..=310).contains(&drawn.len()), "{} drawn", drawn.len());
        let (mut imds, mut azure, mut gce) = (0, 0, 0);
        for t in &drawn {
            let signals: Vec<&Step> = t.steps.iter().filter(|s| s.action.is_signal()).collect();
            let [event, cancel] = signals[..] else {
                panic!("seed {}: {signals:?}", t.seed);
            };
            match (&event.action, &cancel.action) {
                (Action::ImdsScheduled { .. }, Action::ImdsScheduledCancel) => imds += 1,
                (
                    Action::AzureEvent {
                        episode: 1,
                        kind: AzureKind::Reboot,
                        ..
                    },
                    Action::AzureGone { episode: 1 },
                ) => azure += 1,
                (Action::GceTerminate, Action::GceNone) => gce += 1,
                _ => panic!("seed {}: {signals:?}", t.seed),
            }
            let not_before_ms = match event.action {
                Action::ImdsScheduled { not_before_ms, .. }
                | Action::AzureEvent { not_before_ms, .. } => not_before_ms,
                // GCE's end: the GPU VM's notice from the step, to the second below.
                _ => {
                    assert_eq!(t.gce_vm, GceVm::Gpu, "seed {}", t.seed);
                    (event.at_ms + ms_of(providers::run_time(t.gce_vm.terminate_notice()))) / 1000
                        * 1000
                }
            };
            let due = not_before_ms - 1000 * t.grace_of(Safe::Always) as u64;
            assert!(
                (1000..=1300).contains(&(due - cancel.at_ms)),
                "seed {}",
                t.seed
            );
            assert!(cancel.at_ms > event.at_ms + 200, "seed {}", t.seed);
            assert!(t.allocated[Safe::Always as usize] > 0);
            assert!(t.nodeclaim.is_none() && !t.drain_on_foreign_cordon);
            assert!(t.end_all_at_ms > due, "seed {}", t.seed);
        }
        assert!(
            imds >= 30 && azure >= 30 && gce >= 30,
            "{imds} IMDS, {azure} Azure, {gce} GCE"
        );
        let without = Dimensions::without("more_signals").expect("a known name");
        assert!((1..=1000).all(|seed| !Timeline::draw(seed, without).late_cancel));
    }
}
