{{/* Names and labels. A release named like the chart (helm install llmesh-scheduler ./scheduler)
or an umbrella release "llmesh" both give "llmesh-scheduler". */}}
{{- define "llmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "llmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "llmesh.labels" -}}
{{ include "llmesh.selectorLabels" . }}
app.kubernetes.io/part-of: llmesh
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "llmesh.image" -}}
{{- $tag := .Values.image.tag | default (((.Values.global).image).tag) | default .Chart.AppVersion -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* LLMESH_<PREFIX>_<KEY> for each entry of a settings map; values may use templates
(e.g. "{{ .Release.Name }}-scheduler:50052"); a map or list value is JSON, as the settings read it. */}}
{{- define "llmesh.settingsEnv" -}}
{{- $root := index . 0 -}}
{{- $prefix := index . 1 -}}
{{- range $key, $value := index . 2 }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ printf "%s%s" $prefix (upper $key) }}
  value: {{ if or (kindIs "map" $value) (kindIs "slice" $value) }}{{ toJson $value | quote }}{{ else }}{{ tpl (toString $value) $root | quote }}{{ end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The mesh-wide settings (MeshSettings, LLMESH_*): global.mesh over the chart's own mesh. */}}
{{- define "llmesh.mesh" -}}
{{- mergeOverwrite (deepCopy .Values.mesh) (((.Values.global).mesh) | default dict) | toJson -}}
{{- end -}}

{{/* Where the service binds. With Kubernetes Services as discovery (static), every
interface; with Consul or etcd the pod IP, because the bound address is what the service
registers there and what others dial. */}}
{{- define "llmesh.bindsPodIP" -}}
{{- if ne ((include "llmesh.mesh" . | fromJson).discovery | default "static") "static" }}true{{ end -}}
{{- end -}}

{{- define "llmesh.meshEnv" -}}
{{- $mesh := include "llmesh.mesh" . | fromJson -}}
{{- include "llmesh.settingsEnv" (list . "LLMESH_" $mesh) }}
- name: LLMESH_CONFIG_FILE
  value: /etc/llmesh/llmesh.yaml
- name: LLMESH_STATE_DIR
  value: /var/lib/llmesh/state
- name: LLMESH_TRUST
  value: "tls"
- name: LLMESH_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" (include "llmesh.tlsDir" .) | quote }}
- name: LLMESH_TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" (include "llmesh.tlsDir" .) | quote }}
- name: LLMESH_TLS_KEY_FILE
  value: {{ printf "%s/tls.key" (include "llmesh.tlsDir" .) | quote }}
{{- include "llmesh.secretEnv" . }}
{{- $otlp := .Values.tracing.otlpEndpoint | default (((.Values.global).tracing).otlpEndpoint) }}
{{- if $otlp }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $otlp | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "llmesh-%s" .Chart.Name | quote }}
{{- end }}
{{- end -}}

{{/* The service's own settings: what the chart manages, then .Values.settings. */}}
{{- define "llmesh.serviceEnv" -}}
{{- $prefix := printf "LLMESH_%s_" (upper .Chart.Name) -}}
- name: {{ $prefix }}HOST
  value: {{ if include "llmesh.bindsPodIP" . }}"$(K8S_POD_IP)"{{ else }}"0.0.0.0"{{ end }}
- name: {{ $prefix }}PORT
  value: {{ .Values.port | quote }}
- name: {{ $prefix }}METRICS_PORT
  value: {{ .Values.metricsPort | quote }}
- name: {{ $prefix }}GRACE_S
  value: {{ .Values.graceSeconds | quote }}
{{- if .Values.httpPort }}
- name: {{ $prefix }}HTTP_HOST
  value: "0.0.0.0"
- name: {{ $prefix }}HTTP_PORT
  value: {{ .Values.httpPort | quote }}
{{- end }}
{{- if .Values.workers }}
- name: {{ $prefix }}WORKERS
  value: {{ .Values.workers | quote }}
{{- end }}
{{- if eq .Chart.Name "gateway" }}
- name: {{ $prefix }}REQUIRE_AUTH
  value: "true"
{{- end }}
{{- /* The registry: SQLite on the state volume, unless secretEnv names the production database
(LLMESH_MODELMGR_DATABASE_URL from a Secret, e.g. postgresql+psycopg://...). */}}
{{- if and (eq .Chart.Name "modelmgr") (not (hasKey (include "llmesh.secretEnvValues" . | fromJson) (printf "%sDATABASE_URL" $prefix))) }}
- name: {{ $prefix }}DATABASE_URL
  value: "sqlite:////var/lib/llmesh/state/registry.db"
{{- end }}
{{- include "llmesh.settingsEnv" (list . $prefix .Values.settings) }}
{{- end -}}

{{/* Secrets as environment variables, each from a Secret's key (never a plain value):
global.secretEnv over the chart's secretEnv, {ENV_NAME: {secretName: ..., key: ...}}. */}}
{{- define "llmesh.secretEnvValues" -}}
{{- mergeOverwrite (deepCopy (.Values.secretEnv | default dict)) (((.Values.global).secretEnv) | default dict) | toJson -}}
{{- end -}}

{{- define "llmesh.secretEnv" -}}
{{- range $name, $ref := include "llmesh.secretEnvValues" . | fromJson }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $ref.secretName }}
      key: {{ $ref.key }}
{{- end }}
{{- end -}}

{{/* Two gateway replicas (or workers) must share one key store: API keys, limits and budgets
in Redis. Without it each pod keeps its own keys and one that never saw a key lets its
callers in (issue 25): refuse to render. */}}
{{- define "llmesh.sharedKeyStoreGuard" -}}
{{- if eq .Chart.Name "gateway" -}}
{{- $env := include "llmesh.secretEnvValues" . | fromJson -}}
{{- $hpa := .Values.autoscaling | default dict -}}
{{- $replicas := ternary (int ($hpa.maxReplicas | default 1)) (int .Values.replicaCount) (eq $hpa.enabled true) -}}
{{- $many := or (gt $replicas 1) (gt (int (.Values.workers | default 1)) 1) -}}
{{- if and $many (not (hasKey $env "LLMESH_REDIS_URL")) -}}
{{- fail (printf "gateway: %d replicas%s and %d workers per pod need a shared key store (API keys, limits, budgets): set secretEnv.LLMESH_REDIS_URL (global.secretEnv in the umbrella chart) to {secretName, key} of a Secret holding the Redis URL, or run one replica with one worker" $replicas (ternary " (autoscaling.maxReplicas)" "" (eq $hpa.enabled true)) (int (.Values.workers | default 1))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
