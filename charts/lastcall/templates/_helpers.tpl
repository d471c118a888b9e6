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

{{/* Image of one component: pass (list $ .Values.agent.repository). */}}
{{- define "lastcall.image" -}}
{{- $root := index . 0 -}}
{{- $tag := default $root.Chart.AppVersion $root.Values.image.tag -}}
{{- if $root.Values.image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $root.Values.image.registry) (index . 1) $tag -}}
{{- else -}}
{{- printf "%s:%s" (index . 1) $tag -}}
{{- end -}}
{{- end -}}

{{- define "lastcall.agentServiceAccount" -}}
{{- default (printf "%s-agent" (include "lastcall.fullname" .)) .Values.agent.serviceAccount.name -}}
{{- end -}}

{{- define "lastcall.pubsubServiceAccount" -}}
{{- default (printf "%s-pubsub" (include "lastcall.fullname" .)) .Values.pubsub.serviceAccount.name -}}
{{- end -}}

{{/* Whether the bundled Redis is deployed. */}}
{{- define "lastcall.bundledRedis" -}}
{{- if and .Values.fleetiq.enabled .Values.redis.bundled.enabled -}}true{{- end -}}
{{- end -}}

{{- define "lastcall.redisAuthSecret" -}}
{{- default (printf "%s-redis-auth" (include "lastcall.fullname" .)) .Values.redis.bundled.auth.existingSecret -}}
{{- end -}}

{{/*
REDIS_URL (and the password it refers to) as container env entries. The bundled Redis' URL
names the password through $(REDIS_PASSWORD), which the kubelet expands, so the password
only ever lives in the Secret.
*/}}
{{- define "lastcall.redisEnv" -}}
{{- if include "lastcall.bundledRedis" . }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "lastcall.redisAuthSecret" . }}
      key: {{ .Values.redis.bundled.auth.existingSecretKey }}
- name: REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis.%s.svc:6379" (include "lastcall.fullname" .) (include "lastcall.namespace" .) | quote }}
{{- else if .Values.redis.existingSecret }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- else if .Values.redis.url }}
- name: REDIS_URL
  value: {{ .Values.redis.url | quote }}
{{- else }}
{{- fail "fleetiq.enabled needs Redis: keep redis.bundled.enabled, or set redis.url or redis.existingSecret" }}
{{- end }}
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
