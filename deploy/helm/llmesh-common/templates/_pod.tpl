{{/* The pod's standard knobs (podLabels, serviceAccount, security contexts, topology spread),
its state volume (an emptyDir, or a PersistentVolumeClaim: persistence) and the models an
image carries, copied onto that volume before the service starts (seedModels). */}}

{{/* podLabels (global.podLabels, then the chart's) under the chart's own labels, which win:
the selector must keep matching. */}}
{{- define "llmesh.podLabels" -}}
{{- $own := include "llmesh.labels" . | fromYaml -}}
{{- $extra := mergeOverwrite (deepCopy (((.Values.global).podLabels) | default dict)) (.Values.podLabels | default dict) -}}
{{- mergeOverwrite $extra $own | toYaml -}}
{{- end -}}

{{- define "llmesh.serviceAccountName" -}}
{{- $sa := .Values.serviceAccount | default dict -}}
{{- if $sa.create -}}
{{- $sa.name | default (include "llmesh.fullname" .) -}}
{{- else -}}
{{- $sa.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "llmesh.serviceAccount" -}}
{{- $sa := .Values.serviceAccount | default dict -}}
{{- if $sa.create }}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ include "llmesh.serviceAccountName" . }}
  labels:
    {{- include "llmesh.labels" . | nindent 4 }}
  {{- with $sa.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
automountServiceAccountToken: {{ $sa.automount | default false }}
{{- end }}
{{- end -}}

{{/* Non-root (the images' user 10001), seccomp on; podSecurityContext adds or replaces fields (set
key by key: a false or 0 given there wins, which a merge would drop). */}}
{{- define "llmesh.podSecurityContext" -}}
{{- $base := dict "runAsNonRoot" true "runAsUser" 10001 "runAsGroup" 10001 "fsGroup" 10001
    "seccompProfile" (dict "type" "RuntimeDefault") -}}
{{- range $key, $value := .Values.podSecurityContext | default dict }}{{ $_ := set $base $key $value }}{{ end -}}
{{- toYaml $base -}}
{{- end -}}

{{/* No privilege escalation, no capabilities, the root filesystem read-only unless
readOnlyRootFilesystem is false; securityContext adds or replaces fields. */}}
{{- define "llmesh.securityContext" -}}
{{- $base := dict "allowPrivilegeEscalation" false "readOnlyRootFilesystem" .Values.readOnlyRootFilesystem
    "capabilities" (dict "drop" (list "ALL")) -}}
{{- range $key, $value := .Values.securityContext | default dict }}{{ $_ := set $base $key $value }}{{ end -}}
{{- toYaml $base -}}
{{- end -}}

{{/* A constraint without a labelSelector spreads this service's pods. */}}
{{- define "llmesh.topologySpread" -}}
{{- $selector := dict "matchLabels" (include "llmesh.selectorLabels" . | fromYaml) -}}
{{- $out := list -}}
{{- range .Values.topologySpreadConstraints -}}
{{- $c := deepCopy . -}}
{{- if not (hasKey $c "labelSelector") -}}
{{- $_ := set $c "labelSelector" $selector -}}
{{- end -}}
{{- $out = append $out $c -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* persistence: the state volume (/var/lib/llmesh/state, LLMESH_STATE_DIR: config snapshots,
the gateway's keys and audit log without Redis, the model manager's registry and artifact store,
an engine's model cache).
  enabled: false              an emptyDir (sizeLimit), gone with the pod
  enabled, perPod: true       a PersistentVolumeClaim per pod (a generic ephemeral volume),
                              made and deleted with the pod: disk of a storage class
  enabled, perPod: false      one PersistentVolumeClaim (this chart's <fullname>-state, or
                              existingClaim) kept across pods and upgrades: one pod at a time */}}
{{- define "llmesh.persistence" -}}
{{- .Values.persistence | default dict | toJson -}}
{{- end -}}

{{- define "llmesh.sharedState" -}}
{{- $p := include "llmesh.persistence" . | fromJson -}}
{{- if and $p.enabled (not $p.perPod) }}true{{ end -}}
{{- end -}}

{{- define "llmesh.stateClaimName" -}}
{{- $p := include "llmesh.persistence" . | fromJson -}}
{{- $p.existingClaim | default (printf "%s-state" (include "llmesh.fullname" .)) -}}
{{- end -}}

{{- define "llmesh.claimSpec" -}}
{{- $p := include "llmesh.persistence" . | fromJson -}}
accessModes: {{ $p.accessModes | default (list "ReadWriteOnce") | toJson }}
{{- if $p.storageClass }}
storageClassName: {{ if eq $p.storageClass "-" }}""{{ else }}{{ $p.storageClass | quote }}{{ end }}
{{- end }}
resources:
  requests:
    storage: {{ required "persistence.size: the volume's size (e.g. 20Gi)" $p.size | quote }}
{{- end -}}

{{- define "llmesh.stateVolume" -}}
{{- $p := include "llmesh.persistence" . | fromJson -}}
{{- if and $p.enabled $p.perPod }}
ephemeral:
  volumeClaimTemplate:
    metadata:
      labels:
        {{- include "llmesh.selectorLabels" . | nindent 8 }}
    spec:
      {{- include "llmesh.claimSpec" . | nindent 6 }}
{{- else if $p.enabled }}
persistentVolumeClaim:
  claimName: {{ include "llmesh.stateClaimName" . }}
{{- else if $p.sizeLimit }}
emptyDir:
  sizeLimit: {{ $p.sizeLimit | quote }}
{{- else }}
emptyDir: {}
{{- end }}
{{- end -}}

{{/* The chart's own claim (persistence.enabled, not perPod, no existingClaim); kept when the
release is uninstalled: it holds the registry and the artifacts. */}}
{{- define "llmesh.pvc" -}}
{{- $p := include "llmesh.persistence" . | fromJson -}}
{{- if and (include "llmesh.sharedState" .) (not $p.existingClaim) }}
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {{ include "llmesh.stateClaimName" . }}
  labels:
    {{- include "llmesh.labels" . | nindent 4 }}
  annotations:
    helm.sh/resource-policy: keep
spec:
  {{- include "llmesh.claimSpec" . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* One state volume for every pod: one pod at a time (the registry's SQLite file, the audit
chain and the artifact store are not written by two pods at once). */}}
{{- define "llmesh.stateGuard" -}}
{{- if include "llmesh.sharedState" . -}}
{{- if or (gt (int .Values.replicaCount) 1) ((.Values.autoscaling).enabled) -}}
{{- fail (printf "%s: persistence (one PersistentVolumeClaim, %s) holds the state of one pod, and %d replicas (or autoscaling) would share it: run one replica, or set persistence.perPod=true (a volume per pod)" .Chart.Name (include "llmesh.stateClaimName" .) (int .Values.replicaCount)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* seedModels: a directory of models in the image (the CPU images carry SmolLM2), copied onto
the state volume's models/ before the service starts, file by file (each whole or not at all,
timestamps kept so the checksum sidecars stay valid), never over a file already there; ""
copies nothing. */}}
{{- define "llmesh.seedModels" -}}
{{- if .Values.seedModels }}
initContainers:
  - name: seed-models
    image: {{ include "llmesh.image" . | quote }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command:
      - python3
      - -c
      - |
        import shutil, sys
        from pathlib import Path
        src, dst = Path(sys.argv[1]), Path(sys.argv[2])
        for path in sorted(src.rglob("*")) if src.is_dir() else []:
            target = dst / path.relative_to(src)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            elif not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(target.name + ".seeding")
                shutil.copy2(path, partial)
                partial.replace(target)
                print(f"seeded {target}")
      - {{ .Values.seedModels | quote }}
      - /var/lib/llmesh/state/models
    securityContext:
      {{- include "llmesh.securityContext" . | nindent 6 }}
    resources:
      requests: {cpu: 100m, memory: 64Mi}
      limits: {memory: 128Mi}
    volumeMounts:
      - name: state
        mountPath: /var/lib/llmesh/state
{{- end }}
{{- end -}}
