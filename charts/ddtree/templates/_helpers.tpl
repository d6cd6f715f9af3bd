{{- define "ddtree.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ddtree.operatorName" -}}
{{- printf "%s-operator" (include "ddtree.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ddtree.serviceAccountName" -}}
{{- default (include "ddtree.operatorName" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "ddtree.selectorLabels" -}}
app.kubernetes.io/name: ddtree-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ddtree.labels" -}}
{{ include "ddtree.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ddtree.image" -}}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) -}}
{{- end -}}
