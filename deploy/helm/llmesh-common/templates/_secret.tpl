{{/* The mesh's service secret (README: Internal trust): one Secret, shared by every service of
the namespace, mounted at /etc/llmesh-secret/secret. Its name: global.serviceSecret.name over
the chart's serviceSecret.name. */}}
{{- define "llmesh.serviceSecretName" -}}
{{- (((.Values.global).serviceSecret).name) | default ((.Values.serviceSecret).name) | default "llmesh-service-secret" -}}
{{- end -}}

{{- define "llmesh.serviceSecretDir" -}}/etc/llmesh-secret{{- end -}}

{{/* The Secret, with a random key on first install. lookup keeps the value on upgrade; a Secret
another release made (the first of several per-service releases) is left to it, not rendered
again (Helm would refuse to take it over). resource-policy keep: uninstalling one release
leaves the secret the others use. `helm template` has no cluster, so it renders it every time. */}}
{{- define "llmesh.serviceSecret" -}}
{{- $name := include "llmesh.serviceSecretName" . -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $name -}}
{{- $owner := "" -}}
{{- if $existing -}}
{{- $owner = index ($existing.metadata.annotations | default dict) "meta.helm.sh/release-name" | default "" -}}
{{- end -}}
{{- if or (not $existing) (eq $owner .Release.Name) }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ $name }}
  labels:
    app.kubernetes.io/part-of: llmesh
    app.kubernetes.io/managed-by: {{ .Release.Service }}
  annotations:
    helm.sh/resource-policy: keep
type: Opaque
data:
  secret: {{ index (($existing).data | default dict) "secret" | default (randAlphaNum 64 | b64enc) }}
{{- end }}
{{- end -}}
