{{/* Chart name, overridable. */}}
{{- define "ambient-ebpf.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: the DaemonSet's name, which the agent checks on shutdown
(--daemonset-name), and the prefix of the other objects.
*/}}
{{- define "ambient-ebpf.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "ambient-ebpf.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "ambient-ebpf.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "ambient-ebpf.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ambient-ebpf.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ambient-ebpf.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ambient-ebpf.labels" -}}
helm.sh/chart: {{ include "ambient-ebpf.chart" . }}
{{ include "ambient-ebpf.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: istio
istio.io/rev: {{ .Values.revision | default "default" | quote }}
{{- end }}

{{- define "ambient-ebpf.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ambient-ebpf.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image: image.repository when set, else <hub>/<image.name> with hub from
image.hub, global.hub, then ghcr.io/ambient-ebpf. The tag is image.tag or
the chart's appVersion, never global.tag: Istio's release tags are not ours.
image.flavor "takeover" appends -takeover: the image with the iptables and
nft binaries a takeover from istio-cni needs (the Dockerfile's takeover target).
*/}}
{{- define "ambient-ebpf.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion | toString }}
{{- if eq .Values.image.flavor "takeover" }}
{{- $tag = printf "%s-takeover" $tag }}
{{- end }}
{{- if .Values.image.repository }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- else }}
{{- $hub := .Values.image.hub | default (index .Values.global "hub") | default "ghcr.io/ambient-ebpf" }}
{{- printf "%s/%s:%s" (trimSuffix "/" $hub) .Values.image.name $tag }}
{{- end }}
{{- end }}

{{- define "ambient-ebpf.pullPolicy" -}}
{{- .Values.image.pullPolicy | default (index .Values.global "imagePullPolicy") | default "IfNotPresent" }}
{{- end }}

{{/* imagePullSecrets and global.imagePullSecrets, as a JSON list of {name}. */}}
{{- define "ambient-ebpf.pullSecrets" -}}
{{- $out := list }}
{{- range concat (.Values.imagePullSecrets | default list) (index .Values.global "imagePullSecrets" | default list) }}
{{- $s := kindIs "string" . | ternary (dict "name" .) . }}
{{- if not (has $s $out) }}{{ $out = append $out $s }}{{ end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* --log-format: agent.logFormat, else json when global.logAsJson. */}}
{{- define "ambient-ebpf.logFormat" -}}
{{- .Values.agent.logFormat | default (ternary "json" "text" (index .Values.global "logAsJson" | default false)) }}
{{- end }}

{{/*
The platform (platform, then global.platform) and its host paths, as
Istio's platform profiles set them; "" is a plain node.
*/}}
{{- define "ambient-ebpf.platform" -}}
{{- $p := .Values.platform | default (index .Values.global "platform") | default "" }}
{{- if not (has $p (list "" "gke" "k3s" "k3d" "microk8s")) }}
{{- fail (printf "platform %q: want gke, k3s, k3d or microk8s (or empty)" $p) }}
{{- end }}
{{- $p }}
{{- end }}

{{/* Host CNI bin directories, a JSON list: cni.binDirs, else the platform's. */}}
{{- define "ambient-ebpf.cniBinDirs" -}}
{{- $byPlatform := dict "" (list "/opt/cni/bin") "gke" (list "/home/kubernetes/bin") "k3s" (list "/var/lib/rancher/k3s/data/cni") "k3d" (list "/bin") "microk8s" (list "/var/snap/microk8s/current/opt/cni/bin") }}
{{- toJson (.Values.cni.binDirs | default (get $byPlatform (include "ambient-ebpf.platform" .))) }}
{{- end }}

{{/* Host CNI configuration directory: cni.confDir, else the platform's. */}}
{{- define "ambient-ebpf.cniConfDir" -}}
{{- $k3s := "/var/lib/rancher/k3s/agent/etc/cni/net.d" }}
{{- $byPlatform := dict "" "/etc/cni/net.d" "gke" "/etc/cni/net.d" "k3s" $k3s "k3d" $k3s "microk8s" "/var/snap/microk8s/current/args/cni-network" }}
{{- .Values.cni.confDir | default (get $byPlatform (include "ambient-ebpf.platform" .)) }}
{{- end }}

{{/* Whether to render the ResourceQuota: resourceQuotas.enabled, else on GKE. */}}
{{- define "ambient-ebpf.resourceQuota" -}}
{{- $on := .Values.resourceQuotas.enabled }}
{{- if kindIs "invalid" $on }}{{ $on = eq (include "ambient-ebpf.platform" .) "gke" }}{{ end }}
{{- if $on }}true{{ end }}
{{- end }}

{{/* The repair mode, validated once for the DaemonSet and the RBAC. */}}
{{- define "ambient-ebpf.repairMode" -}}
{{- $mode := .Values.agent.repairMode | toString }}
{{- if not (has $mode (list "repair" "delete" "label" "off")) }}
{{- fail (printf "agent.repairMode must be repair, delete, label or off, not %q" $mode) }}
{{- end }}
{{- $mode }}
{{- end }}

{{/*
bpffs mount propagation. Kubernetes accepts Bidirectional only in privileged
containers; unprivileged, HostToContainer still shows the agent a bpffs the
host mounts later.
*/}}
{{- define "ambient-ebpf.bpffsPropagation" -}}
{{- if .Values.securityContext.privileged }}Bidirectional{{ else }}HostToContainer{{ end }}
{{- end }}

{{/*
--metrics-addr: agent.metricsAddress (empty: every address of the node) and
agent.metricsPort; an IPv6 literal gets its brackets.
*/}}
{{- define "ambient-ebpf.metricsAddr" -}}
{{- $host := .Values.agent.metricsAddress | default "" | toString }}
{{- if and (contains ":" $host) (not (hasPrefix "[" $host)) }}
{{- printf "[%s]:%v" $host .Values.agent.metricsPort }}
{{- else }}
{{- printf "%s:%v" $host .Values.agent.metricsPort }}
{{- end }}
{{- end }}

{{/* "true" when metrics are bound to loopback, where no scraper off the node reaches them. */}}
{{- define "ambient-ebpf.metricsLoopback" -}}
{{- if has (.Values.agent.metricsAddress | default "" | toString) (list "127.0.0.1" "::1" "[::1]" "localhost") }}true{{ end }}
{{- end }}
