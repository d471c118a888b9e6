//! Conformance of the Kubernetes API emulator: the real `kube::Client` over HTTP, with
//! assertions on status codes, `Status` bodies and stored state, for each semantic the
//! emulator claims (see docs/testing/kube-emulator.md).

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    Preconditions, WatchEvent, WatchParams,
};
use kube::core::GroupVersionKind;
use kube::{Client, ResourceExt};
use lastcall_testkit::bins::workspace_binary;
use lastcall_testkit::conformance::{
    self, Backend, api_err, cm, describe, ev, gameserver, gs_resource, next_event, pod, rv_of,
};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::resources::{CONFIGMAPS, EVENTS_K8S, GAMESERVERS, NODES, PODS};
use lastcall_testkit::kube::{Emulator, FaultAction, FaultRule, Method, Options, Store, Verb};
use lastcall_testkit::process::signal;
use serde_json::{Value, json};

async fn setup() -> (Emulator, Client) {
    let emu = Emulator::start().await.unwrap();
    let client = emu.client().await.unwrap();
    (emu, client)
}

/// A client that shows 429/503 answers instead of retrying them (kube retries by default).
async fn setup_no_retry() -> (Emulator, Client) {
    let emu = Emulator::start().await.unwrap();
    let client = emu.client_no_retry("test").await.unwrap();
    (emu, client)
}

// ---------------------------------------------------------------- resourceVersion, CRUD

#[tokio::test]
async fn resource_version_is_monotonic_across_resources() {
    let b = Backend::emulator().await;
    conformance::resource_version_is_monotonic_across_resources(&b).await;
    // A list's resourceVersion is the last write's: nothing else writes to the emulator.
    let pods: Api<Pod> = Api::default_namespaced(b.client.clone());
    let last = rv_of(&pods.get("p1").await.unwrap());
    let list = pods.list(&ListParams::default()).await.unwrap();
    let list_rv: u64 = list.metadata.resource_version.unwrap().parse().unwrap();
    assert_eq!(list_rv, last);
    assert_eq!(b.emu().store().resource_version(), last);
}

#[tokio::test]
async fn stale_replace_is_a_conflict() {
    let b = Backend::emulator().await;
    conformance::stale_replace_is_a_conflict(&b).await;
}

#[tokio::test]
async fn create_get_errors_have_real_statuses() {
    let b = Backend::emulator().await;
    conformance::create_get_errors_have_real_statuses(&b).await;
}

#[tokio::test]
async fn unknown_paths_and_methods_answer_with_status() {
    let (emu, _client) = setup().await;
    let http = reqwest::Client::new();
    let r = http
        .get(format!("{}/apis/apps/v1/deployments", emu.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        (body["kind"].as_str(), body["reason"].as_str()),
        (Some("Status"), Some("NotFound"))
    );
    let r = http
        .post(format!("{}/api/v1/pods", emu.url()))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let r = http
        .post(format!(
            "{}/api/v1/namespaces/default/configmaps",
            emu.url()
        ))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["reason"], "BadRequest");
}

// ---------------------------------------------------------------- delete

#[tokio::test]
async fn delete_preconditions_conflict_and_keep_the_object() {
    let b = Backend::emulator().await;
    conformance::delete_preconditions_conflict_and_keep_the_object(&b).await;
}

#[tokio::test]
async fn finalizers_keep_a_deleted_object_until_removed() {
    let b = Backend::emulator().await;
    conformance::finalizers_keep_a_deleted_object_until_removed(&b).await;
    assert!(
        b.emu()
            .store()
            .get(&CONFIGMAPS, Some("default"), "c1")
            .is_none()
    );
}

#[tokio::test]
async fn pod_grace_period_keeps_a_bound_pod_terminating() {
    let b = Backend::emulator().await;
    conformance::pod_grace_period_keeps_a_bound_pod_terminating(&b).await;
    let pods: Api<Pod> = Api::default_namespaced(b.client.clone());
    b.emu()
        .store()
        .remove(&PODS, Some("default"), "p1")
        .unwrap();
    assert_eq!(api_err(pods.get("p1").await).code, 404);
    conformance::unbound_pods_and_grace_zero_go_at_once(&b).await;
    // gracePeriodSeconds as a query parameter works too.
    pods.create(&PostParams::default(), &pod("p4", Some("n1"), json!({})))
        .await
        .unwrap();
    let r = reqwest::Client::new()
        .delete(format!(
            "{}/api/v1/namespaces/default/pods/p4?gracePeriodSeconds=9",
            b.emu().url()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        pods.get("p4")
            .await
            .unwrap()
            .metadata
            .deletion_grace_period_seconds,
        Some(9)
    );
}

#[tokio::test]
async fn delete_collection_by_label() {
    let b = Backend::emulator().await;
    conformance::delete_collection_by_label(&b).await;
}

// ---------------------------------------------------------------- patch

#[tokio::test]
async fn merge_patch_and_its_resource_version_guard() {
    let b = Backend::emulator().await;
    conformance::merge_patch_and_its_resource_version_guard(&b).await;
}

#[tokio::test]
async fn json_patch_and_failed_test_is_422() {
    let b = Backend::emulator().await;
    conformance::json_patch_and_failed_test_is_422(&b).await;
    // Malformed JSON patch: 400.
    let r = reqwest::Client::new()
        .patch(format!(
            "{}/api/v1/namespaces/default/pods/p1",
            b.emu().url()
        ))
        .header("content-type", "application/json-patch+json")
        .body(r#"{"op": "add"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
}

#[tokio::test]
async fn strategic_merge_subset_and_unsupported_patch_types() {
    let b = Backend::emulator().await;
    conformance::strategic_merge_of_conditions_not_of_custom_resources(&b).await;
    // No server-side apply on the emulator.
    let pods: Api<Pod> = Api::default_namespaced(b.client.clone());
    let s = api_err(
        pods.patch(
            "p1",
            &PatchParams::apply("test"),
            &Patch::Apply(json!({"metadata": {"name": "p1"}})),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (415, "UnsupportedMediaType"));
}

// ---------------------------------------------------------------- watch

#[tokio::test]
async fn watch_reports_added_modified_deleted() {
    let b = Backend::emulator().await;
    conformance::watch_reports_added_modified_deleted(&b).await;
}

#[tokio::test]
async fn watch_resumes_after_a_resource_version() {
    let b = Backend::emulator().await;
    conformance::watch_resumes_after_a_resource_version(&b).await;
}

#[tokio::test]
async fn watch_from_a_compacted_resource_version_is_410() {
    let emu = Emulator::start_with(Store::new(3), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let client = emu.client().await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let first = cms.create(&PostParams::default(), &cm("c0")).await.unwrap();
    for i in 1..10 {
        cms.create(&PostParams::default(), &cm(&format!("c{i}")))
            .await
            .unwrap();
    }
    let mut w = cms
        .watch(&WatchParams::default(), &rv_of(&first).to_string())
        .await
        .unwrap()
        .boxed();
    match next_event(&mut w).await {
        WatchEvent::Error(s) => {
            assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
            assert!(
                s.message.contains("too old resource version"),
                "{}",
                s.message
            );
        }
        other => panic!("expected ERROR 410, got {:?}", describe(&other)),
    }
    assert!(w.next().await.is_none(), "the stream ends after the error");
    // Within the history, resumption works.
    let rv = emu.store().resource_version() - 2;
    let mut w = cms
        .watch(&WatchParams::default(), &rv.to_string())
        .await
        .unwrap()
        .boxed();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "c8"));
    // A paged list whose continue token is older than the history is 410 too.
    let page = cms.list(&ListParams::default().limit(2)).await.unwrap();
    let token = page.metadata.continue_.clone().unwrap();
    for i in 10..15 {
        cms.create(&PostParams::default(), &cm(&format!("c{i}")))
            .await
            .unwrap();
    }
    let s = api_err(
        cms.list(&ListParams::default().limit(2).continue_token(&token))
            .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
}

/// A restart, as clients see it: open watches end, every request is answered 503 while the
/// server is down, then a watch resumed from before the restart is answered 410 (the new
/// watch cache starts empty), and a list followed by a watch from its resourceVersion works.
/// The objects survive (etcd keeps them).
#[tokio::test]
async fn a_restart_ends_watches_refuses_requests_then_answers_410_to_a_resumed_watch() {
    let (emu, _) = setup().await;
    let client = emu.client_no_retry("test").await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let a = cms.create(&PostParams::default(), &cm("a")).await.unwrap();
    let mut w = cms
        .watch(&WatchParams::default(), &rv_of(&a).to_string())
        .await
        .unwrap()
        .boxed();
    cms.create(&PostParams::default(), &cm("b")).await.unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "b"));
    // What a client resumes from: older than the newest write when the server restarts.
    let before = rv_of(&a);
    emu.restart(Duration::from_secs(2));
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(e) = w.next().await {
            let e = e.expect("a well-formed watch event");
            assert!(
                matches!(e, WatchEvent::Bookmark(_)),
                "only bookmarks before the end"
            );
        }
    })
    .await;
    assert!(ended.is_ok(), "the open watch ended with the restart");
    // Down: reads, writes and watches are all answered 503.
    let s = api_err(cms.get("a").await);
    assert_eq!((s.code, s.reason.as_str()), (503, "ServiceUnavailable"));
    let s = api_err(cms.create(&PostParams::default(), &cm("c")).await);
    assert_eq!(s.code, 503);
    let s = api_err(
        cms.watch(&WatchParams::default(), &before.to_string())
            .await
            .map(|_| ()),
    );
    assert_eq!(s.code, 503);
    assert!(
        emu.journal().count(|e| e.status == 503) >= 3,
        "refusals are journaled"
    );
    // Up again: a watch resumed from before the restart is 410.
    let mut resumed = None;
    for _ in 0..100 {
        match cms
            .watch(&WatchParams::default(), &before.to_string())
            .await
        {
            Ok(w) => {
                resumed = Some(w.boxed());
                break;
            }
            Err(kube::Error::Api(s)) if s.code == 503 => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    let mut resumed = resumed.expect("the server serves again after its down time");
    match next_event(&mut resumed).await {
        WatchEvent::Error(s) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
        other => panic!("expected ERROR 410, got {:?}", describe(&other)),
    }
    // Nothing was lost: a list sees both objects, and a watch from the list's
    // resourceVersion sees what comes next.
    let list = cms.list(&ListParams::default()).await.unwrap();
    let names: Vec<String> = list.items.iter().map(|c| c.name_any()).collect();
    assert_eq!(names, vec!["a", "b"]);
    let mut w = cms
        .watch(
            &WatchParams::default(),
            list.metadata.resource_version.as_deref().unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    cms.create(&PostParams::default(), &cm("d")).await.unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "d"));
}

/// The out-of-process emulator restarts through `POST /_emulator/restart`.
#[tokio::test]
async fn the_admin_restart_endpoint_restarts_the_server() {
    let emu = Emulator::start_with_options(
        Store::new(100),
        "127.0.0.1:0".parse().unwrap(),
        Options {
            admin: true,
            ..Options::default()
        },
    )
    .await
    .unwrap();
    let client = emu.client_no_retry("test").await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let a = cms.create(&PostParams::default(), &cm("a")).await.unwrap();
    cms.create(&PostParams::default(), &cm("b")).await.unwrap();
    let remote = lastcall_testkit::kube::admin::RemoteJournal::new(&emu.url());
    let floor = remote.restart(Duration::from_millis(300)).await.unwrap();
    assert_eq!(api_err(cms.get("a").await).code, 503);
    assert_eq!(floor, emu.store().resource_version(), "the newest write's");
    assert_eq!(emu.store().oldest_resumable(), floor);
    wait_for("the server serves again", || async {
        cms.get("a").await.ok().map(|_| ())
    })
    .await;
    let mut w = cms
        .watch(&WatchParams::default(), &rv_of(&a).to_string())
        .await
        .unwrap()
        .boxed();
    assert!(matches!(next_event(&mut w).await, WatchEvent::Error(s) if s.code == 410));
    // A watch from the resourceVersion the restart answered resumes without listing.
    let mut w = cms
        .watch(&WatchParams::default(), &floor.to_string())
        .await
        .unwrap()
        .boxed();
    cms.create(&PostParams::default(), &cm("c")).await.unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "c"));
    // The remote journal carries each request's query: which resourceVersion it resumed.
    let watches: Vec<String> = remote
        .entries_since(0)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.verb == Verb::Watch && e.status == 200)
        .map(|e| e.query)
        .collect();
    assert!(
        watches
            .last()
            .is_some_and(|q| q.contains(&format!("resourceVersion={floor}"))),
        "{watches:?}"
    );
}

#[tokio::test]
async fn watch_with_node_field_selector_sees_only_that_node() {
    let b = Backend::emulator().await;
    conformance::watch_with_node_field_selector_sees_only_that_node(&b).await;
}

#[tokio::test]
async fn watch_with_label_selector_transitions() {
    let b = Backend::emulator().await;
    conformance::watch_with_label_selector_transitions(&b).await;
}

#[tokio::test]
async fn watch_bookmarks_timeout_and_initial_events() {
    let emu = Emulator::start_with_options(
        Store::new(100),
        "127.0.0.1:0".parse().unwrap(),
        Options {
            bookmark_interval: Duration::from_millis(50),
            ..Options::default()
        },
    )
    .await
    .unwrap();
    let client = emu.client().await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let c = cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let mut w = cms
        .watch(&WatchParams::default().timeout(1), &rv_of(&c).to_string())
        .await
        .unwrap()
        .boxed();
    let mut bookmarks = Vec::new();
    // The stream ends by itself after timeoutSeconds.
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(20), w.next())
        .await
        .unwrap()
    {
        if let WatchEvent::Bookmark(b) = ev.unwrap() {
            bookmarks.push(b.metadata.resource_version);
        }
    }
    assert!(!bookmarks.is_empty());
    assert!(bookmarks.iter().all(|rv| *rv == rv_of(&c).to_string()));
    // sendInitialEvents: ADDED for existing objects, then a bookmark marking the end.
    let mut w = cms
        .watch(&WatchParams::streaming_lists(), "")
        .await
        .unwrap()
        .boxed();
    let first = tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(describe(&first), ev("ADDED", "c1"));
    let second = tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let WatchEvent::Bookmark(b) = second else {
        panic!("expected the initial-events bookmark");
    };
    assert_eq!(
        b.metadata
            .annotations
            .get("k8s.io/initial-events-end")
            .map(String::as_str),
        Some("true")
    );
}

#[tokio::test]
async fn runtime_watcher_lists_watches_and_recovers_after_dropped_watches() {
    use kube::runtime::WatchStreamExt;
    use kube::runtime::watcher::{self, Event};
    let (emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    for n in ["a", "b", "c"] {
        cms.create(&PostParams::default(), &cm(n)).await.unwrap();
    }
    let mut w = watcher::watcher(cms.clone(), watcher::Config::default().page_size(2))
        .default_backoff()
        .boxed();
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .expect("a watcher event within 10 s")
            .expect("the watcher runs")
            .expect("no watcher error")
    };
    assert!(matches!(next().await, Event::Init));
    let mut initial = Vec::new();
    loop {
        match next().await {
            Event::InitApply(o) => initial.push(o.name_any()),
            Event::InitDone => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(initial, vec!["a", "b", "c"]);
    cms.create(&PostParams::default(), &cm("d")).await.unwrap();
    assert!(matches!(next().await, Event::Apply(o) if o.name_any() == "d"));
    let lists = emu.journal().count(|e| e.verb == Verb::List);
    assert_eq!(lists, 2, "two pages");
    emu.drop_watches();
    cms.create(&PostParams::default(), &cm("e")).await.unwrap();
    assert!(matches!(next().await, Event::Apply(o) if o.name_any() == "e"));
    cms.delete("a", &DeleteParams::default()).await.unwrap();
    assert!(matches!(next().await, Event::Delete(o) if o.name_any() == "a"));
    // It re-watched from its resourceVersion instead of listing again.
    assert_eq!(emu.journal().count(|e| e.verb == Verb::List), 2);
    assert!(emu.journal().count(|e| e.verb == Verb::Watch) >= 2);
}

// ---------------------------------------------------------------- selectors

#[tokio::test]
async fn field_selectors_on_lists() {
    let b = Backend::emulator().await;
    conformance::field_selectors_on_lists(&b).await;
}

#[tokio::test]
async fn label_selectors_with_every_operator() {
    let b = Backend::emulator().await;
    conformance::label_selectors_with_every_operator(&b).await;
}

#[tokio::test]
async fn list_pages_with_continue_tokens() {
    let b = Backend::emulator().await;
    conformance::list_pages_with_continue_tokens(&b).await;
}

// ---------------------------------------------------------------- eviction

#[tokio::test]
async fn eviction_blocked_by_the_agones_pdb() {
    let b = Backend::emulator_no_retry().await;
    conformance::eviction_blocked_by_the_agones_pdb(&b).await;
}

#[tokio::test]
async fn eviction_without_pdb_deletes_with_the_requested_grace() {
    let b = Backend::emulator().await;
    conformance::eviction_without_pdb_deletes_with_the_requested_grace(&b).await;
    // The HTTP status is 201.
    let created = b
        .emu()
        .journal()
        .filter(|e| e.subresource.as_deref() == Some("eviction"));
    assert_eq!(created.first().unwrap().status, 201);
}

#[tokio::test]
async fn eviction_budgets_count_healthy_pods() {
    let b = Backend::emulator_no_retry().await;
    conformance::eviction_budgets_count_healthy_pods(&b).await;
    conformance::eviction_budgets_by_share_count_healthy_pods(&b).await;
}

#[tokio::test]
async fn eviction_of_unready_pods_follows_the_unhealthy_pod_policy() {
    let b = Backend::emulator_no_retry().await;
    conformance::eviction_of_unready_pods_follows_the_unhealthy_pod_policy(&b).await;
}

// ---------------------------------------------------------------- discovery, journal, faults

#[tokio::test]
async fn discovery_finds_every_served_type() {
    let (_emu, client) = setup().await;
    let d = kube::discovery::Discovery::new(client.clone())
        .run()
        .await
        .unwrap();
    let (ar, caps) = d
        .resolve_gvk(&GroupVersionKind::gvk("agones.dev", "v1", "GameServer"))
        .expect("GameServer discovered");
    assert_eq!(ar.plural, "gameservers");
    assert!(caps.supports_operation(kube::discovery::verbs::WATCH));
    assert_eq!(caps.scope, kube::discovery::Scope::Namespaced);
    for (g, v, k) in [
        ("", "v1", "Pod"),
        ("", "v1", "Node"),
        ("policy", "v1", "PodDisruptionBudget"),
        ("events.k8s.io", "v1", "Event"),
        ("coordination.k8s.io", "v1", "Lease"),
        ("agones.dev", "v1", "Fleet"),
    ] {
        assert!(
            d.resolve_gvk(&GroupVersionKind::gvk(g, v, k)).is_some(),
            "{g}/{v} {k}"
        );
    }
    let info = client.apiserver_version().await.unwrap();
    assert_eq!(info.major, "1");
}

#[tokio::test]
async fn journal_records_requests_per_identity() {
    let (emu, _client) = setup().await;
    let agent = emu.client_as("agent-7").await.unwrap();
    let pods: Api<Pod> = Api::default_namespaced(agent.clone());
    let cms: Api<ConfigMap> = Api::default_namespaced(agent);
    emu.journal().clear();
    assert_eq!(api_err(pods.get("nope").await).code, 404);
    pods.list(&ListParams::default().labels("a=b"))
        .await
        .unwrap();
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let e = emu.journal().entries();
    assert_eq!(e.len(), 3);
    assert_eq!(e[0].identity.as_deref(), Some("agent-7"));
    assert_eq!(
        (e[0].verb, e[0].method.as_str(), e[0].status),
        (Verb::Get, "GET", 404)
    );
    assert_eq!(e[0].path, "/api/v1/namespaces/default/pods/nope");
    assert_eq!(
        (
            e[0].resource.as_deref(),
            e[0].namespace.as_deref(),
            e[0].name.as_deref()
        ),
        (Some("pods"), Some("default"), Some("nope"))
    );
    assert_eq!((e[1].verb, e[1].status), (Verb::List, 200));
    assert!(e[1].query.contains("labelSelector=a%3Db"), "{}", e[1].query);
    assert_eq!((e[2].verb, e[2].status), (Verb::Create, 201));
    assert!(e[0].seq < e[1].seq && e[1].seq < e[2].seq);
    assert_eq!(emu.journal().mutating_count(), 1);
    assert_eq!(emu.journal().requests_for("agent-7"), 3);
    assert!(emu.journal().bytes_for("agent-7") > 0);
    assert_eq!(emu.journal().bytes_for("someone-else"), 0);
    // Watch events are counted per identity.
    let mut w = cms
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "c1"));
    assert!(emu.journal().watch_events_for("agent-7") >= 1);
    assert_eq!(emu.journal().count(|e| e.verb == Verb::Watch), 1);
}

#[tokio::test]
async fn injected_faults_fail_or_delay_the_next_matching_requests() {
    let (emu, client) = setup_no_retry().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    emu.faults().inject(FaultRule::status(
        Some(Method::GET),
        "/configmaps/c1",
        2,
        500,
    ));
    for _ in 0..2 {
        let s = api_err(cms.get("c1").await);
        assert_eq!((s.code, s.reason.as_str()), (500, "InternalError"));
    }
    assert!(cms.get("c1").await.is_ok());
    // Method filter: a PATCH is not affected by a GET rule.
    emu.faults().inject(FaultRule {
        method: Some(Method::GET),
        path_contains: "/configmaps/c1".into(),
        times: 1,
        action: FaultAction::Status(429),
    });
    cms.patch(
        "c1",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "2"}})),
    )
    .await
    .unwrap();
    let s = api_err(cms.get("c1").await);
    assert_eq!((s.code, s.reason.as_str()), (429, "TooManyRequests"));
    assert_eq!(emu.faults().pending(), 0);
    // Delays hold the request, then serve it.
    let delay = Duration::from_millis(300);
    emu.faults()
        .inject(FaultRule::delay(None, "/configmaps/c1", 1, delay));
    let t0 = std::time::Instant::now();
    assert_eq!(cms.get("c1").await.unwrap().data.unwrap()["k"], "2");
    assert!(t0.elapsed() >= delay);
    assert_eq!(emu.faults().pending(), 0);
    let failed = emu.journal().count(|e| e.status == 500);
    assert_eq!(failed, 2);
    // kube's default client retries a 503 by itself: two requests, one success.
    let retrying: Api<ConfigMap> =
        Api::default_namespaced(emu.client_as("retrying").await.unwrap());
    emu.faults()
        .inject(FaultRule::status(None, "/configmaps/c1", 1, 503));
    assert!(retrying.get("c1").await.is_ok());
    let statuses: Vec<u16> = emu
        .journal()
        .filter(|e| e.identity.as_deref() == Some("retrying"))
        .iter()
        .map(|e| e.status)
        .collect();
    assert_eq!(statuses, vec![503, 200]);
}

// ---------------------------------------------------------------- Agones, events, status

#[tokio::test]
async fn gameserver_status_travels_with_the_object() {
    let b = Backend::emulator().await;
    conformance::gameserver_status_travels_with_the_object(&b).await;
    let in_store = b
        .emu()
        .store()
        .get(&GAMESERVERS, Some("default"), "gs1")
        .unwrap();
    assert_eq!(in_store["status"]["state"], "Allocated");
    assert_eq!(in_store["metadata"]["generation"], 2);
}

/// The GameServer CRD's selectable fields (Agones 1.58 and later): refused by an older CRD
/// with a real server's 400, served by a newer one on lists and watches, an absent field
/// reading as "" and a watch seeing a server arrive when Agones names its node.
#[tokio::test]
async fn gameserver_selectable_fields_follow_the_crd() {
    let b = Backend::emulator().await;
    conformance::gameserver_selectable_fields_follow_the_crd(&b).await;
}

#[tokio::test]
async fn event_recorder_creates_then_patches_events() {
    let b = Backend::emulator().await;
    conformance::event_recorder_creates_then_patches_events(&b).await;
    let emu = b.emu();
    let path = "/apis/events.k8s.io/v1/namespaces/default/events";
    assert_eq!(
        emu.journal()
            .count(|e| e.path == path && e.verb == Verb::Create && e.status == 201),
        1
    );
    assert_eq!(
        emu.journal()
            .count(|e| e.path.starts_with(path) && e.verb == Verb::Patch && e.status == 200),
        1
    );
    let (events, _) = emu.store().list(&EVENTS_K8S, Some("default"));
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["series"]["count"], 2);
}

#[tokio::test]
async fn status_subresource_and_nodes() {
    let b = Backend::emulator().await;
    conformance::status_subresource_and_nodes(&b).await;
    let emu = b.emu();
    let stored = emu.store().get(&NODES, None, "n1").unwrap();
    assert_eq!(stored["status"]["conditions"][0]["status"], "True");
    let e = emu
        .journal()
        .filter(|e| e.subresource.as_deref() == Some("status"));
    assert_eq!((e.len(), e[0].verb), (1, Verb::Patch));
}

#[tokio::test]
async fn store_modify_is_atomic_and_skips_no_ops() {
    let store = Store::new(100);
    let created = store
        .create(
            &PODS,
            Some("default"),
            serde_json::to_value(pod("p1", Some("n1"), json!({}))).unwrap(),
        )
        .unwrap();
    let mut sub = store.subscribe();
    let rv = store.resource_version();
    let same = store
        .modify(&PODS, Some("default"), "p1", |_| Ok(()))
        .unwrap();
    assert_eq!(same, created);
    assert_eq!(store.resource_version(), rv);
    let changed = store
        .modify_status(&PODS, Some("default"), "p1", |o| {
            o["status"]["phase"] = json!("Succeeded");
            Ok(())
        })
        .unwrap();
    assert_eq!(changed["metadata"]["resourceVersion"], (rv + 1).to_string());
    let e = sub.recv().await.unwrap();
    assert_eq!((e.rv, e.name.as_str()), (rv + 1, "p1"));
    assert_eq!(e.old.as_ref().unwrap()["status"]["phase"], "Pending");
    // A closure error leaves the object alone.
    let err = store
        .modify(&PODS, Some("default"), "p1", |_| {
            Err(lastcall_testkit::kube::ApiError::bad_request("no"))
        })
        .unwrap_err();
    assert_eq!(err.code, 400);
    assert_eq!(store.resource_version(), rv + 1);
    assert_eq!(store.events_since(rv).unwrap().len(), 1);
}

// ---------------------------------------------------------------- the binary

#[tokio::test]
async fn binary_writes_a_kubeconfig_serves_and_exits_zero_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig.yaml");
    let bin = workspace_binary("lastcall-emulators", "lastcall-kube-emulator");
    let child = tokio::process::Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--kubeconfig-out"])
        .arg(&kubeconfig)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let path = kubeconfig.clone();
    wait_for("the emulator writes its kubeconfig", || {
        let path = path.clone();
        async move { path.exists().then_some(()) }
    })
    .await;
    let kc = kube::config::Kubeconfig::read_from(&kubeconfig).unwrap();
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    let client = Client::try_from(config).unwrap();
    let nodes: Api<Node> = Api::all(client);
    assert!(
        nodes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    signal(child.id().unwrap(), "TERM").await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("the emulator exits after SIGTERM")
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.starts_with("http://127.0.0.1:"), "{stdout}");
}

// ---------------------------------------------------------------- strictness: faults

#[tokio::test]
async fn watch_delivery_delay_holds_only_the_matching_watch() {
    use lastcall_testkit::kube::WatchDelay;
    let (emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let start = emu.store().resource_version().to_string();
    let mut prompt = pods
        .watch(&WatchParams::default().fields("spec.nodeName=n2"), &start)
        .await
        .unwrap()
        .boxed();
    let mut late = pods
        .watch(&WatchParams::default().fields("spec.nodeName=n1"), &start)
        .await
        .unwrap()
        .boxed();
    // Open watches are affected too: the rule is looked up for every line.
    emu.faults().delay_watches(
        WatchDelay::resource("pods", Duration::from_secs(3)).selector("spec.nodeName=n1"),
    );
    pods.create(&PostParams::default(), &pod("p1", Some("n1"), json!({})))
        .await
        .unwrap();
    pods.create(&PostParams::default(), &pod("p2", Some("n2"), json!({})))
        .await
        .unwrap();
    // The undelayed watch sees its pod, which was created after p1...
    assert_eq!(describe(&next_event(&mut prompt).await), ev("ADDED", "p2"));
    // ...while the delayed one still has nothing: its cache is stale.
    let early = tokio::time::timeout(Duration::from_millis(300), late.next()).await;
    assert!(early.is_err(), "the delayed watch got {early:?} early");
    assert!(emu.store().get(&PODS, Some("default"), "p1").is_some());
    // It arrives later, intact and in order.
    assert_eq!(describe(&next_event(&mut late).await), ev("ADDED", "p1"));
    // Without the rule, delivery is prompt again.
    emu.faults().clear_watch_delays();
    pods.delete("p1", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let deleted = tokio::time::timeout(Duration::from_secs(2), next_event(&mut late)).await;
    assert_eq!(describe(&deleted.unwrap()), ev("DELETED", "p1"));
}

#[tokio::test]
async fn watch_delay_matches_identity_and_resource() {
    use lastcall_testkit::kube::{WatchDelay, WatchKey};
    let faults = lastcall_testkit::kube::Faults::default();
    faults.delay_watches(
        WatchDelay::resource("gameservers", Duration::from_secs(1)).identity("agent-n1"),
    );
    let key = |resource: &str, identity: &str| WatchKey {
        resource: resource.into(),
        identity: Some(identity.into()),
        ..Default::default()
    };
    assert_eq!(
        faults.watch_delay(&key("gameservers", "agent-n1")),
        Duration::from_secs(1)
    );
    assert_eq!(
        faults.watch_delay(&key("gameservers", "other")),
        Duration::ZERO
    );
    assert_eq!(faults.watch_delay(&key("pods", "agent-n1")), Duration::ZERO);
    faults.clear();
    assert_eq!(
        faults.watch_delay(&key("gameservers", "agent-n1")),
        Duration::ZERO
    );
}

#[tokio::test]
async fn hang_fault_holds_a_request_until_released_or_abandoned() {
    let (emu, client) = setup_no_retry().await;
    // A client that gives up after 300 ms never gets an answer, and nothing is served.
    emu.faults()
        .inject(FaultRule::hang(Some(Method::POST), "/configmaps", 1));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let err = http
        .post(format!(
            "{}/api/v1/namespaces/default/configmaps",
            emu.url()
        ))
        .header("content-type", "application/json")
        .body(json!({"metadata": {"name": "c1"}}).to_string())
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    wait_for("the abandoned request to be let go", || async {
        (emu.faults().hung_now() == 0).then_some(())
    })
    .await;
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "c1")
            .is_none()
    );
    assert_eq!(emu.journal().count(|e| e.verb == Verb::Create), 0);

    // A patient client is held until the fault is released, then served.
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    emu.faults()
        .inject(FaultRule::hang(Some(Method::POST), "/configmaps", 1));
    let call = tokio::spawn(async move { cms.create(&PostParams::default(), &cm("c2")).await });
    wait_for("the request to be held", || async {
        (emu.faults().hung_now() == 1).then_some(())
    })
    .await;
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "c2")
            .is_none()
    );
    emu.faults().release_hangs();
    call.await.unwrap().unwrap();
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "c2")
            .is_some()
    );
    assert_eq!(emu.faults().hung_now(), 0);
    assert_eq!(emu.faults().pending(), 0);
}

#[tokio::test]
async fn a_lost_answer_fault_applies_the_write_and_answers_504() {
    let (emu, client) = setup_no_retry().await;
    emu.faults()
        .inject(FaultRule::lose_answer(Some(Method::POST), "/configmaps", 1));
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let err = cms
        .create(&PostParams::default(), &cm("c1"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 504),
        "{err:?}"
    );
    // Applied all the same, journaled as the server applied it, and counted as lost.
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "c1")
            .is_some()
    );
    let created: Vec<_> = emu
        .journal()
        .entries()
        .into_iter()
        .filter(|e| e.verb == Verb::Create)
        .collect();
    assert_eq!(created.len(), 1);
    assert_eq!(created[0].status, 201);
    assert_eq!(emu.faults().answers_lost(), vec![created[0].seq]);
    // Once: the next write is answered.
    cms.create(&PostParams::default(), &cm("c2")).await.unwrap();
    assert_eq!(emu.faults().answers_lost().len(), 1);
}

// ---------------------------------------------------------------- strictness: /status

#[tokio::test]
async fn pod_status_is_written_only_through_status() {
    let b = Backend::emulator().await;
    conformance::pod_status_is_written_only_through_status(&b).await;
    let stored = b.emu().store().get(&PODS, Some("default"), "p1").unwrap();
    assert_eq!(stored["status"]["phase"], "Running");
}

#[tokio::test]
async fn node_status_is_written_only_through_status() {
    let b = Backend::emulator().await;
    conformance::node_status_is_written_only_through_status(&b).await;
}

fn fleet_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("agones.dev", "v1", "Fleet"))
}

#[tokio::test]
async fn custom_resource_status_subresource_only_for_fleets() {
    let (_emu, client) = setup().await;
    let fleets: Api<DynamicObject> =
        Api::default_namespaced_with(client.clone(), &fleet_resource());
    let f: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "agones.dev/v1", "kind": "Fleet",
        "metadata": {"name": "f1"},
        "spec": {"replicas": 2},
        "status": {"replicas": 9},
    }))
    .unwrap();
    let created = fleets.create(&PostParams::default(), &f).await.unwrap();
    assert!(
        created.data.get("status").is_none(),
        "a CR create drops status"
    );
    let patched = fleets
        .patch(
            "f1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 3}, "status": {"replicas": 9}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data["spec"]["replicas"], 3);
    assert!(patched.data.get("status").is_none());
    // /status on a CR changes the status only: spec and metadata changes are dropped.
    let patched = fleets
        .patch_status(
            "f1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "1"}}, "spec": {"replicas": 1}, "status": {"replicas": 3}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data["status"]["replicas"], 3);
    assert_eq!(patched.data["spec"]["replicas"], 3);
    assert!(patched.labels().is_empty());
    // GameServers have no status subresource (their CRD declares none).
    let gs: Api<DynamicObject> = Api::default_namespaced_with(client, &gs_resource());
    gs.create(&PostParams::default(), &gameserver("gs1", "n1"))
        .await
        .unwrap();
    let s = api_err(
        gs.patch_status(
            "gs1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"state": "Allocated"}})),
        )
        .await,
    );
    assert_eq!(s.code, 404);
}

#[tokio::test]
async fn custom_resource_put_needs_a_resource_version() {
    let b = Backend::emulator().await;
    conformance::custom_resource_put_needs_a_resource_version(&b).await;
}

// ---------------------------------------------------------------- strictness: validation

#[tokio::test]
async fn labels_and_annotation_keys_are_validated() {
    let b = Backend::emulator().await;
    conformance::labels_and_annotation_keys_are_validated(&b).await;
}

#[tokio::test]
async fn duplicate_taints_are_invalid() {
    let b = Backend::emulator().await;
    conformance::duplicate_taints_are_invalid(&b).await;
}

#[tokio::test]
async fn pod_spec_is_immutable_but_for_what_the_server_allows() {
    let b = Backend::emulator().await;
    conformance::pod_spec_is_immutable_but_for_what_the_server_allows(&b).await;
}

#[tokio::test]
async fn malformed_tolerations_are_invalid() {
    let b = Backend::emulator().await;
    conformance::malformed_tolerations_are_invalid(&b).await;
}

#[tokio::test]
async fn new_pods_get_default_toleration_seconds() {
    let b = Backend::emulator().await;
    conformance::new_pods_get_default_toleration_seconds(&b).await;
    let emu = b.emu();
    // The control plane's own creates (the store) go through the same admission.
    let direct = emu
        .store()
        .create(
            &PODS,
            Some("default"),
            json!({"metadata": {"name": "direct"}, "spec": {"containers": [{"name": "c"}]}}),
        )
        .unwrap();
    assert_eq!(direct["spec"]["tolerations"].as_array().unwrap().len(), 2);
    // Only creation: other kinds are untouched.
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "plain")
            .is_none()
    );
}

#[tokio::test]
async fn binding_assigns_a_node_once() {
    let b = Backend::emulator().await;
    conformance::binding_assigns_a_node_once(&b).await;
}

/// The journal is the order writes were applied in, and a write anyone has seen in the
/// store is already journaled: the tests order what happened by it. (A write was once
/// journaled after its response was built, so a test that saw it in the store could count
/// the journal without it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_seen_in_the_store_is_already_journaled() {
    let (emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    cms.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "c"}, "data": {"n": "0"}})).unwrap(),
    )
    .await
    .unwrap();
    const WRITES: usize = 300;
    let writer = tokio::spawn(async move {
        for i in 1..=WRITES {
            cms.patch(
                "c",
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"n": i.to_string()}})),
            )
            .await
            .unwrap();
        }
    });
    let journal = emu.journal();
    let patched = || {
        journal
            .count(|e| e.method == "PATCH" && e.status < 300 && e.path.ends_with("/configmaps/c"))
    };
    let (mut checks, mut seen) = (0, 0);
    while seen < WRITES {
        // Read the store directly (as a test does), then the journal.
        seen = emu
            .store()
            .get(&CONFIGMAPS, Some("default"), "c")
            .and_then(|v| v["data"]["n"].as_str()?.parse().ok())
            .unwrap_or(0);
        let seen_at = std::time::SystemTime::now();
        let journaled = journal
            .filter(|e| e.method == "PATCH" && e.status < 300 && e.path.ends_with("/configmaps/c"));
        assert!(
            journaled.len() >= seen,
            "the store shows write {seen}, the journal holds {}",
            journaled.len()
        );
        // And its time is no later than the moment it was seen.
        if let Some(e) = seen.checked_sub(1).and_then(|i| journaled.get(i)) {
            assert!(
                e.at <= seen_at,
                "write {seen} journaled as after it was seen"
            );
        }
        checks += 1;
        tokio::task::yield_now().await;
    }
    writer.await.unwrap();
    assert_eq!(patched(), WRITES);
    assert!(checks > WRITES / 10, "the reader kept up: {checks} checks");
}

/// Each write's body is journaled as sent (a DELETE's options, a patch), also when an
/// injected fault answers instead; reads carry none; the remote journal serves them on
/// request. Tests check what a client asked for by it (a graceful eviction's preconditions
/// and grace period).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_bodies_are_journaled_as_sent() {
    let emu = Emulator::start_with_options(
        Store::new(100),
        "127.0.0.1:0".parse().unwrap(),
        Options {
            admin: true,
            ..Options::default()
        },
    )
    .await
    .unwrap();
    let client = emu.client_no_retry("test").await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let a = cms.create(&PostParams::default(), &cm("a")).await.unwrap();
    cms.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "w"}})),
    )
    .await
    .unwrap();
    emu.faults().inject(FaultRule::status(
        Some(Method::DELETE),
        "/configmaps/a",
        1,
        503,
    ));
    let dp = DeleteParams {
        grace_period_seconds: Some(7),
        preconditions: Some(Preconditions {
            uid: a.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    assert_eq!(api_err(cms.delete("a", &dp).await).code, 503);
    cms.delete("a", &dp).await.unwrap();
    cms.get_opt("a").await.unwrap();

    let j = emu.journal().entries();
    let by = |verb: Verb| j.iter().filter(move |e| e.verb == verb).collect::<Vec<_>>();
    let created = by(Verb::Create);
    assert_eq!(
        created[0]
            .request
            .as_deref()
            .map(|v| &v["metadata"]["name"]),
        Some(&json!("a"))
    );
    assert_eq!(
        by(Verb::Patch)[0].request.as_deref(),
        Some(&json!({"data": {"k": "w"}}))
    );
    let deletes = by(Verb::Delete);
    assert_eq!(
        deletes.iter().map(|e| e.status).collect::<Vec<_>>(),
        [503, 200]
    );
    for d in &deletes {
        let body = d.request.as_deref().expect("a DELETE's options");
        assert_eq!(body["gracePeriodSeconds"], json!(7), "{body}");
        assert_eq!(
            body["preconditions"]["uid"].as_str(),
            a.metadata.uid.as_deref(),
            "{body}"
        );
    }
    assert!(by(Verb::Get).iter().all(|e| e.request.is_none()));
    // The remote journal: without bodies unless asked.
    let remote = lastcall_testkit::kube::admin::RemoteJournal::new(&emu.url());
    let plain = remote.entries_since(0).await.unwrap();
    assert!(plain.iter().all(|e| e.request.is_none()));
    let full = remote.entries_with_bodies_since(0).await.unwrap();
    let remote_deletes: Vec<_> = full.iter().filter(|e| e.verb == Verb::Delete).collect();
    assert_eq!(remote_deletes.len(), 2);
    for (r, l) in remote_deletes.iter().zip(&deletes) {
        assert_eq!(r.request, l.request);
    }
}
