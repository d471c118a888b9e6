//! The cloud emulators and the Redis helper, exercised with the real clients over real
//! TCP: `aws-sdk-gamelift` against the GameLift emulator, `reqwest` against IMDS, and the
//! `redis` crate against a private `redis-server`.

use std::collections::HashSet;
use std::time::Duration;

use aws_sdk_gamelift::Client;
use aws_sdk_gamelift::config::retry::RetryConfig;
use aws_sdk_gamelift::config::timeout::TimeoutConfig;
use aws_sdk_gamelift::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_gamelift::operation::RequestId;
use aws_sdk_gamelift::types::{
    GameServerClaimStatus, GameServerHealthCheck, GameServerInstanceStatus,
    GameServerUtilizationStatus,
};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::gamelift::{GameLiftEmulator, InstanceStatus, Malformed};
use lastcall_testkit::imds::ImdsEmulator;
use lastcall_testkit::redis::RedisServer;

const GROUP: &str = "agones-game-server-group-01";
/// The instance the game servers in these tests run on.
const IID_A: &str = "i-0000000000000000a";

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i:017}")).collect()
}

/// An emulator with one group holding `i-…0` (ACTIVE), and a client without retries.
async fn fleet() -> (GameLiftEmulator, Client) {
    let emu = GameLiftEmulator::start().await.unwrap();
    emu.add_group(GROUP);
    emu.add_instances(GROUP, &ids("i-", 1), InstanceStatus::Active);
    let client = emu.sdk_client_without_retries().await;
    (emu, client)
}

async fn register(client: &Client, id: &str) {
    client
        .register_game_server()
        .game_server_group_name(GROUP)
        .game_server_id(id)
        .instance_id(IID_A)
        .send()
        .await
        .unwrap();
}

// ---------------------------------------------------------------- GameLift: operations

#[tokio::test]
async fn gamelift_lifecycle_round_trips_through_the_sdk() {
    let (emu, client) = fleet().await;
    let iid = &ids("i-", 1)[0];

    let epoch = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let sent = epoch(std::time::SystemTime::now());
    let out = client
        .register_game_server()
        .game_server_group_name(GROUP)
        .game_server_id(iid)
        .instance_id(iid)
        .connection_info("10.0.0.1:7777")
        .game_server_data("map=dust")
        .send()
        .await
        .unwrap();
    let gs = out.game_server().unwrap();
    assert_eq!(gs.game_server_group_name(), Some(GROUP));
    assert_eq!(
        gs.game_server_group_arn(),
        Some(GameLiftEmulator::group_arn(GROUP).as_str())
    );
    assert_eq!(gs.game_server_id(), Some(iid.as_str()));
    assert_eq!(gs.instance_id(), Some(iid.as_str()));
    assert_eq!(gs.connection_info(), Some("10.0.0.1:7777"));
    assert_eq!(gs.game_server_data(), Some("map=dust"));
    assert_eq!(
        gs.utilization_status(),
        Some(&GameServerUtilizationStatus::Available)
    );
    assert_eq!(gs.claim_status(), None);
    assert!(gs.last_health_check_time().is_none());
    // Registered while the call was under way (to the second it is written in).
    let answered = epoch(std::time::SystemTime::now());
    let registered = gs.registration_time().unwrap().as_secs_f64();
    assert!(
        sent.floor() <= registered && registered <= answered.ceil(),
        "registration time {registered} not between the call {sent} and its answer {answered}"
    );
    assert!(
        out.request_id()
            .is_some_and(|id| id.starts_with("lastcall-emulator-"))
    );

    let out = client
        .update_game_server()
        .game_server_group_name(GROUP)
        .game_server_id(iid)
        .health_check(GameServerHealthCheck::Healthy)
        .send()
        .await
        .unwrap();
    assert!(
        out.game_server()
            .unwrap()
            .last_health_check_time()
            .is_some()
    );
    assert_eq!(emu.game_server(GROUP, iid).unwrap().health_checks, 1);

    let out = client
        .claim_game_server()
        .game_server_group_name(GROUP)
        .game_server_id(iid)
        .send()
        .await
        .unwrap();
    let gs = out.game_server().unwrap();
    assert_eq!(gs.claim_status(), Some(&GameServerClaimStatus::Claimed));
    assert!(gs.last_claim_time().is_some());
    assert!(emu.game_server(GROUP, iid).unwrap().claimed);

    client
        .update_game_server()
        .game_server_group_name(GROUP)
        .game_server_id(iid)
        .utilization_status(GameServerUtilizationStatus::Utilized)
        .send()
        .await
        .unwrap();
    let described = client
        .describe_game_server()
        .game_server_group_name(GROUP)
        .game_server_id(iid)
        .send()
        .await
        .unwrap();
    assert_eq!(
        described.game_server().unwrap().utilization_status(),
        Some(&GameServerUtilizationStatus::Utilized)
    );
    assert_eq!(emu.game_server(GROUP, iid).unwrap().utilization, "UTILIZED");

    client
        .deregister_game_server()
        .game_server_group_name(GROUP)
        .game_server_id(iid)
        .send()
        .await
        .unwrap();
    let record = emu.game_server(GROUP, iid).unwrap();
    assert!(!record.registered);
    assert_eq!(record.deregistered_count, 1);

    // Registering again after deregistration is allowed and starts fresh.
    register(&client, iid).await;
    let record = emu.game_server(GROUP, iid).unwrap();
    assert!(record.registered && !record.claimed);
    assert_eq!(record.utilization, "AVAILABLE");
    assert_eq!(record.deregistered_count, 1);
}

#[tokio::test]
async fn gamelift_register_twice_is_a_conflict() {
    let (_emu, client) = fleet().await;
    register(&client, "i-a").await;
    let err = client
        .register_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .instance_id(IID_A)
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_conflict_exception(), "{err:?}");
    assert_eq!(err.code(), Some("ConflictException"));
    assert!(
        err.message()
            .is_some_and(|m| m.contains("already registered"))
    );
}

#[tokio::test]
async fn gamelift_register_in_unknown_group_is_an_invalid_request() {
    let (_emu, client) = fleet().await;
    let err = client
        .register_game_server()
        .game_server_group_name("no-such-group")
        .game_server_id("i-a")
        .instance_id(IID_A)
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_invalid_request_exception(), "{err:?}");
}

#[tokio::test]
async fn gamelift_claim_errors() {
    let (emu, client) = fleet().await;
    let claim = |id: &'static str| {
        client
            .claim_game_server()
            .game_server_group_name(GROUP)
            .game_server_id(id)
            .send()
    };
    let err = claim("i-unregistered")
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_not_found_exception(), "{err:?}");

    register(&client, "i-a").await;
    claim("i-a").await.unwrap();
    let err = claim("i-a").await.unwrap_err().into_service_error();
    assert!(err.is_conflict_exception(), "claimed twice: {err:?}");

    // Once the claim lapses it can be claimed again; once UTILIZED it cannot.
    emu.expire_claims();
    claim("i-a").await.unwrap();
    emu.expire_claims();
    client
        .update_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .utilization_status(GameServerUtilizationStatus::Utilized)
        .send()
        .await
        .unwrap();
    let err = claim("i-a").await.unwrap_err().into_service_error();
    assert!(err.is_conflict_exception(), "utilized: {err:?}");
}

#[tokio::test]
async fn gamelift_claim_without_id_picks_an_available_server_or_reports_no_capacity() {
    let (_emu, client) = fleet().await;
    let claim_any = || {
        client
            .claim_game_server()
            .game_server_group_name(GROUP)
            .send()
    };
    let err = claim_any().await.unwrap_err().into_service_error();
    assert!(err.is_out_of_capacity_exception(), "{err:?}");
    register(&client, "i-a").await;
    let out = claim_any().await.unwrap();
    assert_eq!(out.game_server().unwrap().game_server_id(), Some("i-a"));
    let err = claim_any().await.unwrap_err().into_service_error();
    assert!(err.is_out_of_capacity_exception(), "{err:?}");
}

#[tokio::test]
async fn gamelift_update_errors() {
    let (_emu, client) = fleet().await;
    let err = client
        .update_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-unregistered")
        .health_check(GameServerHealthCheck::Healthy)
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_not_found_exception(), "{err:?}");

    register(&client, "i-a").await;
    let set = |u: GameServerUtilizationStatus| {
        client
            .update_game_server()
            .game_server_group_name(GROUP)
            .game_server_id("i-a")
            .utilization_status(u)
            .send()
    };
    set(GameServerUtilizationStatus::Utilized).await.unwrap();
    let err = set(GameServerUtilizationStatus::Available)
        .await
        .unwrap_err()
        .into_service_error();
    assert!(
        err.is_invalid_request_exception(),
        "UTILIZED -> AVAILABLE: {err:?}"
    );

    let err = set(GameServerUtilizationStatus::from("BUSY"))
        .await
        .unwrap_err()
        .into_service_error();
    // A value outside the model's enum fails validation, before the operation runs.
    assert_eq!(
        err.meta().code(),
        Some("ValidationException"),
        "unknown status: {err:?}"
    );
    assert!(
        err.meta()
            .message()
            .unwrap_or_default()
            .contains("Member must satisfy enum value set: [AVAILABLE, UTILIZED]"),
        "{err:?}"
    );
}

#[tokio::test]
async fn gamelift_deregister_and_describe_of_unregistered_are_not_found() {
    let (emu, client) = fleet().await;
    let err = client
        .deregister_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_not_found_exception(), "{err:?}");

    register(&client, "i-a").await;
    client
        .deregister_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .send()
        .await
        .unwrap();
    let err = client
        .deregister_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_not_found_exception(), "second deregister: {err:?}");
    assert_eq!(emu.game_server(GROUP, "i-a").unwrap().deregistered_count, 1);

    let err = client
        .describe_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_not_found_exception(), "{err:?}");
}

#[tokio::test]
async fn gamelift_group_may_be_named_by_arn() {
    let (_emu, client) = fleet().await;
    client
        .register_game_server()
        .game_server_group_name(GameLiftEmulator::group_arn(GROUP))
        .game_server_id("i-a")
        .instance_id(IID_A)
        .send()
        .await
        .unwrap();
    let out = client
        .describe_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .send()
        .await
        .unwrap();
    assert_eq!(
        out.game_server().unwrap().game_server_group_name(),
        Some(GROUP)
    );
}

// ------------------------------------------------ GameLift: DescribeGameServerInstances

#[tokio::test]
async fn gamelift_instances_page_by_20_returns_45_exactly_once() {
    let emu = GameLiftEmulator::start().await.unwrap();
    let arn = emu.add_group(GROUP);
    let all = ids("i-", 45);
    emu.add_instances(GROUP, &all[..30], InstanceStatus::Active);
    emu.add_instances(GROUP, &all[30..40], InstanceStatus::Draining);
    emu.add_instances(GROUP, &all[40..], InstanceStatus::SpotTerminating);
    emu.set_default_page_size(20);
    let client = emu.sdk_client_without_retries().await;

    // By hand, as the original pubsub does: no Limit, follow NextToken.
    let mut seen = Vec::new();
    let mut pages = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let out = client
            .describe_game_server_instances()
            .game_server_group_name(GROUP)
            .set_next_token(token.clone())
            .send()
            .await
            .unwrap();
        pages.push(out.game_server_instances().len());
        for i in out.game_server_instances() {
            assert_eq!(i.game_server_group_name(), Some(GROUP));
            assert_eq!(i.game_server_group_arn(), Some(arn.as_str()));
            seen.push((
                i.instance_id().unwrap().to_string(),
                i.instance_status().cloned().unwrap(),
            ));
        }
        token = out.next_token().map(str::to_string);
        if token.is_none() {
            break;
        }
    }
    assert_eq!(pages, vec![20, 20, 5]);
    assert_eq!(seen.len(), 45);
    let unique: HashSet<&String> = seen.iter().map(|(id, _)| id).collect();
    assert_eq!(unique.len(), 45);
    assert_eq!(seen[0].1, GameServerInstanceStatus::Active);
    assert_eq!(seen[35].1, GameServerInstanceStatus::Draining);
    assert_eq!(seen[44].1, GameServerInstanceStatus::SpotTerminating);
    assert_eq!(emu.count("DescribeGameServerInstances"), 3);

    // Through the SDK paginator with an explicit Limit of 20.
    emu.set_default_page_size(100);
    emu.clear_calls();
    let items: Vec<_> = client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .into_paginator()
        .page_size(20)
        .items()
        .send()
        .try_collect()
        .await
        .unwrap();
    let ids_seen: Vec<String> = items
        .iter()
        .map(|i| i.instance_id().unwrap().to_string())
        .collect();
    assert_eq!(ids_seen, all);
    assert_eq!(emu.count("DescribeGameServerInstances"), 3);
    assert!(emu.calls().iter().all(|c| c.input["Limit"] == 20));
}

#[tokio::test]
async fn gamelift_instances_filter_by_ids_at_most_20() {
    let emu = GameLiftEmulator::start().await.unwrap();
    emu.add_group(GROUP);
    let all = ids("i-", 30);
    emu.add_instances(GROUP, &all, InstanceStatus::Active);
    let client = emu.sdk_client_without_retries().await;

    let out = client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .instance_ids(&all[3])
        .instance_ids("i-0ffffffffffffffff")
        .send()
        .await
        .unwrap();
    let got: Vec<&str> = out
        .game_server_instances()
        .iter()
        .filter_map(|i| i.instance_id())
        .collect();
    assert_eq!(got, vec![all[3].as_str()]);

    let twenty = client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .set_instance_ids(Some(all[..20].to_vec()))
        .send()
        .await
        .unwrap();
    assert_eq!(twenty.game_server_instances().len(), 20);

    let err = client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .set_instance_ids(Some(all[..21].to_vec()))
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert_eq!(
        err.meta().code(),
        Some("ValidationException"),
        "21 ids: {err:?}"
    );

    let err = client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .next_token("garbage")
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_invalid_request_exception(), "bad token: {err:?}");
}

#[tokio::test]
async fn gamelift_instances_of_unknown_or_removed_group_are_not_found() {
    let (emu, client) = fleet().await;
    let describe = |g: &'static str| {
        client
            .describe_game_server_instances()
            .game_server_group_name(g)
            .send()
    };
    let err = describe("no-such-group")
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_not_found_exception(), "{err:?}");
    describe(GROUP).await.unwrap();
    emu.remove_group(GROUP);
    let err = describe(GROUP).await.unwrap_err().into_service_error();
    assert!(err.is_not_found_exception(), "removed group: {err:?}");
}

#[tokio::test]
async fn gamelift_instance_status_changes_show_up() {
    let (emu, client) = fleet().await;
    let iid = ids("i-", 1).remove(0);
    emu.set_instance_status(&iid, InstanceStatus::SpotTerminating);
    let out = client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .send()
        .await
        .unwrap();
    assert_eq!(
        out.game_server_instances()[0].instance_status(),
        Some(&GameServerInstanceStatus::SpotTerminating)
    );
    assert_eq!(
        emu.instances(GROUP),
        vec![(iid, InstanceStatus::SpotTerminating)]
    );
}

#[tokio::test]
async fn gamelift_malformed_entries_reach_the_caller() {
    let (emu, client) = fleet().await;
    let first = || async {
        client
            .describe_game_server_instances()
            .game_server_group_name(GROUP)
            .send()
            .await
            .unwrap()
            .game_server_instances()[0]
            .clone()
    };

    emu.set_malformed(GROUP, Some(Malformed::UnknownStatus));
    let entry = first().await;
    let status = entry.instance_status().unwrap();
    assert_eq!(status.as_str(), "EXPLODING");
    assert!(
        GameServerInstanceStatus::try_parse(status.as_str()).is_err(),
        "EXPLODING must be an Unknown(..) variant"
    );
    assert!(!GameServerInstanceStatus::values().contains(&status.as_str()));

    emu.set_malformed(GROUP, Some(Malformed::MissingInstanceId));
    let entry = first().await;
    assert_eq!(entry.instance_id(), None);
    assert_eq!(
        entry.instance_status(),
        Some(&GameServerInstanceStatus::Active)
    );

    emu.set_malformed(GROUP, Some(Malformed::MissingStatus));
    let entry = first().await;
    assert_eq!(entry.instance_status(), None);
    assert!(entry.instance_id().is_some());

    emu.set_malformed(GROUP, None);
    let entry = first().await;
    assert!(entry.instance_id().is_some());
    assert_eq!(
        entry.instance_status(),
        Some(&GameServerInstanceStatus::Active)
    );
}

// ------------------------------------------------------- GameLift: faults and journal

#[tokio::test]
async fn gamelift_throttling_without_retries_is_a_raw_error() {
    let (emu, client) = fleet().await;
    emu.throttle_next(1);
    let err = client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .send()
        .await
        .unwrap_err();
    let SdkError::ServiceError(ctx) = &err else {
        panic!("expected a service error, got {err:?}");
    };
    assert_eq!(ctx.raw().status().as_u16(), 400);
    let err = err.into_service_error();
    assert_eq!(err.code(), Some("ThrottlingException"));
    assert!(err.meta().message().is_some());
    assert_eq!(emu.count("DescribeGameServerInstances"), 1);
    // Only the next call was throttled.
    client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .send()
        .await
        .unwrap();
}

#[tokio::test]
async fn gamelift_default_client_retries_throttling() {
    let (emu, _) = fleet().await;
    let client = emu.sdk_client().await;
    emu.throttle_next(1);
    client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .send()
        .await
        .unwrap();
    let outcomes: Vec<String> = emu.calls().into_iter().map(|c| c.outcome).collect();
    assert_eq!(outcomes, vec!["ThrottlingException", "ok"]);
}

#[tokio::test]
async fn gamelift_server_errors_are_retried_then_surface() {
    let (emu, _) = fleet().await;
    // Standard retries with a tiny backoff, so the test does not wait seconds.
    let client = Client::from_conf(
        emu.sdk_config_builder()
            .retry_config(RetryConfig::standard().with_initial_backoff(Duration::from_millis(1)))
            .build(),
    );
    emu.fail_next("UpdateGameServer", 10, 503);
    register(&client, "i-a").await;
    let err = client
        .update_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .health_check(GameServerHealthCheck::Healthy)
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_internal_service_exception(), "{err:?}");
    assert_eq!(
        emu.count("UpdateGameServer"),
        3,
        "standard mode makes 3 attempts"
    );
    assert_eq!(emu.game_server(GROUP, "i-a").unwrap().health_checks, 0);

    emu.fail_next_with("*", 1, 400, "UnauthorizedException");
    let err = client
        .describe_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_unauthorized_exception(), "{err:?}");
}

#[tokio::test]
async fn gamelift_throttle_ratio_repeats_for_a_seed() {
    async fn outcomes(seed: u64) -> Vec<bool> {
        let (emu, client) = fleet().await;
        emu.set_seed(seed);
        emu.set_throttle_ratio(0.5);
        let mut out = Vec::new();
        for _ in 0..24 {
            out.push(
                client
                    .describe_game_server_instances()
                    .game_server_group_name(GROUP)
                    .send()
                    .await
                    .is_ok(),
            );
        }
        out
    }
    let a = outcomes(42).await;
    assert_eq!(a, outcomes(42).await);
    assert!(a.contains(&true) && a.contains(&false), "{a:?}");
}

#[tokio::test]
async fn gamelift_latency_trips_the_sdk_attempt_timeout() {
    let (emu, _) = fleet().await;
    let client = Client::from_conf(
        emu.sdk_config_builder()
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .operation_attempt_timeout(Duration::from_millis(100))
                    .build(),
            )
            .build(),
    );
    emu.set_latency(Duration::from_secs(5));
    let err = client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .send()
        .await
        .unwrap_err();
    assert!(matches!(err, SdkError::TimeoutError(_)), "{err:?}");
}

#[tokio::test]
async fn gamelift_journal_records_calls_in_order() {
    let (emu, client) = fleet().await;
    register(&client, "i-a").await;
    let _ = client
        .register_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .instance_id(IID_A)
        .send()
        .await;
    client
        .update_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("i-a")
        .health_check(GameServerHealthCheck::Healthy)
        .send()
        .await
        .unwrap();

    let calls = emu.calls();
    let summary: Vec<(&str, &str)> = calls
        .iter()
        .map(|c| (c.op.as_str(), c.outcome.as_str()))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("RegisterGameServer", "ok"),
            ("RegisterGameServer", "ConflictException"),
            ("UpdateGameServer", "ok"),
        ]
    );
    assert!(
        calls
            .windows(2)
            .all(|w| w[0].seq < w[1].seq && w[0].at <= w[1].at)
    );
    assert_eq!(
        calls[0].input,
        serde_json::json!({"GameServerGroupName": GROUP, "GameServerId": "i-a", "InstanceId": IID_A})
    );
    assert_eq!(calls[2].input["HealthCheck"], "HEALTHY");
    assert_eq!(emu.count("RegisterGameServer"), 2);
    emu.clear_calls();
    assert!(emu.calls().is_empty());
    assert_eq!(emu.count("RegisterGameServer"), 0);
}

#[tokio::test]
async fn gamelift_wire_format_is_rpc_v2_cbor() {
    let (emu, _client) = fleet().await;
    let http = reqwest::Client::new();
    let url = format!(
        "{}/service/GameLift/operation/DescribeGameServer",
        emu.url()
    );
    let mut body = Vec::new();
    ciborium::into_writer(
        &ciborium::Value::Map(vec![
            ("GameServerGroupName".into(), GROUP.into()),
            ("GameServerId".into(), "i-nope".into()),
        ]),
        &mut body,
    )
    .unwrap();

    // A well-formed request for an unregistered server: a CBOR error with a shape-id __type.
    let resp = http
        .post(&url)
        .header("content-type", "application/cbor")
        .header("smithy-protocol", "rpc-v2-cbor")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(resp.headers()["content-type"], "application/cbor");
    assert_eq!(resp.headers()["smithy-protocol"], "rpc-v2-cbor");
    let error: ciborium::Value = ciborium::from_reader(&resp.bytes().await.unwrap()[..]).unwrap();
    let error: std::collections::HashMap<String, String> = error.deserialized().unwrap();
    assert_eq!(error["__type"], "com.amazonaws.gamelift#NotFoundException");
    assert!(error.contains_key("Message"));

    // Without the protocol header the request is refused.
    let resp = http
        .post(&url)
        .header("content-type", "application/cbor")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);

    // An operation the emulator does not know.
    let resp = http
        .post(format!(
            "{}/service/GameLift/operation/CreateFleet",
            emu.url()
        ))
        .header("content-type", "application/cbor")
        .header("smithy-protocol", "rpc-v2-cbor")
        .body(vec![0xa0])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let outcomes: Vec<String> = emu.calls().into_iter().map(|c| c.outcome).collect();
    assert_eq!(
        outcomes,
        vec![
            "NotFoundException",
            "SerializationException",
            "UnknownOperationException"
        ]
    );
}

#[tokio::test]
async fn gamelift_validates_requests_as_the_model_says() {
    let (emu, client) = fleet().await;
    // The ids old test worlds used: the real service refuses them.
    let err = client
        .register_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("gs")
        .instance_id("i-n1")
        .connection_info("   ")
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert_eq!(err.meta().code(), Some("ValidationException"), "{err:?}");
    let msg = err.meta().message().unwrap_or_default();
    assert!(msg.starts_with("4 validation errors detected: "), "{msg}");
    for part in [
        "Value 'i-n1' at 'instanceId' failed to satisfy constraint: Member must have length greater than or equal to 19",
        "Value 'i-n1' at 'instanceId' failed to satisfy constraint: Member must satisfy regular expression pattern: ^i-[0-9a-zA-Z]{17}$",
        "Value 'gs' at 'gameServerId' failed to satisfy constraint: Member must have length greater than or equal to 3",
        "Value '   ' at 'connectionInfo' failed to satisfy constraint: Member must satisfy regular expression pattern: .*\\S.*",
    ] {
        assert!(msg.contains(part), "missing {part:?} in {msg}");
    }
    // Nothing was registered, and the journal names the error.
    assert!(emu.game_server(GROUP, "gs").is_none());
    assert_eq!(emu.calls().last().unwrap().outcome, "ValidationException");
    // A missing required member and a bad group name.
    let err = client
        .describe_game_server()
        .game_server_group_name("bad group!")
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    let msg = err.meta().message().unwrap_or_default();
    assert!(
        msg.contains(
            "Value null at 'gameServerId' failed to satisfy constraint: Member must not be null"
        ),
        "{msg}"
    );
    assert!(
        msg.contains("Value 'bad group!' at 'gameServerGroupName'"),
        "{msg}"
    );
    // Bad ids in a DescribeGameServerInstances filter, and a Limit below 1.
    let err = client
        .describe_game_server_instances()
        .game_server_group_name(GROUP)
        .instance_ids("i-0123456789abcdef")
        .limit(0)
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    let msg = err.meta().message().unwrap_or_default();
    assert!(msg.contains("at 'instanceIds.member'"), "{msg}");
    assert!(msg.contains("Value '0' at 'limit' failed to satisfy constraint: Member must have value greater than or equal to 1"), "{msg}");
    // A realistic request passes.
    register(&client, "gs-1").await;
    assert!(emu.game_server(GROUP, "gs-1").unwrap().registered);
}

#[test]
#[should_panic(expected = "is not an EC2 instance id")]
fn gamelift_worlds_refuse_unrealistic_instance_ids() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let emu = rt.block_on(GameLiftEmulator::start()).unwrap();
    emu.add_instances(GROUP, &["i-n1".to_string()], InstanceStatus::Active);
}

#[test]
fn gamelift_instance_ids_for_test_names_are_realistic_and_stable() {
    use lastcall_testkit::gamelift::instance_id;
    assert_eq!(instance_id("n1"), "i-000000000000000n1");
    assert_eq!(instance_id("node-a"), "i-000000000000nodea");
    let long = instance_id("a-very-long-node-name-ip-10-0-0-1.ec2.internal");
    assert_eq!(long.len(), 19);
    assert!(long.starts_with("i-0"));
    assert_eq!(
        long,
        instance_id("a-very-long-node-name-ip-10-0-0-1.ec2.internal")
    );
    assert_ne!(
        long,
        instance_id("a-very-long-node-name-ip-10-0-0-2.ec2.internal")
    );
}

#[tokio::test]
async fn gamelift_hang_holds_calls_until_released_or_the_client_gives_up() {
    let (emu, _) = fleet().await;
    let impatient = Client::from_conf(
        emu.sdk_config_builder()
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .operation_attempt_timeout(Duration::from_millis(200))
                    .build(),
            )
            .build(),
    );
    emu.hang_next("RegisterGameServer", 1);
    let err = impatient
        .register_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("gs-1")
        .instance_id(IID_A)
        .send()
        .await
        .unwrap_err();
    assert!(matches!(err, SdkError::TimeoutError(_)), "{err:?}");
    // The client gave up: the call is dropped, never served and never journaled.
    wait_for("the abandoned call to be let go", || async {
        (emu.hung_now() == 0).then_some(())
    })
    .await;
    assert_eq!(emu.count("RegisterGameServer"), 0);
    assert!(emu.game_server(GROUP, "gs-1").is_none());

    // A patient client waits until the hang is released, then gets its answer.
    let patient = emu.sdk_client_without_retries().await;
    emu.hang_next("*", 1);
    let call = tokio::spawn(async move {
        patient
            .register_game_server()
            .game_server_group_name(GROUP)
            .game_server_id("gs-2")
            .instance_id(IID_A)
            .send()
            .await
    });
    wait_for("the call to be held", || async {
        (emu.hung_now() == 1).then_some(())
    })
    .await;
    assert!(
        emu.game_server(GROUP, "gs-2").is_none(),
        "not served while held"
    );
    emu.release_hangs();
    call.await.unwrap().unwrap();
    assert!(emu.game_server(GROUP, "gs-2").unwrap().registered);
    assert_eq!(emu.hung_now(), 0);
}

/// One AWS JSON 1.1 call, as boto3 sends it.
async fn json_call(
    http: &reqwest::Client,
    emu: &GameLiftEmulator,
    op: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value, String) {
    let resp = http
        .post(format!("{}/", emu.url()))
        .header("x-amz-target", format!("GameLift.{op}"))
        .header("content-type", "application/x-amz-json-1.1")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let v: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    (status, v, ct)
}

#[tokio::test]
async fn gamelift_speaks_aws_json_1_1() {
    let (emu, _) = fleet().await;
    let http = reqwest::Client::new();
    let epoch = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let sent = epoch(std::time::SystemTime::now());
    let (status, v, ct) = json_call(
        &http,
        &emu,
        "RegisterGameServer",
        serde_json::json!({"GameServerGroupName": GROUP, "GameServerId": "gs-1", "InstanceId": IID_A, "ConnectionInfo": "10.0.0.1:7777"}),
    )
    .await;
    assert_eq!((status, ct.as_str()), (200, "application/x-amz-json-1.1"));
    let gs = &v["GameServer"];
    assert_eq!(gs["GameServerId"], "gs-1");
    assert_eq!(gs["InstanceId"], IID_A);
    assert_eq!(gs["UtilizationStatus"], "AVAILABLE");
    assert_eq!(gs["GameServerGroupArn"], GameLiftEmulator::group_arn(GROUP));
    // Timestamps are epoch seconds as numbers.
    let answered = epoch(std::time::SystemTime::now());
    let registered = gs["RegistrationTime"].as_f64().expect("a number");
    assert!(
        sent.floor() <= registered && registered <= answered.ceil(),
        "registration time {registered} not between the call {sent} and its answer {answered}"
    );

    // The same world as the CBOR front: the SDK sees the server.
    let sdk = emu.sdk_client_without_retries().await;
    let out = sdk
        .describe_game_server()
        .game_server_group_name(GROUP)
        .game_server_id("gs-1")
        .send()
        .await
        .unwrap();
    assert_eq!(out.game_server().unwrap().instance_id(), Some(IID_A));

    let (status, v, _) = json_call(
        &http,
        &emu,
        "DescribeGameServerInstances",
        serde_json::json!({"GameServerGroupName": GROUP, "Limit": 5}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(v["GameServerInstances"][0]["InstanceStatus"], "ACTIVE");
    assert!(v.get("NextToken").is_none());

    // An operation without output answers {}.
    let (status, v, _) = json_call(
        &http,
        &emu,
        "DeregisterGameServer",
        serde_json::json!({"GameServerGroupName": GROUP, "GameServerId": "gs-1"}),
    )
    .await;
    assert_eq!((status, v), (200, serde_json::json!({})));

    // Errors: 400 with __type and message.
    let (status, v, _) = json_call(
        &http,
        &emu,
        "DescribeGameServer",
        serde_json::json!({"GameServerGroupName": GROUP, "GameServerId": "gs-1"}),
    )
    .await;
    assert_eq!(
        (status, v["__type"].as_str()),
        (400, Some("NotFoundException"))
    );
    assert!(v["message"].as_str().unwrap().contains("gs-1"));
    let (status, v, _) = json_call(
        &http,
        &emu,
        "RegisterGameServer",
        serde_json::json!({"GameServerGroupName": GROUP, "GameServerId": "gs-2", "InstanceId": "i-n1"}),
    )
    .await;
    assert_eq!(
        (status, v["__type"].as_str()),
        (400, Some("ValidationException"))
    );
    let (status, v, _) = json_call(&http, &emu, "ListGameServers", serde_json::json!({})).await;
    assert_eq!(
        (status, v["__type"].as_str()),
        (404, Some("UnknownOperationException"))
    );

    // Injected faults apply to this front too.
    emu.fail_next("DescribeGameServerInstances", 1, 503);
    let (status, v, _) = json_call(
        &http,
        &emu,
        "DescribeGameServerInstances",
        serde_json::json!({"GameServerGroupName": GROUP}),
    )
    .await;
    assert_eq!(
        (status, v["__type"].as_str()),
        (503, Some("InternalServiceException"))
    );

    // Protocol errors: no target, wrong content type.
    let resp = http
        .post(format!("{}/", emu.url()))
        .header("content-type", "application/x-amz-json-1.1")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["__type"], "UnknownOperationException");
    let resp = http
        .post(format!("{}/", emu.url()))
        .header("x-amz-target", "GameLift.DescribeGameServer")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["__type"], "SerializationException");

    // Every call is journaled, whichever front carried it.
    let ops: Vec<(String, String)> = emu.calls().into_iter().map(|c| (c.op, c.outcome)).collect();
    assert_eq!(
        ops[..3],
        [
            ("RegisterGameServer".to_string(), "ok".to_string()),
            ("DescribeGameServer".to_string(), "ok".to_string()),
            ("DescribeGameServerInstances".to_string(), "ok".to_string()),
        ]
    );
}

// ------------------------------------------------------------------------------ IMDS

async fn token(http: &reqwest::Client, imds: &ImdsEmulator, ttl: &str) -> reqwest::Response {
    http.put(format!("{}/latest/api/token", imds.url()))
        .header("X-aws-ec2-metadata-token-ttl-seconds", ttl)
        .send()
        .await
        .unwrap()
}

async fn get(
    http: &reqwest::Client,
    imds: &ImdsEmulator,
    path: &str,
    token: Option<&str>,
) -> (u16, String) {
    let mut req = http.get(format!("{}{path}", imds.url()));
    if let Some(t) = token {
        req = req.header("X-aws-ec2-metadata-token", t);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

const INSTANCE_ID: &str = "/latest/meta-data/instance-id";

#[tokio::test]
async fn imds_token_flow() {
    let imds = ImdsEmulator::start(
        "i-0123456789abcdef0",
        "ip-10-0-0-1.us-west-2.compute.internal",
    )
    .await
    .unwrap();
    let http = reqwest::Client::new();

    assert_eq!(get(&http, &imds, INSTANCE_ID, None).await.0, 401);
    assert_eq!(get(&http, &imds, INSTANCE_ID, Some("made-up")).await.0, 401);
    for bad in ["0", "21601", "-5", "soon"] {
        assert_eq!(token(&http, &imds, bad).await.status(), 400, "ttl {bad}");
    }
    let resp = http
        .put(format!("{}/latest/api/token", imds.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400, "missing ttl header");

    let resp = token(&http, &imds, "21600").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-aws-ec2-metadata-token-ttl-seconds"],
        "21600"
    );
    let t1 = resp.text().await.unwrap();
    assert_eq!(
        get(&http, &imds, INSTANCE_ID, Some(&t1)).await,
        (200, "i-0123456789abcdef0".to_string())
    );
    assert_eq!(imds.live_tokens(), 1);

    imds.expire_tokens();
    assert_eq!(get(&http, &imds, INSTANCE_ID, Some(&t1)).await.0, 401);
    let t2 = token(&http, &imds, "60").await.text().await.unwrap();
    assert_ne!(t1, t2);
    assert_eq!(get(&http, &imds, INSTANCE_ID, Some(&t2)).await.0, 200);

    let statuses: Vec<u16> = imds.requests().iter().map(|(_, _, s)| *s).collect();
    assert_eq!(
        statuses,
        vec![401, 401, 400, 400, 400, 400, 400, 200, 200, 401, 200, 200]
    );
    assert_eq!(
        imds.requests()[7],
        ("PUT".to_string(), "/latest/api/token".to_string(), 200)
    );
}

#[tokio::test]
async fn imds_token_expires_with_its_ttl() {
    let imds = ImdsEmulator::start("i-00000000000000001", "host-1")
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let t = token(&http, &imds, "1").await.text().await.unwrap();
    assert_eq!(get(&http, &imds, INSTANCE_ID, Some(&t)).await.0, 200);
    // Tokio's test-util (paused clock) is not enabled in this workspace, so the
    // 1 s TTL really passes; bounded polling, no sleep.
    wait_for("token with a 1 s TTL expires", || {
        let (http, imds, t) = (&http, &imds, &t);
        async move { (get(http, imds, INSTANCE_ID, Some(t)).await.0 == 401).then_some(()) }
    })
    .await;
    assert_eq!(imds.live_tokens(), 0);
}

#[tokio::test]
async fn imds_metadata_and_interruption_paths() {
    let imds = ImdsEmulator::start("i-0abc0000000000000", "ip-10-1-2-3.ec2.internal")
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let t = token(&http, &imds, "300").await.text().await.unwrap();
    let t = Some(t.as_str());
    let json = |s: String| serde_json::from_str::<serde_json::Value>(&s).unwrap();

    assert_eq!(
        get(&http, &imds, "/latest/meta-data/local-hostname", t).await,
        (200, "ip-10-1-2-3.ec2.internal".to_string())
    );
    assert_eq!(
        get(&http, &imds, "/latest/meta-data/placement/region", t).await,
        (200, "us-west-2".to_string())
    );
    assert_eq!(
        get(&http, &imds, "/latest/meta-data/no/such/path", t)
            .await
            .0,
        404
    );

    let spot = "/latest/meta-data/spot/instance-action";
    let scheduled = "/latest/meta-data/events/maintenance/scheduled";
    let rebalance = "/latest/meta-data/events/recommendations/rebalance";
    assert_eq!(get(&http, &imds, spot, t).await.0, 404);
    assert_eq!(get(&http, &imds, rebalance, t).await.0, 404);
    let (status, body) = get(&http, &imds, scheduled, t).await;
    assert_eq!((status, json(body)), (200, serde_json::json!([])));

    let action = serde_json::json!({"action": "terminate", "time": "2026-11-20T08:22:00Z"});
    imds.set_spot_action(Some(action.clone()));
    let (status, body) = get(&http, &imds, spot, t).await;
    assert_eq!((status, json(body)), (200, action));

    let events = serde_json::json!([{
        "NotBefore": "21 Jan 2019 09:00:43 GMT", "Code": "system-reboot",
        "Description": "scheduled reboot", "EventId": "instance-event-0d59937288b749b32",
        "NotAfter": "21 Jan 2019 09:17:23 GMT", "State": "active"
    }]);
    imds.set_scheduled_events(events.clone());
    let (status, body) = get(&http, &imds, scheduled, t).await;
    assert_eq!((status, json(body)), (200, events));

    let notice = serde_json::json!({"noticeTime": "2026-11-20T08:00:00Z"});
    imds.set_rebalance(Some(notice.clone()));
    let (status, body) = get(&http, &imds, rebalance, t).await;
    assert_eq!((status, json(body)), (200, notice));

    imds.set_spot_action(None);
    imds.set_rebalance(None);
    assert_eq!(get(&http, &imds, spot, t).await.0, 404);
    assert_eq!(get(&http, &imds, rebalance, t).await.0, 404);
    // Metadata still needs the token.
    assert_eq!(get(&http, &imds, spot, None).await.0, 401);
}

#[tokio::test]
async fn imds_fail_next_answers_the_injected_status() {
    let imds = ImdsEmulator::start("i-00000000000000001", "host-1")
        .await
        .unwrap();
    let http = reqwest::Client::new();
    imds.fail_next(2, 503);
    assert_eq!(token(&http, &imds, "60").await.status(), 503);
    assert_eq!(token(&http, &imds, "60").await.status(), 503);
    let t = token(&http, &imds, "60").await.text().await.unwrap();
    assert_eq!(get(&http, &imds, INSTANCE_ID, Some(&t)).await.0, 200);
}

// ----------------------------------------------------------------------------- Redis

#[tokio::test]
async fn redis_kill_and_restart_on_the_same_port() {
    let mut server = RedisServer::start().await.unwrap();
    let port = server.port();
    assert_ne!(port, 6379);
    assert_eq!(server.url(), format!("redis://127.0.0.1:{port}"));
    assert_eq!(server.host_port(), format!("127.0.0.1:{port}"));

    let mut conn = server.client().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap();
    let v: String = redis::cmd("GET")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, "v");

    server.kill().await;
    assert!(
        server.client().await.is_err(),
        "connecting to a killed server must fail"
    );
    let stale: redis::RedisResult<String> = redis::cmd("GET").arg("k").query_async(&mut conn).await;
    assert!(stale.is_err(), "the old connection must fail too");

    server.restart().await.unwrap();
    assert_eq!(server.port(), port);
    let mut conn = server.client().await.unwrap();
    let v: Option<String> = redis::cmd("GET")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, None, "no persistence across restarts");

    // Restart while running also works (kill first, same port).
    server.restart().await.unwrap();
    let mut conn = server.client().await.unwrap();
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(pong, "PONG");
}

#[tokio::test]
async fn redis_servers_get_different_ports() {
    let a = RedisServer::start().await.unwrap();
    let b = RedisServer::start().await.unwrap();
    assert_ne!(a.port(), b.port());
    let mut ca = a.client().await.unwrap();
    let mut cb = b.client().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg("only-in-a")
        .arg(1)
        .query_async(&mut ca)
        .await
        .unwrap();
    let in_b: Option<i64> = redis::cmd("GET")
        .arg("only-in-a")
        .query_async(&mut cb)
        .await
        .unwrap();
    assert_eq!(in_b, None);
}

#[tokio::test]
async fn redis_pubsub_reaches_a_subscriber() {
    let server = RedisServer::start().await.unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub.subscribe("i-0123").await.unwrap();
    let mut conn = server.client().await.unwrap();
    let receivers: i64 = redis::cmd("PUBLISH")
        .arg("i-0123")
        .arg(r#"{"InstanceStatus": "DRAINING"}"#)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(receivers, 1);
    use futures::StreamExt;
    let msg = pubsub.on_message().next().await.unwrap();
    assert_eq!(msg.get_channel_name(), "i-0123");
    assert_eq!(
        msg.get_payload::<String>().unwrap(),
        r#"{"InstanceStatus": "DRAINING"}"#
    );
}

#[tokio::test]
async fn imds_refuses_unrealistic_instance_ids() {
    let err = ImdsEmulator::start("i-n1", "host-1").await.err().unwrap();
    assert!(
        err.to_string().contains("is not an EC2 instance id"),
        "{err}"
    );
    ImdsEmulator::start("i-0123456789abcdef0", "host-1")
        .await
        .unwrap();
}

#[tokio::test]
async fn azure_scheduled_events_need_the_metadata_header_and_record_approvals() {
    use lastcall_emulators::azure::{AzureMetadataEmulator, event};
    let vm = "aks-games-12345678-vmss_3";
    let emu = AzureMetadataEmulator::start(vm).await.unwrap();
    let http = reqwest::Client::new();
    let url = format!(
        "{}/metadata/scheduledevents?api-version=2020-07-01",
        emu.url()
    );
    let get = |url: String, header: bool| {
        let mut r = http.get(url);
        if header {
            r = r.header("Metadata", "true");
        }
        async move {
            let r = r.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.text().await.unwrap())
        }
    };
    // Without `Metadata: true` or an api-version: 400 with a JSON error.
    let (status, body) = get(url.clone(), false).await;
    assert_eq!(status, 400);
    assert!(body.contains("metadata header"), "{body}");
    let (status, _) = get(format!("{}/metadata/scheduledevents", emu.url()), true).await;
    assert_eq!(status, 400);
    // The document: the incarnation grows with every change.
    let (status, body) = get(url.clone(), true).await;
    assert_eq!(status, 200);
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        doc,
        serde_json::json!({"DocumentIncarnation": 1, "Events": []})
    );
    emu.set_events(vec![event(
        "e1",
        "Reboot",
        vm,
        "Mon, 19 Sep 2016 18:29:47 GMT",
    )]);
    let doc: serde_json::Value = serde_json::from_str(&get(url.clone(), true).await.1).unwrap();
    assert_eq!(doc["DocumentIncarnation"], 2);
    assert_eq!(doc["Events"][0]["EventStatus"], "Scheduled");
    assert_eq!(doc["Events"][0]["Resources"][0], vm);
    // The VM's own name.
    let (status, name) = get(
        format!(
            "{}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
            emu.url()
        ),
        true,
    )
    .await;
    assert_eq!((status, name.as_str()), (200, vm));
    // Approval: recorded, and the event starts (NotBefore empties).
    let post = |body: serde_json::Value| {
        http.post(url.clone())
            .header("Metadata", "true")
            .json(&body)
            .send()
    };
    let r = post(serde_json::json!({"StartRequests": [{"EventId": "nope"}]}))
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "an unknown EventId");
    let r = post(serde_json::json!({"StartRequests": [{"EventId": "e1"}]}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(emu.approvals(), ["e1"]);
    let doc: serde_json::Value = serde_json::from_str(&get(url.clone(), true).await.1).unwrap();
    assert_eq!(doc["DocumentIncarnation"], 3);
    assert_eq!(doc["Events"][0]["EventStatus"], "Started");
    assert_eq!(doc["Events"][0]["NotBefore"], "");
    // Injected faults: error statuses, a garbled body, connection refused.
    emu.fail_next(1, 503);
    assert_eq!(get(url.clone(), true).await.0, 503);
    emu.set_garbled(Some("<html>"));
    assert_eq!(get(url.clone(), true).await, (200, "<html>".to_string()));
    emu.set_garbled(None);
    emu.set_unreachable(true).await.unwrap();
    assert!(http.get(url.clone()).send().await.is_err());
    emu.set_unreachable(false).await.unwrap();
    assert_eq!(get(url.clone(), true).await.0, 200);
    let journal = emu.requests();
    assert!(!journal[0].metadata_header && journal[0].status == 400);
    assert_eq!(journal.iter().filter(|r| r.method == "POST").count(), 2);
    // The reads that could have told a reader the document: not the refused (no header),
    // failed or garbled ones.
    let reads = emu.event_reads();
    let at = |f: &dyn Fn(&lastcall_emulators::azure::Request) -> bool| {
        journal.iter().find(|r| f(r)).map(|r| r.at).unwrap()
    };
    for refused in [
        at(&|r| r.garbled),
        at(&|r| r.status == 503),
        at(&|r| r.status == 400),
    ] {
        assert!(!reads.contains(&refused));
    }
    assert_eq!(reads.last(), journal.last().map(|r| r.at).as_ref());
    assert_eq!(journal.iter().filter(|r| r.garbled).count(), 1);
}
