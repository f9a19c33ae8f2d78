{{/* A service's Deployment. The pod stops like `llmesh up` stops a child: the preStop sleep
lets endpoints and discovery forget the pod first, SIGTERM then drains within graceSeconds,
and the kubelet's deadline covers both with a margin. Probes are the kubelet's httpGet on the
metrics port's /healthz and /readyz (the grpc.health.v1 state, in plaintext). */}}
{{- define "llmesh.deployment" -}}
{{- include "llmesh.sharedKeyStoreGuard" .root -}}
{{- include "llmesh.stateGuard" .root -}}
{{- $extraEnv := .extraEnv | default "" -}}
{{- $podIP := .podIP | default false -}}
{{- $root := .root -}}
{{- with $root }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "llmesh.fullname" . }}
  labels:
    {{- include "llmesh.labels" . | nindent 4 }}
spec:
  {{- if not ((.Values.autoscaling).enabled) }}
  replicas: {{ .Values.replicaCount }}
  {{- end }}
  {{- if include "llmesh.sharedState" . }}
  strategy:
    type: Recreate   # one pod holds the state volume at a time
  {{- end }}
  selector:
    matchLabels:
      {{- include "llmesh.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "llmesh.podLabels" . | nindent 8 }}
      {{- /* No checksum of the live config here: a ConfigMap edit reaches the running pods
      (the kubelet swaps the mounted files, the services' watcher applies the change) and must
      not restart them. */}}
      {{- with .Values.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      serviceAccountName: {{ include "llmesh.serviceAccountName" . }}
      automountServiceAccountToken: {{ (.Values.serviceAccount).automount | default false }}
      {{- with .Values.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with .Values.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ add .Values.preStopSleepSeconds (ceil .Values.graceSeconds) 5 }}
      securityContext:
        {{- include "llmesh.podSecurityContext" . | nindent 8 }}
      {{- with (include "llmesh.seedModels" . | trim) }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: {{ .Chart.Name }}
          image: {{ include "llmesh.image" . | quote }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          securityContext:
            {{- include "llmesh.securityContext" . | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ .Values.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ .Values.metricsPort }}
              protocol: TCP
            {{- if .Values.httpPort }}
            - name: http
              containerPort: {{ .Values.httpPort }}
              protocol: TCP
            {{- end }}
          env:
            {{- if or $podIP (include "llmesh.bindsPodIP" .) }}
            - name: K8S_POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- end }}
            {{- with $extraEnv }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- include "llmesh.meshEnv" . | nindent 12 }}
            {{- include "llmesh.serviceEnv" . | nindent 12 }}
            {{- with .Values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $secret := .Values.existingSecret | default (((.Values.global).existingSecret)) }}
          {{- if $secret }}
          envFrom:
            - secretRef:
                name: {{ $secret }}
          {{- end }}
          {{- /* Plaintext /healthz on the metrics port (llmesh.metrics_http): the same state as
          grpc.health.v1, which the kubelet cannot ask over the mesh's mutual TLS. */}}
          {{- with .Values.startupProbe }}
          startupProbe:
            httpGet:
              path: /healthz
              port: metrics
            {{- toYaml . | nindent 12 }}
          {{- end }}
          readinessProbe:
            httpGet:
              path: /readyz
              port: metrics
            periodSeconds: 5
            timeoutSeconds: 5
            failureThreshold: 2
          livenessProbe:
            httpGet:
              path: /healthz
              port: metrics
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 6
          lifecycle:
            preStop:
              exec:
                command: ["sleep", "{{ .Values.preStopSleepSeconds }}"]
          {{- with .Values.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: live-config
              mountPath: /etc/llmesh
              readOnly: true
            - name: state
              mountPath: /var/lib/llmesh/state
            - name: tmp
              mountPath: /tmp
            - name: mesh-tls
              mountPath: {{ include "llmesh.tlsDir" . }}
              readOnly: true
            {{- with .Values.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: live-config
          configMap:
            name: {{ include "llmesh.fullname" . }}-config
        - name: state
          {{- include "llmesh.stateVolume" . | trim | nindent 10 }}
        - name: tmp
          emptyDir: {}
        - name: mesh-tls
          secret:
            secretName: {{ include "llmesh.tlsSecretName" . }}
            defaultMode: 0440
        {{- with .Values.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .Values.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- include "llmesh.topologySpread" $root | nindent 8 }}
      {{- end }}
{{- end }}
{{- end -}}
