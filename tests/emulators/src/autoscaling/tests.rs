//! Conformance: the real `aws-sdk-autoscaling` against the emulator, over HTTP.

use std::time::Duration;

use aws_sdk_autoscaling::config::retry::RetryConfig;
use aws_sdk_autoscaling::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_autoscaling::error::ProvideErrorMetadata;
use aws_sdk_autoscaling::types::LifecycleState as SdkState;

use super::*;

const I: &str = "i-0123456789abcdef0";
const GROUP: &str = "game-nodes";
const HOOK: &str = "lastcall-drain";

fn client(url: &str) -> aws_sdk_autoscaling::Client {
    let conf = aws_sdk_autoscaling::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-west-2"))
        .credentials_provider(Credentials::new("AKIDTEST", "secret", None, None, "test"))
        .endpoint_url(url)
        .retry_config(RetryConfig::disabled())
        .build();
    aws_sdk_autoscaling::Client::from_conf(conf)
}

async fn world(heartbeat_secs: u64) -> (AutoScalingEmulator, aws_sdk_autoscaling::Client) {
    let emu = AutoScalingEmulator::start().await.unwrap();
    emu.add_group(GROUP, vec![Hook::terminating(HOOK, heartbeat_secs)]);
    emu.add_instance(GROUP, I);
    let c = client(&emu.url());
    (emu, c)
}

async fn state_of(c: &aws_sdk_autoscaling::Client) -> Option<String> {
    let out = c
        .describe_auto_scaling_instances()
        .instance_ids(I)
        .send()
        .await
        .unwrap();
    out.auto_scaling_instances()
        .first()
        .and_then(|i| i.lifecycle_state().map(str::to_string))
}

/// `RecordLifecycleActionHeartbeat` for the test instance.
async fn heartbeat(
    c: &aws_sdk_autoscaling::Client,
) -> Result<
    aws_sdk_autoscaling::operation::record_lifecycle_action_heartbeat::RecordLifecycleActionHeartbeatOutput,
    aws_sdk_autoscaling::error::SdkError<
        aws_sdk_autoscaling::operation::record_lifecycle_action_heartbeat::RecordLifecycleActionHeartbeatError,
    >,
>{
    c.record_lifecycle_action_heartbeat()
        .auto_scaling_group_name(GROUP)
        .lifecycle_hook_name(HOOK)
        .instance_id(I)
        .send()
        .await
}

/// `CompleteLifecycleAction` for the test instance with `result`.
async fn complete(
    c: &aws_sdk_autoscaling::Client,
    result: &str,
) -> Result<
    aws_sdk_autoscaling::operation::complete_lifecycle_action::CompleteLifecycleActionOutput,
    aws_sdk_autoscaling::error::SdkError<
        aws_sdk_autoscaling::operation::complete_lifecycle_action::CompleteLifecycleActionError,
    >,
> {
    c.complete_lifecycle_action()
        .auto_scaling_group_name(GROUP)
        .lifecycle_hook_name(HOOK)
        .instance_id(I)
        .lifecycle_action_result(result)
        .send()
        .await
}

#[tokio::test]
async fn describe_calls_round_trip_through_the_sdk() {
    let (emu, c) = world(60).await;
    let out = c
        .describe_auto_scaling_instances()
        .instance_ids(I)
        .send()
        .await
        .unwrap();
    let i = &out.auto_scaling_instances()[0];
    assert_eq!(i.instance_id(), Some(I));
    assert_eq!(i.auto_scaling_group_name(), Some(GROUP));
    assert_eq!(i.lifecycle_state(), Some(SdkState::InService.as_str()));
    // Another id: an empty list, not an error.
    let none = c
        .describe_auto_scaling_instances()
        .instance_ids("i-0000000000000000f")
        .send()
        .await
        .unwrap();
    assert!(none.auto_scaling_instances().is_empty());

    let hooks = c
        .describe_lifecycle_hooks()
        .auto_scaling_group_name(GROUP)
        .send()
        .await
        .unwrap();
    let h = &hooks.lifecycle_hooks()[0];
    assert_eq!(h.lifecycle_hook_name(), Some(HOOK));
    assert_eq!(h.lifecycle_transition(), Some(TERMINATING));
    assert_eq!(h.heartbeat_timeout(), Some(60));
    assert_eq!(h.global_timeout(), Some(6000));
    assert_eq!(h.default_result(), Some("CONTINUE"));

    let e = c
        .describe_lifecycle_hooks()
        .auto_scaling_group_name("nope")
        .send()
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some("ValidationError"));
    assert_eq!(emu.calls("DescribeLifecycleHooks"), 1);
}

#[tokio::test]
async fn a_wait_is_held_by_heartbeats_and_ended_by_completion() {
    let (emu, c) = world(1).await;
    // Not waiting yet: both calls are refused as AWS refuses them.
    let e = heartbeat(&c).await.unwrap_err();
    assert_eq!(e.code(), Some("ValidationError"));
    assert!(
        e.message()
            .unwrap_or_default()
            .contains("No active Lifecycle Action")
    );

    emu.begin_termination(I).unwrap();
    assert_eq!(
        state_of(&c).await.as_deref(),
        Some(SdkState::TerminatingWait.as_str())
    );
    // Heartbeats every 400 ms keep it past three heartbeat timeouts.
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        heartbeat(&c).await.unwrap();
    }
    assert_eq!(
        emu.lifecycle_state(I),
        Some(LifecycleState::TerminatingWait)
    );
    complete(&c, "CONTINUE").await.unwrap();
    assert_eq!(emu.lifecycle_state(I), Some(LifecycleState::Terminated));
    // Gone from the group, and a second completion is refused.
    assert_eq!(state_of(&c).await, None);
    let again = complete(&c, "CONTINUE").await.unwrap_err();
    assert_eq!(again.code(), Some("ValidationError"));
    let j = emu.journal();
    let heartbeats = j
        .iter()
        .filter(|e| e.happening == Happening::HeartbeatRecorded)
        .count();
    assert_eq!(heartbeats, 8);
    assert!(
        !j.iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { .. }))
    );
}

#[tokio::test]
async fn without_heartbeats_the_default_result_applies_at_the_timeout() {
    let (emu, _c) = world(1).await;
    emu.begin_termination(I).unwrap();
    let started = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(emu.lifecycle_state(I), Some(LifecycleState::Terminated));
    let j = emu.journal();
    let out = j
        .iter()
        .find(|e| matches!(e.happening, Happening::TimedOut { .. }))
        .expect("timed out");
    assert_eq!(
        out.happening,
        Happening::TimedOut {
            global: false,
            result: "CONTINUE".into()
        }
    );
    let after = out.at.duration_since(started);
    assert!(after >= Duration::from_millis(950), "{after:?}");
}

#[test]
fn the_global_timeout_is_capped_at_48_hours() {
    assert_eq!(Hook::terminating("h", 30).global_timeout_secs(), 3_000);
    assert_eq!(Hook::terminating("h", 7_200).global_timeout_secs(), 172_800);
}

#[tokio::test]
async fn errors_are_the_sdk_s_typed_codes() {
    let (emu, c) = world(60).await;
    emu.begin_termination(I).unwrap();
    emu.fail(
        "RecordLifecycleActionHeartbeat",
        "AccessDenied",
        403,
        Some(1),
    );
    let e = heartbeat(&c).await.unwrap_err();
    assert_eq!(e.code(), Some("AccessDenied"));
    // The fault was used up: the next one goes through.
    heartbeat(&c).await.unwrap();
    let bad = complete(&c, "MAYBE").await.unwrap_err();
    assert_eq!(bad.code(), Some("ValidationError"));
    assert_eq!(
        emu.lifecycle_state(I),
        Some(LifecycleState::TerminatingWait)
    );
}

#[tokio::test]
async fn unsigned_or_non_query_requests_are_refused() {
    let (emu, _c) = world(60).await;
    let http = reqwest::Client::new();
    let r = http
        .post(emu.url())
        .header("content-type", "application/x-www-form-urlencoded")
        .body("Action=DescribeAutoScalingInstances&Version=2011-01-01")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains("<Code>MissingAuthenticationToken</Code>")
    );
    let r = http
        .post(emu.url())
        .header("authorization", "AWS4-HMAC-SHA256 Credential=x")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}
