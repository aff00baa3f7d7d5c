{{/* Names, labels and the pieces every Tandem pod shares. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name; short enough for the longest suffix ("-prefill-metrics"). */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "router"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" .ctx }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.modelDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.name }}
{{- end }}

{{- define "tandem.servedModelName" -}}
{{- default .Values.model.name .Values.model.servedModelName }}
{{- end }}

{{/* Comma-separated etcd client endpoints (host:port): the in-chart members or external ones. */}}
{{- define "tandem.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- $full := include "tandem.fullname" . }}
{{- $eps := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $eps = append $eps (printf "%s-etcd-%d.%s-etcd-headless.%s.svc:%d" $full $i $full $.Release.Namespace (int $.Values.etcd.clientPort)) }}
{{- end }}
{{- join "," $eps }}
{{- else }}
{{- required "etcd.externalEndpoints is required when etcd.enabled is false" (join "," .Values.etcd.externalEndpoints) }}
{{- end }}
{{- end }}

{{/* host:port of every router replica (StatefulSet pods through the headless Service). */}}
{{- define "tandem.routerAddresses" -}}
{{- $full := include "tandem.fullname" . }}
{{- $out := list }}
{{- range $i := until (int .Values.router.replicas) }}
{{- $out = append $out (printf "%s-router-%d.%s-router-headless.%s.svc:%d" $full $i $full $.Release.Namespace (int $.Values.router.port)) }}
{{- end }}
{{- join "," $out }}
{{- end }}

{{/* The env every Tandem container shares (the rest comes from its ConfigMap). */}}
{{- define "tandem.podEnv" -}}
- name: TANDEM_ADVERTISE_HOST
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{- end }}

{{/* Name/value env entries from a map: (dict "env" .Values.x.env). Sorted, values quoted. */}}
{{- define "tandem.envFromMap" -}}
{{- range $k, $v := .env }}
- name: {{ $k }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/* Volumes of the model: one volume named "model", plus the init container for source=image. */}}
{{- define "tandem.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model" (include "tandem.fullname" .)) .Values.model.pvc.existingClaim }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.image.sizeLimit }}
{{- end }}
{{- end }}

{{- define "tandem.modelInit" -}}
{{- if eq .Values.model.source "image" }}
initContainers:
  - name: copy-model
    image: {{ printf "%s:%s" (required "model.image.repository is required when model.source is image" .Values.model.image.repository) .Values.model.image.tag }}
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "cp -a \"$(SRC)\"/. /model-out/"]
    env:
      - name: SRC
        value: {{ .Values.model.image.path | quote }}
    volumeMounts:
      - {name: model, mountPath: /model-out}
    securityContext:
      allowPrivilegeEscalation: false
{{- end }}
{{- end }}

{{- define "tandem.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}

{{/* nodeSelector, tolerations and affinity of one component's values. */}}
{{- define "tandem.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "tandem.podCommon" -}}
serviceAccountName: {{ include "tandem.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Metrics flags, port and the OTLP endpoint; every service takes the same ones. */}}
{{- define "tandem.metricsPort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end }}


{{/* A PodDisruptionBudget: (dict "ctx" $ "component" "router" "pdb" .Values.router.pdb). */}}
{{- define "tandem.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.fullname" .ctx }}-{{ .component }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable | default 1 }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/* Where Secrets are mounted; the ConfigMaps point the services' TANDEM_* file flags here. */}}
{{- define "tandem.tlsDir" -}}/etc/tandem/tls{{- end }}
{{- define "tandem.etcdTlsDir" -}}/etc/tandem/etcd-tls{{- end }}
{{- define "tandem.apiKeysDir" -}}/etc/tandem/api-keys{{- end }}
{{- define "tandem.httpsDir" -}}/etc/tandem/https{{- end }}

{{- define "tandem.apiKeysFileEnabled" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.entries }}true{{- end }}
{{- end }}

{{/* Secret-backed volumes of a component: (dict "ctx" $ "component" "gateway"). */}}
{{- define "tandem.secretVolumes" -}}
{{- $v := .ctx.Values }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ default (printf "%s-tls" (include "tandem.fullname" .ctx)) $v.tls.secretName }}
{{- end }}
{{- if and $v.etcd.tls.secretName (ne .component "gateway") }}
- name: etcd-tls
  secret:
    secretName: {{ $v.etcd.tls.secretName }}
{{- end }}
{{- if and (eq .component "gateway") (include "tandem.apiKeysFileEnabled" .ctx) }}
- name: api-keys
  secret:
    secretName: {{ default (printf "%s-api-keys" (include "tandem.fullname" .ctx)) $v.apiKeys.existingSecret }}
    items:
      - key: {{ ternary $v.apiKeys.secretKey "keys.json" (not (empty $v.apiKeys.existingSecret)) }}
        path: keys.json
{{- end }}
{{- if and (eq .component "gateway") $v.gateway.httpsSecretName }}
- name: https
  secret:
    secretName: {{ $v.gateway.httpsSecretName }}
{{- end }}
{{- end }}

{{- define "tandem.secretMounts" -}}
{{- $v := .ctx.Values }}
{{- if $v.tls.enabled }}
- {name: tls, mountPath: {{ include "tandem.tlsDir" . }}, readOnly: true}
{{- end }}
{{- if and $v.etcd.tls.secretName (ne .component "gateway") }}
- {name: etcd-tls, mountPath: {{ include "tandem.etcdTlsDir" . }}, readOnly: true}
{{- end }}
{{- if and (eq .component "gateway") (include "tandem.apiKeysFileEnabled" .ctx) }}
- {name: api-keys, mountPath: {{ include "tandem.apiKeysDir" . }}, readOnly: true}
{{- end }}
{{- if and (eq .component "gateway") $v.gateway.httpsSecretName }}
- {name: https, mountPath: {{ include "tandem.httpsDir" . }}, readOnly: true}
{{- end }}
{{- end }}

{{/* The etcd password of router and workers (etcd authentication). */}}
{{- define "tandem.etcdPasswordEnv" -}}
{{- with .Values.etcd.auth.passwordSecret }}
- name: TANDEM_ETCD_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ . }}, key: password}
{{- end }}
{{- end }}

{{/*
Readiness, liveness and startup probes of a gRPC service: (dict "ctx" $ "port" 50051
"startupFailures" 90 "startupPeriod" 2). grpc.health.v1 "" (ready) is SERVING once the service
can take work (a worker registered in etcd, a router with its member view) and NOT_SERVING
while draining; "liveness" stays SERVING until exit unless a vital part died (a worker's engine
step thread). Kubelet gRPC probes speak no TLS: with tls.enabled they are TCP probes.
*/}}
{{- define "tandem.grpcProbes" -}}
{{- $tls := .ctx.Values.tls.enabled }}
readinessProbe:
  {{- if $tls }}
  tcpSocket: {port: {{ .port }}}
  {{- else }}
  grpc: {port: {{ .port }}, service: ""}
  {{- end }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  {{- if $tls }}
  tcpSocket: {port: {{ .port }}}
  {{- else }}
  grpc: {port: {{ .port }}, service: liveness}
  {{- end }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
startupProbe:
  {{- if $tls }}
  tcpSocket: {port: {{ .port }}}
  {{- else }}
  grpc: {port: {{ .port }}, service: liveness}
  {{- end }}
  periodSeconds: {{ .startupPeriod }}
  failureThreshold: {{ .startupFailures }}
{{- end }}

{{/* --extra-model of gateway and routers: SERVED=DIR of every extraModels entry, comma-separated. */}}
{{- define "tandem.extraModels" -}}
{{- $out := list }}
{{- range $m := .Values.extraModels }}
{{- $dir := printf "%s/%s" (trimSuffix "/" $.Values.model.mountPath) $m.name }}
{{- $out = append $out (printf "%s=%s" (default $m.name $m.servedModelName) $dir) }}
{{- end }}
{{- join "," $out }}
{{- end }}
