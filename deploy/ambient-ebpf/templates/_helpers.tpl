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
{{- end }}

{{- define "ambient-ebpf.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ambient-ebpf.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ambient-ebpf.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
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
