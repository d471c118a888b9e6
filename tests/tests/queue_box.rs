//! Queue mode's Node write is as narrow as the agents': on a real API server (the box), the
//! chart installed by the real `helm` with `queue.enabled`, a token of pubsub's
//! ServiceAccount writes the annotation `lastcall.dev/aws-events` on a Node, and every other
//! write it tries on a Node is refused — by the chart's ValidatingAdmissionPolicy (named in
//! the refusal) where RBAC lets the request through, by RBAC where the ClusterRole does not
//! grant the verb — and changes nothing.

use std::path::{Path, PathBuf};

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use lastcall_common::aws_events::{ANNOTATION, Event, Record, Relayed, SpotAction};
use lastcall_testkit::kube_box::agent::NAMESPACE;
use lastcall_testkit::kube_box::{self, KubeBox, create_node};
use serde_json::json;

const POLICY: &str = "lastcall-pubsub-node-writes";
const PUBSUB_SA: &str = "lastcall-pubsub";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The chart with queue mode on, by the box's `helm` (its `auto` policy switch reads the API
/// server's discovery).
fn install_chart(kbox: &KubeBox) {
    let bin = kube_box::bin_dir().expect("box binaries").join("helm");
    let home = tempfile::tempdir().expect("a home");
    let out = std::process::Command::new(bin)
        .args([
            "upgrade",
            "--install",
            "box",
            &repo().join("charts/lastcall").to_string_lossy(),
            "-n",
            NAMESPACE,
            "--create-namespace",
            "--set",
            "image.registry=registry.invalid/lastcall",
            "--set",
            "fullnameOverride=lastcall",
            "--set",
            "queue.enabled=true",
            "--set",
            "queue.url=https://sqs.us-west-2.amazonaws.com/123456789012/lastcall-interruptions",
            "--force-conflicts",
            "--kubeconfig",
            &kbox.dir().join("admin.kubeconfig").to_string_lossy(),
        ])
        .env_clear()
        .env("HOME", home.path())
        .env("HELM_CACHE_HOME", home.path().join("cache"))
        .env("HELM_CONFIG_HOME", home.path().join("config"))
        .env("HELM_DATA_HOME", home.path().join("data"))
        .output()
        .expect("helm runs");
    assert!(
        out.status.success(),
        "helm install: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn pubsub_client(kbox: &KubeBox, admin: &kube::Client) -> kube::Client {
    let req: TokenRequest = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": [], "expirationSeconds": 3600}}))
    .unwrap();
    let got: TokenRequest = Api::<ServiceAccount>::namespaced(admin.clone(), NAMESPACE)
        .create_subresource("token", PUBSUB_SA, &PostParams::default(), &req)
        .await
        .expect("a token of pubsub's ServiceAccount");
    let token = got.status.expect("a token").token;
    let cfg = kube_box::config_from(&kbox.kubeconfig(&token, "pubsub"))
        .await
        .expect("a kubeconfig");
    kube::Client::try_from(cfg).expect("a client")
}

fn refusal<T>(r: Result<T, kube::Error>) -> Option<(u16, String)> {
    match r {
        Ok(_) => None,
        Err(kube::Error::Api(s)) => Some((s.code, s.message)),
        Err(e) => Some((0, e.to_string())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsubs_token_writes_the_relayed_events_annotation_and_nothing_else_on_a_node() {
    let kbox = KubeBox::start().await.expect("the box");
    let admin = kbox.client().await.expect("admin");
    install_chart(&kbox);
    let node = "queue-box-n1";
    create_node(&admin, node).await.expect("node");
    let nodes_admin: Api<Node> = Api::all(admin.clone());
    let before = nodes_admin.get(node).await.expect("node");
    let pubsub = pubsub_client(&kbox, &admin).await;
    let nodes: Api<Node> = Api::all(pubsub.clone());

    // What pubsub does: one guarded JSON patch of the annotation.
    let record = Record::empty()
        .with(
            Relayed {
                instance: "i-0123456789abcdef0".into(),
                id: "e1".into(),
                time: jiff::Timestamp::now(),
                event: Event::SpotInterruption {
                    action: SpotAction::Terminate,
                },
            },
            jiff::Timestamp::now(),
        )
        .expect("a record");
    let merge = |v: serde_json::Value| Patch::Merge(v);
    let ok = nodes
        .patch(
            node,
            &PatchParams::default(),
            &merge(json!({"metadata": {"annotations": {ANNOTATION: record.to_annotation()}}})),
        )
        .await;
    assert!(ok.is_ok(), "pubsub's own write refused: {ok:?}");
    // Reading (get, list, watch) is what its watch needs.
    nodes.get(node).await.expect("get");
    nodes.list(&Default::default()).await.expect("list");

    let by_policy: Vec<(&str, Patch<serde_json::Value>)> = vec![
        (
            "a label",
            merge(json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}})),
        ),
        (
            "another annotation",
            merge(json!({"metadata": {"annotations": {"example.com/x": "y"}}})),
        ),
        ("a cordon", merge(json!({"spec": {"unschedulable": true}}))),
        (
            "a taint",
            merge(
                json!({"spec": {"taints": [{"key": "lastcall.dev/draining", "value": "x", "effect": "NoSchedule"}]}}),
            ),
        ),
        (
            "the record, 17 KiB",
            merge(json!({"metadata": {"annotations": {ANNOTATION: "x".repeat(17 * 1024)}}})),
        ),
        (
            "a finalizer",
            merge(json!({"metadata": {"finalizers": ["example.com/hold"]}})),
        ),
    ];
    for (what, patch) in by_policy {
        let got = refusal(nodes.patch(node, &PatchParams::default(), &patch).await);
        let Some((code, message)) = got else {
            panic!("{what}: admitted, but pubsub may write only {ANNOTATION}");
        };
        assert_eq!(code, 403, "{what}: {message}");
        assert!(
            message.contains(&format!("ValidatingAdmissionPolicy '{POLICY}'")),
            "{what}: refused, but not by {POLICY}: {message}"
        );
    }
    // Verbs the ClusterRole never grants: refused by RBAC before any policy.
    let rbac = [
        (
            "delete the Node",
            refusal(nodes.delete(node, &DeleteParams::default()).await),
        ),
        (
            "the Node's status",
            refusal(
                nodes
                    .patch_status(
                        node,
                        &PatchParams::default(),
                        &merge(json!({"status": {"phase": "x"}})),
                    )
                    .await,
            ),
        ),
        (
            "create a Node",
            refusal(
                nodes
                    .create(
                        &PostParams::default(),
                        &serde_json::from_value(json!({"metadata": {"name": "queue-box-forged"}}))
                            .unwrap(),
                    )
                    .await,
            ),
        ),
        (
            "a Pod",
            refusal(
                Api::<Pod>::namespaced(pubsub.clone(), NAMESPACE)
                    .list(&Default::default())
                    .await,
            ),
        ),
    ];
    for (what, got) in rbac {
        let Some((code, message)) = got else {
            panic!("{what}: admitted");
        };
        assert_eq!(code, 403, "{what}: {message}");
    }

    // Nothing but the annotation changed.
    let after = nodes_admin.get(node).await.expect("node");
    assert_eq!(after.spec, before.spec);
    assert_eq!(after.metadata.labels, before.metadata.labels);
    let mut annotations = after.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(annotations.remove(ANNOTATION), Some(record.to_annotation()));
    assert_eq!(
        annotations,
        before.metadata.annotations.clone().unwrap_or_default()
    );
    assert_eq!(after.metadata.finalizers, before.metadata.finalizers);
}
