{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "splitserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name: the release name, plus the chart name unless the release already contains it. */}}
{{- define "splitserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the operator pods; never change them after the first install (selectors are immutable). */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels on every object of the chart. */}}
{{- define "splitserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- end -}}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{/*
RBAC rules of the operator whose scope is in the list passed as "scopes".
The rules themselves live in files/rbac-rules.yaml, the only place they are written.
Usage: include "splitserve.rbacRules" (dict "root" . "scopes" (list "watched" "clusterOnly"))
*/}}
{{- define "splitserve.rbacRules" -}}
{{- $all := (.root.Files.Get "files/rbac-rules.yaml" | fromYaml).rules -}}
{{- if not $all -}}
{{- fail "files/rbac-rules.yaml is missing or has no rules" -}}
{{- end -}}
{{- range $all -}}
{{- if has .scope $.scopes }}
# {{ .why }}
- apiGroups: {{ .apiGroups | toJson }}
  resources: {{ .resources | toJson }}
  verbs: {{ .verbs | toJson }}
{{- end -}}
{{- end -}}
{{- end -}}
