{{/* Chart name, cut to fit label values. */}}
{{- define "lastcall.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped prefix of every object name. */}}
{{- define "lastcall.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "lastcall.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "lastcall.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "lastcall.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lastcall
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: pass (list $ "agent"). */}}
{{- define "lastcall.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "lastcall.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Labels of one component's pods: the selector plus `part-of`, which scrape configs select. */}}
{{- define "lastcall.podLabels" -}}
{{ include "lastcall.selectorLabels" . }}
app.kubernetes.io/part-of: lastcall
{{- end -}}

{{/*
The registry every image comes from. Required: lastcall publishes no image of its own, and a
bare name would only show up as an ImagePullBackOff on every node.
*/}}
{{- define "lastcall.registry" -}}
{{- $r := trimSuffix "/" .Values.image.registry -}}
{{- required "image.registry is required: the registry and path prefix you pushed lastcall's two images to (or a release's registry), e.g. --set image.registry=123456789012.dkr.ecr.us-west-2.amazonaws.com/lastcall. How to build and push them: docs/install.md, section \"1. Images\"" $r -}}
{{- end -}}

{{/* Image of one component: pass (list $ .Values.agent.repository). */}}
{{- define "lastcall.image" -}}
{{- $root := index . 0 -}}
{{- $tag := default $root.Chart.AppVersion $root.Values.image.tag -}}
{{- printf "%s/%s:%s" (include "lastcall.registry" $root) (index . 1) $tag -}}
{{- end -}}

{{/*
The bundled Redis image: redis.bundled.image, a full reference (a release publishes no Redis
image; the default is the official one). The schema refuses the repository and tag keys of
earlier charts, which put it under image.registry.
*/}}
{{- define "lastcall.redisImage" -}}
{{- required "redis.bundled.image is required with the bundled Redis: the full reference of a Redis 7 image, e.g. docker.io/library/redis:7.2.10" .Values.redis.bundled.image -}}
{{- end -}}

{{/* prometheus.io scrape annotations for one pod: pass (list $ port). */}}
{{- define "lastcall.scrapeAnnotations" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.metrics.scrapeAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{- define "lastcall.agentServiceAccount" -}}
{{- default (printf "%s-agent" (include "lastcall.fullname" .)) .Values.agent.serviceAccount.name -}}
{{- end -}}

{{- define "lastcall.pubsubServiceAccount" -}}
{{- default (printf "%s-pubsub" (include "lastcall.fullname" .)) .Values.pubsub.serviceAccount.name -}}
{{- end -}}

{{/* Whether pubsub is deployed: something needs it (FleetIQ statuses, the webhook). */}}
{{- define "lastcall.pubsubEnabled" -}}
{{- if and .Values.pubsub.enabled (or .Values.fleetiq.enabled .Values.pubsub.webhook.enabled .Values.queue.enabled) -}}true{{- end -}}
{{- end -}}

{{/* Whether the agents publish their drain state (the webhook reads it). */}}
{{- define "lastcall.publishDrainState" -}}
{{- if or .Values.agent.publishDrainState .Values.pubsub.webhook.enabled -}}true{{- end -}}
{{- end -}}

{{/* Whether anything deployed uses Redis. */}}
{{- define "lastcall.redisNeeded" -}}
{{- /* Queue mode alone needs none: pubsub then runs without --redis-url. */ -}}
{{- if or .Values.fleetiq.enabled (and .Values.pubsub.enabled .Values.pubsub.webhook.enabled) (and .Values.agent.enabled (include "lastcall.publishDrainState" .)) -}}true{{- end -}}
{{- end -}}

{{/* Whether the bundled Redis is deployed. */}}
{{- define "lastcall.bundledRedis" -}}
{{- if and (include "lastcall.redisNeeded" .) .Values.redis.bundled.enabled (not .Values.redis.url) (not .Values.redis.existingSecret) -}}true{{- end -}}
{{- end -}}

{{/*
Whether the agent runs in the host network: `auto` turns it on when the agent reads instance
metadata (the instance id for FleetIQ, the IMDS, Auto Scaling hook, GCE and Azure sources),
which a pod's own network namespace may not reach (IMDSv2 hop limit 1; GKE Workload
Identity; AKS clusters that block pods from IMDS).
*/}}
{{- define "lastcall.hostNetwork" -}}
{{- $v := .Values.agent.hostNetwork -}}
{{- if eq (toString $v) "auto" -}}
{{- /* Queue mode reads nothing on the node: with it, an Auto Scaling hold learns of the
termination from the relayed event and the instance id from the Node, not from IMDS. */ -}}
{{- if or .Values.fleetiq.enabled .Values.agent.awsImds (and .Values.agent.asgLifecycle (not .Values.queue.enabled)) .Values.agent.gceMetadata .Values.agent.azureEvents -}}true{{- end -}}
{{- else if $v -}}true{{- end -}}
{{- end -}}

{{/*
Who may read the agent's /metrics (`--metrics-auth`): `auto` is `kubernetes` (a bearer token
the API server authenticates and authorizes) with hostNetwork, where the listener is on the
node's own address, and `none` in the pod network.
*/}}
{{- define "lastcall.metricsAuth" -}}
{{- $v := toString .Values.agent.metricsAuth -}}
{{- if eq $v "auto" -}}
{{- if include "lastcall.hostNetwork" . -}}kubernetes{{- else -}}none{{- end -}}
{{- else -}}{{ $v }}{{- end -}}
{{- end -}}

{{/* A monitor endpoint's credentials for the agents' /metrics: the chart's scraper token. */}}
{{- define "lastcall.scraperAuthorization" -}}
# The agents ask for a token (agent.metricsAuth): the scraper's, from the chart's Secret.
authorization:
  type: Bearer
  credentials:
    name: {{ include "lastcall.fullname" . }}-metrics-scraper-token
    key: token
{{- end -}}

{{/*
Whether the node-restriction policies are rendered. `auto`: against a live API server (its
discovery lists kinds, e.g. `v1/Pod`), when it serves ValidatingAdmissionPolicy v1; offline
(`helm template`), when the target Kubernetes version (--kube-version, default helm's own) is
1.30 or later. `true` renders them regardless, `false` never.
*/}}
{{- define "lastcall.nodeRestriction" -}}
{{- $v := toString .Values.agent.nodeRestriction.enabled -}}
{{- if eq $v "auto" -}}
{{- if .Capabilities.APIVersions.Has "v1/Pod" -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" -}}true{{- end -}}
{{- else if semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version -}}true{{- end -}}
{{- else if eq $v "true" -}}true{{- end -}}
{{- end -}}

{{/*
Entries of agent-writes.yaml that apply to this release, as a JSON list: pass (list $ entries).
An entry with `when: <value>` applies only where `agent.<value>` is set.
*/}}
{{- define "lastcall.agentWrites" -}}
{{- $root := index . 0 -}}
{{- $out := list -}}
{{- range (index . 1) -}}
{{- if or (not .when) (index $root.Values.agent .when) -}}
{{- $out = append $out . -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The keys of those entries, as a JSON list (a CEL list literal): pass (list $ entries). */}}
{{- define "lastcall.agentWriteKeys" -}}
{{- $out := list -}}
{{- range (include "lastcall.agentWrites" . | fromJsonArray) -}}
{{- $out = append $out .key -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The agent's priority class: the value, else the chart's own, else none. */}}
{{- define "lastcall.agentPriorityClass" -}}
{{- if .Values.agent.priorityClassName -}}
{{- .Values.agent.priorityClassName -}}
{{- else if .Values.priorityClass.create -}}
{{- printf "%s-node-agent" (include "lastcall.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "lastcall.redisAuthSecret" -}}
{{- required "redis.bundled.auth.existingSecret is required with the bundled Redis: create it with `kubectl -n <namespace> create secret generic lastcall-redis-auth --from-literal=password=\"$(openssl rand -hex 24)\" --from-literal=agent-password=\"$(openssl rand -hex 24)\"` (or set redis.url / redis.existingSecret for your own Redis)" .Values.redis.bundled.auth.existingSecret -}}
{{- end -}}

{{/*
The bundled Redis' two users (docs/install.md, "Redis users"). pubsub's publishes the statuses
and sets their cached keys (its scripts: GET, SET, PUBLISH, TIME), and the webhook reads and
prunes the drain state. The agents' subscribes to any instance's channel and reads the cached
keys (%R~: read only), and with the drain state published writes that hash; it can run no
PUBLISH, SET, EVAL or other write. The default user is off. Pass (list $ "pubsub"|"agent").
*/}}
{{- define "lastcall.redisAcl" -}}
{{- $root := index . 0 -}}
{{- $connection := "-@all +@connection -@admin -@dangerous +cluster|slots" -}}
{{- if eq (index . 1) "pubsub" -}}
resetkeys resetchannels ~lastcall:* &* {{ $connection }} +get +mget +set +publish +time +eval +evalsha +script|load +hget +hset +hdel +hgetall
{{- else -}}
resetkeys resetchannels %R~lastcall:status:* %R~lastcall:polled_at:* &* {{ $connection }} +subscribe +unsubscribe +get +mget
{{- if include "lastcall.publishDrainState" $root }} ~lastcall:drain-state* +hset +hdel{{ end -}}
{{- end -}}
{{- end -}}

{{/*
REDIS_URL (and the password it refers to) of one component as container env entries: pass
(list $ "agent"|"pubsub"). The bundled Redis' URL names the component's own Redis user and
its password through $(REDIS_PASSWORD), which the kubelet expands, so the password only ever
lives in the Secret. With redis.tls.caSecret, REDIS_CA_FILE names the mounted CA.
*/}}
{{- define "lastcall.redisEnv" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- with $root.Values.redis }}
{{- if .existingSecret }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ if eq $component "agent" }}{{ default .existingSecretKey .agentExistingSecretKey }}{{ else }}{{ .existingSecretKey }}{{ end }}
{{- else if .url }}
- name: REDIS_URL
  value: {{ .url | quote }}
{{- else if include "lastcall.bundledRedis" $root }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "lastcall.redisAuthSecret" $root }}
      key: {{ if eq $component "agent" }}{{ .bundled.auth.agentPasswordKey }}{{ else }}{{ .bundled.auth.existingSecretKey }}{{ end }}
- name: REDIS_URL
  value: {{ printf "redis://lastcall-%s:$(REDIS_PASSWORD)@%s-redis.%s.svc:6379" $component (include "lastcall.fullname" $root) (include "lastcall.namespace" $root) | quote }}
{{- else }}
{{- fail "Redis is needed (fleetiq.enabled, pubsub.webhook.enabled or agent.publishDrainState): keep redis.bundled.enabled, or set redis.url or redis.existingSecret" }}
{{- end }}
{{- if .tls.caSecret }}
- name: REDIS_CA_FILE
  value: /etc/lastcall/redis-ca/{{ .tls.caSecretKey }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The Redis CA volume mount and volume, when redis.tls.caSecret is set. */}}
{{- define "lastcall.redisCaMount" -}}
{{- if and (include "lastcall.redisNeeded" .) .Values.redis.tls.caSecret }}
- name: redis-ca
  mountPath: /etc/lastcall/redis-ca
  readOnly: true
{{- end }}
{{- end -}}
{{- define "lastcall.redisCaVolume" -}}
{{- if and (include "lastcall.redisNeeded" .) .Values.redis.tls.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.tls.caSecret }}
{{- end }}
{{- end -}}

{{/* The agent's volumes: the Redis CA, and the Secret holding the notification URL. */}}
{{- define "lastcall.agentMounts" -}}
{{ include "lastcall.redisCaMount" . }}
{{- if .Values.notifications.enabled }}
- name: notify-url
  mountPath: /etc/lastcall/notify
  readOnly: true
{{- end }}
{{- end -}}
{{- define "lastcall.agentVolumes" -}}
{{ include "lastcall.redisCaVolume" . }}
{{- with .Values.notifications }}
{{- if .enabled }}
- name: notify-url
  secret:
    secretName: {{ required "notifications.existingSecret is required when notifications.enabled is true: a Secret holding the webhook URL" .existingSecret }}
    items:
      - key: {{ .existingSecretKey }}
        path: {{ .existingSecretKey }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Rolls the pods when a setting they read from outside their own spec changes (the Redis
wiring, the groups). A Secret's content is not visible to the chart: after rotating one,
`kubectl rollout restart` the workloads.
*/}}
{{- define "lastcall.configChecksum" -}}
{{- dict "redis" .Values.redis "fleetiq" .Values.fleetiq | toJson | sha256sum | trunc 16 -}}
{{- end -}}

{{/* The security context both lastcall containers run with. */}}
{{- define "lastcall.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
