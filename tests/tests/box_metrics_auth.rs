//! On the box: the agent's `/metrics` under `--metrics-auth=kubernetes`, as the chart runs it
//! on the host network, answered by the real API server's TokenReview and
//! SubjectAccessReview through the real agent binary (`kube_box::agent`: the chart's RBAC, a
//! TokenRequest token bound to the agent's pod).
//!
//! The truth is Kubernetes' convention for a component's `/metrics`: a request without a
//! valid bearer token is 401, a valid token whose user may not `get` the non-resource URL
//! `/metrics` is 403, and one that may is served. The probes stay on their own listener on
//! 127.0.0.1, without a token.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, PostParams};
use lastcall_testkit::eventually::try_eventually;
use lastcall_testkit::kube_box::agent::{AgentProcess, Extra, NAMESPACE};
use lastcall_testkit::kube_box::agones::{self, Crd};
use lastcall_testkit::kube_box::audit::AGENT_USER;
use lastcall_testkit::kube_box::{self, create_node};
use serde_json::{Value, json};

/// The host-network rendering of the chart (FleetIQ puts the agent on the host network).
fn hostnetwork_manifest() -> Vec<Value> {
    let path = lastcall_testkit::paths::package_dir().join("../manifests/lastcall-fleetiq.yaml");
    let text = std::fs::read_to_string(&path).expect("manifests/lastcall-fleetiq.yaml");
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("parsing the manifest");
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

fn doc(docs: &[Value], kind: &str, name: &str) -> Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name} not in manifests/lastcall-fleetiq.yaml"))
        .clone()
}

/// Creates or replaces a cluster-scoped object, so the box holds the chart's rules.
async fn apply<K>(api: &Api<K>, obj: Value)
where
    K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + std::fmt::Debug
        + k8s_openapi::serde::Serialize
        + k8s_openapi::serde::de::DeserializeOwned,
{
    let mut obj: K = serde_json::from_value(obj).expect("a chart object");
    let name = obj.meta().name.clone().expect("named");
    match api.get_opt(&name).await.expect("get") {
        None => {
            api.create(&PostParams::default(), &obj)
                .await
                .expect("create");
        }
        Some(have) => {
            obj.meta_mut().resource_version = have.meta().resource_version.clone();
            api.replace(&name, &PostParams::default(), &obj)
                .await
                .expect("replace");
        }
    }
}

/// A TokenRequest token of ServiceAccount `name` in the chart's namespace (created if needed).
async fn sa_token(client: &kube::Client, name: &str) -> String {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": NAMESPACE}}))
            .unwrap();
    match api.create(&PostParams::default(), &sa).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("ServiceAccount {name}: {e}"),
    }
    let req: TokenRequest = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": [], "expirationSeconds": 3600},
    }))
    .unwrap();
    let got: TokenRequest = api
        .create_subresource("token", name, &PostParams::default(), &req)
        .await
        .expect("TokenRequest");
    got.status.expect("token").token
}

/// The `/metrics` listener's address, from the agent's start-up line.
fn metrics_addr(agent: &AgentProcess) -> SocketAddr {
    agent
        .output()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["message"] == "lastcall-agent starting")
        .and_then(|v| v["metrics_listen"].as_str()?.parse().ok())
        .expect("the agent logs its metrics listener")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answer_only_a_token_the_api_server_authorizes() {
    let kbox = kube_box::lease().await;
    let admin = kbox.client().await.expect("admin client");
    // (The agent is ready once it knows how to select GameServers.)
    agones::install_crd(&admin, Crd::SelectableNodeName)
        .await
        .expect("GameServer CRD");
    let node = "metrics-auth";
    create_node(&admin, node).await.expect("kwok node");

    // The chart's host-network RBAC: the agent's review role, the reader role and its
    // binding to the chart's scraper ServiceAccount.
    let docs = hostnetwork_manifest();
    kube_box::agent::install_rbac(&admin).await.expect("rbac");
    let roles: Api<ClusterRole> = Api::all(admin.clone());
    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for name in ["lastcall-agent-metrics-auth", "lastcall-metrics-reader"] {
        apply(&roles, doc(&docs, "ClusterRole", name)).await;
    }
    for name in ["lastcall-agent-metrics-auth", "lastcall-metrics-reader"] {
        apply(&bindings, doc(&docs, "ClusterRoleBinding", name)).await;
    }
    let scraper = sa_token(&admin, "lastcall-metrics-scraper").await;
    let stranger = sa_token(&admin, "metrics-stranger").await;

    // The chart's host-network flags (packaging.rs checks the chart renders them), on
    // ephemeral ports of 127.0.0.1.
    let agent = AgentProcess::start(
        &kbox,
        node,
        Extra {
            args: vec![
                "--metrics-listen=127.0.0.1:0".into(),
                "--metrics-auth=kubernetes".into(),
            ],
            env: vec![],
        },
    )
    .await
    .expect("the agent");
    agent
        .ready()
        .await
        .expect("ready on the probes' listener without a token");
    let probes = agent.admin;
    let metrics = metrics_addr(&agent);
    assert_ne!(probes, metrics);
    let http = reqwest::Client::new();
    let get = |addr: SocketAddr, path: &str, token: Option<&str>| {
        let mut r = http.get(format!("http://{addr}{path}"));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };

    // The probes: on 127.0.0.1 only, no token, no /metrics there.
    assert_eq!(probes.ip().to_string(), "127.0.0.1");
    for path in ["/healthz", "/readyz"] {
        assert_eq!(
            get(probes, path, None).await.unwrap().status(),
            200,
            "{path}"
        );
    }
    assert_eq!(get(probes, "/metrics", None).await.unwrap().status(), 404);
    let elsewhere = SocketAddr::new("127.0.0.2".parse().unwrap(), probes.port());
    assert!(
        tokio::net::TcpStream::connect(elsewhere).await.is_err(),
        "the probes' listener answers on {elsewhere}"
    );

    // No token, a garbage token: 401 with the Bearer challenge.
    for token in [None, Some("not-a-token")] {
        let r = get(metrics, "/metrics", token).await.unwrap();
        assert_eq!(r.status(), 401, "{token:?}");
        // (RFC 6750's challenge: the scheme, perhaps with parameters.)
        let challenge = r
            .headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok());
        assert!(
            challenge.is_some_and(|c| c.split(' ').next() == Some("Bearer")),
            "{token:?}: {challenge:?}"
        );
    }
    // A valid token whose user may not get /metrics: 403, naming the user.
    let r = get(metrics, "/metrics", Some(&stranger)).await.unwrap();
    assert_eq!(r.status(), 403);
    let body = r.text().await.unwrap();
    assert!(
        body.contains("system:serviceaccount:lastcall:metrics-stranger"),
        "{body}"
    );
    // The chart's scraper: served.
    let r = get(metrics, "/metrics", Some(&scraper)).await.unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    assert!(
        body.contains("lastcall_metrics_auth_requests_total"),
        "{body}"
    );

    // The decisions were the API server's: the agent's own TokenReviews (the garbage
    // token's, the stranger's, the scraper's) and SubjectAccessReviews (the two valid
    // users'), each answered, in the box's audit log.
    let reviews = try_eventually(
        "the agent's reviews in the audit log",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let audit = kbox.audit();
            let count = |resource: &str| {
                audit
                    .iter()
                    .filter(|e| e.user == AGENT_USER && e.verb == "create")
                    .filter(|e| e.resource == resource)
                    .inspect(|e| assert_eq!(e.code, 201, "{resource}: {e:?}"))
                    .count()
            };
            let n = (count("tokenreviews"), count("subjectaccessreviews"));
            (n.0 >= 3 && n.1 >= 2).then_some(n)
        },
    )
    .await
    .expect("reviews");
    assert_eq!(reviews, (3, 2), "one review per token, no more");
    agent.stop().await.expect("stop");
}
