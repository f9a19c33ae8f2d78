{{/* A service's Deployment. The pod stops like `llmesh up` stops a child: the preStop sleep
lets endpoints and discovery forget the pod first, SIGTERM then drains within graceSeconds,
and the kubelet's deadline covers both with a margin. Probes speak grpc.health.v1. */}}
{{- define "llmesh.deployment" -}}
{{- include "llmesh.sharedKeyStoreGuard" .root -}}
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
  selector:
    matchLabels:
      {{- include "llmesh.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "llmesh.labels" . | nindent 8 }}
      annotations:
        checksum/config: {{ include "llmesh.liveConfig" . | sha256sum }}
        {{- with .Values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      terminationGracePeriodSeconds: {{ add .Values.preStopSleepSeconds (ceil .Values.graceSeconds) 5 }}
      securityContext:
        runAsNonRoot: true
        runAsUser: 10001
        runAsGroup: 10001
        fsGroup: 10001
        seccompProfile:
          type: RuntimeDefault
      containers:
        - name: {{ .Chart.Name }}
          image: {{ include "llmesh.image" . | quote }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: {{ .Values.readOnlyRootFilesystem }}
            capabilities:
              drop: ["ALL"]
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
          {{- $secret := .Values.existingSecret | default (((.Values.global).existingSecret)) }}
          {{- if $secret }}
          envFrom:
            - secretRef:
                name: {{ $secret }}
          {{- end }}
          {{- $probe := include "llmesh.probeCommand" . }}
          {{- with .Values.startupProbe }}
          startupProbe:
            exec:
              command: {{ $probe }}
            {{- toYaml . | nindent 12 }}
          {{- end }}
          readinessProbe:
            exec:
              command: {{ $probe }}
            periodSeconds: 5
            timeoutSeconds: 5
            failureThreshold: 2
          livenessProbe:
            exec:
              command: {{ $probe }}
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
          emptyDir: {}
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
{{- end }}
{{- end -}}

{{/* grpc.health.v1 over the mesh's mTLS: the kubelet's own gRPC probe is plaintext and has no
client certificate, so the container asks itself with `python3 -m llmesh.rpc.probe` (which
reads LLMESH_TRUST and LLMESH_TLS_* like the service) at the address it binds. */}}
{{- define "llmesh.probeCommand" -}}
{{- if include "llmesh.bindsPodIP" . -}}
["sh", "-c", {{ printf "exec python3 -m llmesh.rpc.probe \"$K8S_POD_IP:%v\"" .Values.port | quote }}]
{{- else -}}
["python3", "-m", "llmesh.rpc.probe", {{ printf "127.0.0.1:%v" .Values.port | quote }}]
{{- end -}}
{{- end -}}
