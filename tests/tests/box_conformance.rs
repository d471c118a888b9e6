//! The emulator's conformance cases (`lastcall_testkit::conformance`) on the box: the same
//! code, asserting the same answers, against a real kube-apiserver with its controllers. A
//! case that passes here and on the emulator (`kube_conformance.rs`) shows the emulator
//! answers as the real server does; docs/testing.md lists the cases that run on the
//! emulator only, and why.
//!
//! One box per test binary; each case takes its turn on it in a namespace of its own
//! (named after the case), with node names prefixed by that namespace, and deletes its
//! nodes afterwards so cluster-wide lists in later cases do not see them.

use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::DeleteParams;
use lastcall_testkit::conformance::{self, Backend};
use lastcall_testkit::kube_box::{self, Lease};

/// The case's namespace: its name, dashed, at most 40 characters (a second namespace and
/// node names are built from it).
fn namespace_of(case: &str) -> String {
    let ns: String = case.replace('_', "-").chars().take(40).collect();
    ns.trim_end_matches('-').to_string()
}

/// The case's turn on the box and its backend: a client without kube's retry of 429s (the
/// eviction cases read them, as on the emulator).
async fn backend(case: &str) -> (Lease, Backend) {
    let kbox = kube_box::lease().await;
    eprintln!("box started in {:?}", kbox.started_in());
    let mut config = kbox.admin_config().await.expect("the admin config");
    config.default_retry = false;
    let client = kube::Client::try_from(config).expect("a client");
    let b = Backend::on_server(client, &namespace_of(case)).await;
    (kbox, b)
}

/// Leaves the box as other cases expect it: the case's nodes and namespaces gone.
async fn clean(b: &Backend) {
    b.delete_nodes().await;
    let nss: Api<Namespace> = Api::all(b.client.clone());
    if let Ok(list) = nss.list_metadata(&Default::default()).await {
        for ns in list.items {
            let name = ns.metadata.name.unwrap_or_default();
            if name.starts_with(&b.ns) {
                let _ = nss.delete(&name, &DeleteParams::default()).await;
            }
        }
    }
}

macro_rules! on_box {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $case() {
                let (_kbox, b) = backend(stringify!($case)).await;
                conformance::$case(&b).await;
                clean(&b).await;
            }
        )*
    };
}

on_box!(
    resource_version_is_monotonic_across_resources,
    stale_replace_is_a_conflict,
    create_get_errors_have_real_statuses,
    delete_preconditions_conflict_and_keep_the_object,
    finalizers_keep_a_deleted_object_until_removed,
    pod_grace_period_keeps_a_bound_pod_terminating,
    unbound_pods_and_grace_zero_go_at_once,
    delete_collection_by_label,
    merge_patch_and_its_resource_version_guard,
    json_patch_and_failed_test_is_422,
    strategic_merge_of_conditions_not_of_custom_resources,
    watch_reports_added_modified_deleted,
    watch_resumes_after_a_resource_version,
    watch_with_label_selector_transitions,
    field_selectors_on_lists,
    label_selectors_with_every_operator,
    list_pages_with_continue_tokens,
    eviction_without_pdb_deletes_with_the_requested_grace,
    eviction_budgets_count_healthy_pods,
    eviction_of_unready_pods_follows_the_unhealthy_pod_policy,
    gameserver_status_travels_with_the_object,
    gameserver_selectable_fields_follow_the_crd,
    event_recorder_creates_then_patches_events,
    status_subresource_and_nodes,
    pod_status_is_written_only_through_status,
    node_status_is_written_only_through_status,
    custom_resource_put_needs_a_resource_version,
    labels_and_annotation_keys_are_validated,
    duplicate_taints_are_invalid,
    pod_spec_is_immutable_but_for_what_the_server_allows,
    malformed_tolerations_are_invalid,
    new_pods_get_default_toleration_seconds,
    binding_assigns_a_node_once,
);
