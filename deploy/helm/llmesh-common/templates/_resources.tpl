{{/* The live config file: global.liveConfig (umbrella) over the chart's own. */}}
{{- define "llmesh.liveConfig" -}}
{{- ((.Values.global).liveConfig) | default .Values.liveConfig -}}
{{- end -}}

{{- define "llmesh.configmap" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "llmesh.fullname" . }}-config
  labels:
    {{- include "llmesh.labels" . | nindent 4 }}
data:
  llmesh.yaml: |
    {{- include "llmesh.liveConfig" . | nindent 4 }}
{{- end -}}

{{/* ClusterIP, or headless (engines: clients and the scheduler address each pod). */}}
{{- define "llmesh.service" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "llmesh.fullname" . }}
  labels:
    {{- include "llmesh.labels" . | nindent 4 }}
spec:
  {{- if .Values.service.headless }}
  clusterIP: None
  publishNotReadyAddresses: false
  {{- else }}
  type: {{ .Values.service.type }}
  {{- end }}
  selector:
    {{- include "llmesh.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ .Values.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ .Values.metricsPort }}
      targetPort: metrics
      protocol: TCP
    {{- if .Values.httpPort }}
    - name: http
      port: {{ .Values.httpPort }}
      targetPort: http
      protocol: TCP
    {{- end }}
{{- end -}}

{{- define "llmesh.pdb" -}}
{{- if .Values.podDisruptionBudget.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "llmesh.fullname" . }}
  labels:
    {{- include "llmesh.labels" . | nindent 4 }}
spec:
  {{- if hasKey .Values.podDisruptionBudget "minAvailable" }}
  minAvailable: {{ .Values.podDisruptionBudget.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .Values.podDisruptionBudget.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "llmesh.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* Prometheus Operator: a ServiceMonitor, or a PodMonitor (engines behind a headless
Service scale by the pod), when .Values.metrics.<kind>.enabled. */}}
{{- define "llmesh.monitors" -}}
{{- if .Values.metrics.serviceMonitor.enabled }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "llmesh.fullname" . }}
  labels:
    {{- include "llmesh.labels" . | nindent 4 }}
    {{- with .Values.metrics.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "llmesh.selectorLabels" . | nindent 6 }}
  endpoints:
    - port: metrics
      path: /metrics
      interval: {{ .Values.metrics.serviceMonitor.interval }}
{{- end }}
{{- if .Values.metrics.podMonitor.enabled }}
---
apiVersion: monitoring.coreos.com/v1
kind: PodMonitor
metadata:
  name: {{ include "llmesh.fullname" . }}
  labels:
    {{- include "llmesh.labels" . | nindent 4 }}
    {{- with .Values.metrics.podMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "llmesh.selectorLabels" . | nindent 6 }}
  podMetricsEndpoints:
    - port: metrics
      path: /metrics
      interval: {{ .Values.metrics.podMonitor.interval }}
{{- end }}
{{- end -}}
