{{/* Who may open a connection to each service's gRPC port (docs/security.md): the callers its
methods allow (llmesh.rpc.policy), by their pods' labels (app.kubernetes.io/name: <service>,
app.kubernetes.io/part-of: llmesh) in the release's namespace; `cli` is an operator's pod
(llmesh CLI, jobs) labelled app.kubernetes.io/name: cli. The gateway's API ports are open to
anyone. mTLS checks the caller's identity on every call; this keeps the rest of the cluster
from reaching the port at all. The kubelet's probes (httpGet /healthz and /readyz on the metrics
port) come from the pod's own node, which a NetworkPolicy never blocks: "traffic to and from the
node where a Pod is running is always allowed, regardless of the IP address of the Pod or the
node" (https://kubernetes.io/docs/concepts/services-networking/network-policies/), so the metrics
port stays open only to metricsFrom. */}}
{{- define "llmesh.callers" -}}
{{- $table := dict
    "gateway" list
    "engine" (list "gateway" "scheduler" "modelmgr")
    "cache" (list "gateway" "modelmgr" "cli")
    "scheduler" (list "gateway" "engine" "modelmgr" "cli")
    "modelmgr" (list "gateway" "engine" "cli") -}}
{{- index $table . | toJson -}}
{{- end -}}

{{- define "llmesh.networkPolicyValues" -}}
{{- mergeOverwrite (deepCopy (.Values.networkPolicy | default dict)) (((.Values.global).networkPolicy) | default dict) | toJson -}}
{{- end -}}

{{- define "llmesh.networkPolicy" -}}
{{- $np := include "llmesh.networkPolicyValues" . | fromJson -}}
{{- if $np.enabled }}
{{- $callers := include "llmesh.callers" .Chart.Name | fromJsonArray }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "llmesh.fullname" . }}
  labels:
    {{- include "llmesh.labels" . | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "llmesh.selectorLabels" . | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    - ports:
        - port: {{ .Values.port }}
          protocol: TCP
        {{- if .Values.httpPort }}
        - port: {{ .Values.httpPort }}
          protocol: TCP
        {{- end }}
      {{- if $callers }}
      from:
        {{- range $callers }}
        - podSelector:
            matchLabels:
              app.kubernetes.io/name: {{ . }}
              app.kubernetes.io/part-of: llmesh
        {{- end }}
      {{- end }}
    - ports:
        - port: {{ .Values.metricsPort }}
          protocol: TCP
      from:
        {{- required "networkPolicy.metricsFrom: who scrapes /metrics (e.g. Prometheus's namespace)" $np.metricsFrom | toYaml | nindent 8 }}
    {{- with $np.extraIngress }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
{{- end -}}
