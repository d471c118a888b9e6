//! Builders for the objects scenarios put into the cluster: nodes, Fleets, GameServers.
//!
//! Each builder renders the JSON a user (or the Agones chart) would send, so the model
//! and lastcall see exactly what a real cluster would hold.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Taint, Toleration};
use serde_json::{Value, json};

use super::objects::{EvictionSafe, keys};

/// A taint (`key=value:effect`).
pub fn taint(key: &str, value: &str, effect: &str) -> Taint {
    Taint {
        key: key.to_string(),
        value: (!value.is_empty()).then(|| value.to_string()),
        effect: effect.to_string(),
        time_added: None,
    }
}

/// A toleration with operator `Equal`; `effect` `""` matches every effect.
pub fn toleration_equal(key: &str, value: &str, effect: &str) -> Toleration {
    Toleration {
        key: Some(key.to_string()),
        operator: Some("Equal".to_string()),
        value: Some(value.to_string()),
        effect: (!effect.is_empty()).then(|| effect.to_string()),
        toleration_seconds: None,
    }
}

/// A toleration with operator `Exists`; `key` `""` tolerates every taint.
pub fn toleration_exists(key: &str, effect: &str) -> Toleration {
    Toleration {
        key: (!key.is_empty()).then(|| key.to_string()),
        operator: Some("Exists".to_string()),
        value: None,
        effect: (!effect.is_empty()).then(|| effect.to_string()),
        toleration_seconds: None,
    }
}

/// `toleration` limited to `seconds` on a NoExecute taint.
pub fn for_seconds(mut toleration: Toleration, seconds: i64) -> Toleration {
    toleration.toleration_seconds = Some(seconds);
    toleration
}

/// A Node as a kubelet registers it.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    pub unschedulable: bool,
    /// Reported Ready condition.
    pub ready: bool,
    /// InternalIP; [`crate::cluster::Cluster::add_node`] assigns one when `None`.
    pub internal_ip: Option<String>,
}

impl NodeSpec {
    /// A Ready, schedulable node with the usual hostname label.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        let mut labels = BTreeMap::new();
        labels.insert("kubernetes.io/hostname".to_string(), name.clone());
        labels.insert("kubernetes.io/os".to_string(), "linux".to_string());
        NodeSpec {
            name,
            labels,
            taints: Vec::new(),
            unschedulable: false,
            ready: true,
            internal_ip: None,
        }
    }

    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Adds taint `key=value:effect`.
    pub fn taint(mut self, key: &str, value: &str, effect: &str) -> Self {
        self.taints.push(taint(key, value, effect));
        self
    }

    /// `spec.unschedulable: true`.
    pub fn cordoned(mut self) -> Self {
        self.unschedulable = true;
        self
    }

    pub fn not_ready(mut self) -> Self {
        self.ready = false;
        self
    }

    pub fn internal_ip(mut self, ip: impl Into<String>) -> Self {
        self.internal_ip = Some(ip.into());
        self
    }

    /// The Node object.
    pub fn to_object(&self) -> Value {
        let mut spec = json!({});
        if !self.taints.is_empty() {
            spec["taints"] = json!(self.taints);
        }
        if self.unschedulable {
            spec["unschedulable"] = json!(true);
        }
        let (status, reason) = if self.ready {
            ("True", "KubeletReady")
        } else {
            ("False", "KubeletNotReady")
        };
        let mut node_status = json!({
            "conditions": [{
                "type": "Ready",
                "status": status,
                "reason": reason,
                "lastTransitionTime": crate::kube::store::now_rfc3339(),
            }],
        });
        if let Some(ip) = &self.internal_ip {
            node_status["addresses"] = json!([
                { "type": "InternalIP", "address": ip },
                { "type": "Hostname", "address": self.name },
            ]);
        }
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": { "name": self.name, "labels": self.labels },
            "spec": spec,
            "status": node_status,
        })
    }
}

/// What a GameServer (standalone or from a Fleet) is made of: its own labels and
/// annotations, `spec.eviction`, and the pod template.
#[derive(Debug, Clone, Default)]
pub struct GameServerTemplate {
    /// GameServer labels (not copied to the pod, as in Agones).
    pub labels: BTreeMap<String, String>,
    /// GameServer annotations.
    pub annotations: BTreeMap<String, String>,
    /// Pod template labels.
    pub pod_labels: BTreeMap<String, String>,
    /// Pod template annotations.
    pub pod_annotations: BTreeMap<String, String>,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
    /// `spec.eviction.safe`; `None` leaves it to the Agones default (Never).
    pub eviction_safe: Option<EvictionSafe>,
    /// Pod `terminationGracePeriodSeconds`; `None` leaves Kubernetes' 30 s.
    pub grace_seconds: Option<i64>,
    /// The game calls SDK `Ready()` only when the test says so ([`crate::cluster::Cluster::sdk_ready`]).
    pub manual_ready: bool,
    /// The pod template's `spec.nodeName`: the pod is created bound to that node, past the
    /// scheduler (as a pod a scheduler bound from a cache from before the node's cordon).
    pub node_name: Option<String>,
}

impl GameServerTemplate {
    /// `metadata` of the GameServer (or of a Fleet's `spec.template`).
    pub fn metadata(&self) -> Value {
        let mut annotations = self.annotations.clone();
        if self.manual_ready {
            annotations.insert(
                keys::SDK_READY_ANNOTATION.into(),
                keys::SDK_READY_MANUAL.into(),
            );
        }
        json!({ "labels": self.labels, "annotations": annotations })
    }

    /// The GameServer `spec`.
    pub fn spec(&self) -> Value {
        let mut pod_spec = json!({
            "containers": [{
                "name": "game",
                "image": "example.com/game:1",
                "ports": [{ "name": "default", "containerPort": 7654, "protocol": "UDP" }],
            }],
        });
        if !self.node_selector.is_empty() {
            pod_spec["nodeSelector"] = json!(self.node_selector);
        }
        if !self.tolerations.is_empty() {
            pod_spec["tolerations"] = json!(self.tolerations);
        }
        if let Some(g) = self.grace_seconds {
            pod_spec["terminationGracePeriodSeconds"] = json!(g);
        }
        if let Some(n) = &self.node_name {
            pod_spec["nodeName"] = json!(n);
        }
        let mut spec = json!({
            "container": "game",
            "ports": [{ "name": "default", "portPolicy": "Dynamic", "containerPort": 7654, "protocol": "UDP" }],
            "health": { "disabled": false, "initialDelaySeconds": 5, "periodSeconds": 5, "failureThreshold": 3 },
            "template": {
                "metadata": { "labels": self.pod_labels, "annotations": self.pod_annotations },
                "spec": pod_spec,
            },
        });
        if let Some(safe) = self.eviction_safe {
            spec["eviction"] = json!({ "safe": safe.as_str() });
        }
        spec
    }
}

/// Builder methods shared by [`FleetSpec`] and [`GameServerSpec`] (both hold a template).
macro_rules! template_builders {
    ($t:ty) => {
        impl $t {
            /// A GameServer label.
            pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
                self.template.labels.insert(key.into(), value.into());
                self
            }

            /// A GameServer annotation.
            pub fn annotation(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
                self.template.annotations.insert(key.into(), value.into());
                self
            }

            /// A pod template label.
            pub fn pod_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
                self.template.pod_labels.insert(key.into(), value.into());
                self
            }

            /// A pod template annotation.
            pub fn pod_annotation(
                mut self,
                key: impl Into<String>,
                value: impl Into<String>,
            ) -> Self {
                self.template
                    .pod_annotations
                    .insert(key.into(), value.into());
                self
            }

            pub fn node_selector(
                mut self,
                key: impl Into<String>,
                value: impl Into<String>,
            ) -> Self {
                self.template.node_selector.insert(key.into(), value.into());
                self
            }

            pub fn toleration(mut self, toleration: Toleration) -> Self {
                self.template.tolerations.push(toleration);
                self
            }

            pub fn eviction_safe(mut self, safe: EvictionSafe) -> Self {
                self.template.eviction_safe = Some(safe);
                self
            }

            pub fn grace_seconds(mut self, seconds: i64) -> Self {
                self.template.grace_seconds = Some(seconds);
                self
            }

            pub fn manual_ready(mut self) -> Self {
                self.template.manual_ready = true;
                self
            }

            /// The pod created bound to `node`, past the scheduler.
            pub fn bound_to(mut self, node: impl Into<String>) -> Self {
                self.template.node_name = Some(node.into());
                self
            }
        }
    };
}

/// An Agones Fleet.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    pub name: String,
    pub namespace: String,
    pub replicas: i64,
    pub template: GameServerTemplate,
}

impl FleetSpec {
    /// A Fleet of `replicas` servers in namespace `default`.
    pub fn new(name: impl Into<String>, replicas: i64) -> Self {
        FleetSpec {
            name: name.into(),
            namespace: "default".into(),
            replicas,
            template: GameServerTemplate::default(),
        }
    }

    pub fn namespace(mut self, ns: impl Into<String>) -> Self {
        self.namespace = ns.into();
        self
    }

    /// The Fleet object.
    pub fn to_object(&self) -> Value {
        json!({
            "apiVersion": "agones.dev/v1",
            "kind": "Fleet",
            "metadata": { "name": self.name, "namespace": self.namespace },
            "spec": {
                "replicas": self.replicas,
                "scheduling": "Packed",
                "strategy": { "type": "RollingUpdate" },
                "template": { "metadata": self.template.metadata(), "spec": self.template.spec() },
            },
        })
    }
}

template_builders!(FleetSpec);

/// A standalone Agones GameServer (no Fleet replaces it).
#[derive(Debug, Clone)]
pub struct GameServerSpec {
    pub name: String,
    pub namespace: String,
    pub template: GameServerTemplate,
}

impl GameServerSpec {
    /// A GameServer in namespace `default`.
    pub fn new(name: impl Into<String>) -> Self {
        GameServerSpec {
            name: name.into(),
            namespace: "default".into(),
            template: GameServerTemplate::default(),
        }
    }

    pub fn namespace(mut self, ns: impl Into<String>) -> Self {
        self.namespace = ns.into();
        self
    }

    /// The GameServer object, as a user creates it (the controller fills in defaults).
    pub fn to_object(&self) -> Value {
        let mut meta = self.template.metadata();
        meta["name"] = json!(self.name);
        meta["namespace"] = json!(self.namespace);
        json!({
            "apiVersion": "agones.dev/v1",
            "kind": "GameServer",
            "metadata": meta,
            "spec": self.template.spec(),
        })
    }
}

template_builders!(GameServerSpec);
