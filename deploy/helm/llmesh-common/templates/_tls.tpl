{{/* Mesh TLS (LLMESH_TRUST=tls; docs/security.md). Every service mounts a Secret with its
certificate (tls.crt, tls.key: DNS SAN <service>.llmesh.internal, CN the service, one
certificate shared by the Deployment's replicas) and the mesh CA (ca.crt) at /etc/llmesh-tls.
The Secret comes from cert-manager when certManager.enabled (a Certificate per service, from
certManager.issuerRef: a CA issuer, so ca.crt is the mesh CA), or else is generated here with
sprig's genCA / genSignedCert: one CA Secret (meshCA.name) for the namespace, found with
`lookup` and reused (upgrades, and every per-service release after the first), and each
service's Secret kept as it is once it exists. `helm template` has no cluster to look in, so it
renders fresh ones every time. */}}

{{- define "llmesh.tlsDir" -}}/etc/llmesh-tls{{- end -}}

{{- define "llmesh.certManager" -}}
{{- mergeOverwrite (deepCopy (.Values.certManager | default dict)) (((.Values.global).certManager) | default dict) | toJson -}}
{{- end -}}

{{- define "llmesh.meshCAName" -}}
{{- (((.Values.global).meshCA).name) | default ((.Values.meshCA).name) | default "llmesh-mesh-ca" -}}
{{- end -}}

{{/* A chart's fullname by its values (the umbrella names its subcharts' Secrets with it):
(dict "root" $ "chart" "gateway" "values" $.Values.gateway). Same rule as llmesh.fullname. */}}
{{- define "llmesh.fullnameOf" -}}
{{- $values := .values | default dict -}}
{{- if $values.fullnameOverride -}}
{{- $values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .chart .root.Release.Name -}}
{{- .root.Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .root.Release.Name .chart | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "llmesh.tlsSecretNameFor" -}}{{ printf "%s-mesh-tls" . | trunc 63 }}{{- end -}}

{{- define "llmesh.tlsSecretName" -}}
{{- include "llmesh.tlsSecretNameFor" (include "llmesh.fullname" .) -}}
{{- end -}}

{{/* cert-manager's Certificate for one service: (dict "root" $ "service" "engine" "secret" NAME). */}}
{{- define "llmesh.certificate" -}}
{{- $cm := include "llmesh.certManager" .root | fromJson -}}
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ .secret }}
  labels:
    app.kubernetes.io/part-of: llmesh
    app.kubernetes.io/managed-by: {{ .root.Release.Service }}
spec:
  secretName: {{ .secret }}
  commonName: {{ .service }}
  dnsNames:
    - {{ printf "%s.llmesh.internal" .service }}
  usages: ["digital signature", "key encipherment", "server auth", "client auth"]
  privateKey:
    algorithm: ECDSA
    size: 256
    rotationPolicy: Always
  duration: {{ $cm.duration | default "2160h" }}
  renewBefore: {{ $cm.renewBefore | default "360h" }}
  issuerRef:
    name: {{ required "certManager.issuerRef.name: the cert-manager issuer of the mesh CA" ($cm.issuerRef).name }}
    kind: {{ ($cm.issuerRef).kind | default "Issuer" }}
    group: {{ ($cm.issuerRef).group | default "cert-manager.io" }}
{{- end -}}

{{/* Generated certificates: the CA Secret (unless another release made it) and one Secret per
(service, secret name) in .services, signed by that CA. (dict "root" $ "services" (list (list svc name) ...)) */}}
{{- define "llmesh.generatedTLS" -}}
{{- $root := .root -}}
{{- $ns := $root.Release.Namespace -}}
{{- $caName := include "llmesh.meshCAName" $root -}}
{{- $existing := lookup "v1" "Secret" $ns $caName -}}
{{- $ca := dict -}}
{{- $owner := "" -}}
{{- if and $existing (index ($existing.data | default dict) "tls.crt") -}}
{{- $ca = buildCustomCert (index $existing.data "tls.crt") (index $existing.data "tls.key") -}}
{{- $owner = index ($existing.metadata.annotations | default dict) "meta.helm.sh/release-name" | default "" -}}
{{- else -}}
{{- $ca = genCA "llmesh mesh CA" 3650 -}}
{{- end -}}
{{- if or (not $existing) (eq $owner $root.Release.Name) }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ $caName }}
  labels:
    app.kubernetes.io/part-of: llmesh
    app.kubernetes.io/managed-by: {{ $root.Release.Service }}
  annotations:
    helm.sh/resource-policy: keep
type: Opaque
data:
  tls.crt: {{ $ca.Cert | b64enc }}
  tls.key: {{ $ca.Key | b64enc }}
{{- end }}
{{- range .services }}
{{- $service := index . 0 }}
{{- $name := index . 1 }}
{{- $current := lookup "v1" "Secret" $ns $name }}
---
apiVersion: v1
kind: Secret
metadata:
  name: {{ $name }}
  labels:
    app.kubernetes.io/part-of: llmesh
    app.kubernetes.io/component: {{ $service }}
    app.kubernetes.io/managed-by: {{ $root.Release.Service }}
type: kubernetes.io/tls
data:
  {{- if and $current (index ($current.data | default dict) "tls.crt") }}
  {{- toYaml $current.data | nindent 2 }}
  {{- else }}
  {{- $cert := genSignedCert $service nil (list (printf "%s.llmesh.internal" $service)) 365 $ca }}
  tls.crt: {{ $cert.Cert | b64enc }}
  tls.key: {{ $cert.Key | b64enc }}
  ca.crt: {{ $ca.Cert | b64enc }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* A service chart's own certificate: a Certificate, or a generated Secret when meshTLS.create. */}}
{{- define "llmesh.meshTLS" -}}
{{- $cm := include "llmesh.certManager" . | fromJson -}}
{{- if $cm.enabled }}
{{- include "llmesh.certificate" (dict "root" . "service" .Chart.Name "secret" (include "llmesh.tlsSecretName" .)) }}
{{- else if .Values.meshTLS.create }}
{{- include "llmesh.generatedTLS" (dict "root" . "services" (list (list .Chart.Name (include "llmesh.tlsSecretName" .)))) }}
{{- end }}
{{- end -}}
