//! The resource types the emulator serves.
//!
//! A fixed table rather than dynamic CRD registration: lastcall only touches these kinds,
//! and a closed set lets discovery, routing and the cluster model share one definition.

/// One served resource type (group/version/plural), as discovery advertises it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResourceType {
    /// API group; `""` is the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
}

impl ResourceType {
    /// `"v1"` for the core group, `"group/version"` otherwise (the JSON `apiVersion`).
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Singular lower-case name, as discovery reports it.
    pub fn singular(&self) -> String {
        self.kind.to_ascii_lowercase()
    }

    /// `kind` of the list type (`PodList`).
    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    /// `plural.group` (`pods`, `gameservers.agones.dev`), used in error messages like the real server.
    pub fn qualified_plural(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `Kind` for the core group, `Kind.group` otherwise, as 422 messages name the kind.
    pub fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_string()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }

    /// Whether this is a custom resource (served from a CRD), which the server treats
    /// differently: no unconditional PUT, no strategic merge patch.
    pub fn is_custom(&self) -> bool {
        matches!(self.group, "agones.dev" | "karpenter.sh")
    }

    /// Whether the real API serves a `/status` subresource for this type. Where it does,
    /// writes to the main resource keep the stored status and writes to `/status` change
    /// only the status (see `Store`). GameServers have none: their CRD declares no status
    /// subresource, so status travels with the object.
    pub fn has_status_subresource(&self) -> bool {
        matches!(
            self.plural,
            "pods" | "nodes" | "poddisruptionbudgets" | "fleets" | "nodeclaims"
        )
    }

    /// Whether a `DELETE` of a removed object answers with the object (true) or a `Status`.
    pub fn returns_deleted_object(&self) -> bool {
        matches!(self.plural, "pods" | "gameservers" | "fleets")
    }

    /// Whether changes to `status` count as spec changes for `metadata.generation`
    /// (custom resources without a status subresource).
    pub fn status_bumps_generation(&self) -> bool {
        self.group == "agones.dev" && !self.has_status_subresource()
    }

    /// Short names advertised by discovery.
    pub fn short_names(&self) -> &'static [&'static str] {
        match self.plural {
            "pods" => &["po"],
            "nodes" => &["no"],
            "events" => &["ev"],
            "configmaps" => &["cm"],
            "poddisruptionbudgets" => &["pdb"],
            "gameservers" => &["gs"],
            "fleets" => &["flt"],
            _ => &[],
        }
    }

    /// Looks up a served type by group, version and plural.
    pub fn find(group: &str, version: &str, plural: &str) -> Option<ResourceType> {
        ALL.iter()
            .find(|rt| rt.group == group && rt.version == version && rt.plural == plural)
            .copied()
    }
}

pub const NODES: ResourceType = ResourceType {
    group: "",
    version: "v1",
    plural: "nodes",
    kind: "Node",
    namespaced: false,
};
pub const PODS: ResourceType = ResourceType {
    group: "",
    version: "v1",
    plural: "pods",
    kind: "Pod",
    namespaced: true,
};
/// Core `v1` events (what older recorders and `kubectl get events` use).
pub const EVENTS: ResourceType = ResourceType {
    group: "",
    version: "v1",
    plural: "events",
    kind: "Event",
    namespaced: true,
};
/// `events.k8s.io/v1` events (what kube-runtime's `events::Recorder` writes).
pub const EVENTS_K8S: ResourceType = ResourceType {
    group: "events.k8s.io",
    version: "v1",
    plural: "events",
    kind: "Event",
    namespaced: true,
};
pub const CONFIGMAPS: ResourceType = ResourceType {
    group: "",
    version: "v1",
    plural: "configmaps",
    kind: "ConfigMap",
    namespaced: true,
};
pub const LEASES: ResourceType = ResourceType {
    group: "coordination.k8s.io",
    version: "v1",
    plural: "leases",
    kind: "Lease",
    namespaced: true,
};
pub const PDBS: ResourceType = ResourceType {
    group: "policy",
    version: "v1",
    plural: "poddisruptionbudgets",
    kind: "PodDisruptionBudget",
    namespaced: true,
};
/// Agones GameServer; its CRD has no status subresource, so status travels with the object.
pub const GAMESERVERS: ResourceType = ResourceType {
    group: "agones.dev",
    version: "v1",
    plural: "gameservers",
    kind: "GameServer",
    namespaced: true,
};
pub const FLEETS: ResourceType = ResourceType {
    group: "agones.dev",
    version: "v1",
    plural: "fleets",
    kind: "Fleet",
    namespaced: true,
};

/// Karpenter v1's NodeClaim: cluster-scoped, the owner of the Node it launched. Its CRD
/// declares a status subresource.
pub const NODECLAIMS: ResourceType = ResourceType {
    group: "karpenter.sh",
    version: "v1",
    plural: "nodeclaims",
    kind: "NodeClaim",
    namespaced: false,
};

/// Every served type, in discovery order.
pub const ALL: &[ResourceType] = &[
    NODES,
    PODS,
    EVENTS,
    CONFIGMAPS,
    EVENTS_K8S,
    LEASES,
    PDBS,
    GAMESERVERS,
    FLEETS,
    NODECLAIMS,
];
